"""Grading policies: over-long prompts, completions cut by the length limit, failed rewards.

The inputs of issue #14 items 2, 3 and 4 are here with their right values.
"""

import json
import math
import shutil

import numpy as np
import pytest

from rlax_pipe import grading
from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.pipeline import batching, trainer
from rlax_pipe.pipeline import config as pconfig
from rlax_pipe.pipeline import staleness
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.tasks import safe_reward
from rlax_pipe.types import FINISH_REASONS
from rlax_pipe.types import Rollout

STOP = "stop" if "stop" in FINISH_REASONS else "eos"  # finish reason of a stop token

TOK = tokenizer_lib.default_tokenizer()


def _rollout(sample_id, text="", finish=STOP, reward=0.0, group=0, prompt="Q: 5+7\n"):
  prompt_ids = np.asarray(TOK.encode_prompt(prompt), np.int32)
  ids = np.asarray(TOK.encode(text) + ([TOK.eos_id] if finish == STOP else []), np.int32)
  n = ids.shape[0]
  return Rollout(sample_id=sample_id, group_id=group, prompt_tokens=prompt_ids,
                 completion_tokens=ids, behavior_logprobs=np.zeros(n, np.float32),
                 policy_versions=np.zeros(n, np.int32), finish_reason=finish, reward=reward)


# ---- item 2: completions cut by the length limit -------------------------------------------------
def test_soft_overlong_penalty_matches_dapo_eq13():
  # Hand-computed: L_max = 100, L_cache = 20, so the penalty ramps over (80, 100].
  for length, expected in [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (100, -1.0),
                           (101, -1.0), (10_000, -1.0)]:
    assert grading.soft_overlong_penalty(length, 100, 20) == pytest.approx(expected, abs=1e-12)
  # Independent form: -clip((|y| - (L_max - L_cache)) / L_cache, 0, 1).
  lengths = np.arange(0, 300)
  reference = -np.clip((lengths - (256 - 64)) / 64, 0.0, 1.0)
  ours = [grading.soft_overlong_penalty(int(n), 256, 64) for n in lengths]
  np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-12)
  for bad in ((5, 10, 0), (5, 10, 10), (-1, 10, 2)):
    with pytest.raises(ValueError):
      grading.soft_overlong_penalty(*bad)


def test_issue_input_cut_completion_under_each_policy():
  # finish_reason "length", text "5+7=12\nA: 12", graded 1.0 by the verifier.
  cut = _rollout(0, "5+7=12\nA: 12", finish="length")
  budget = cut.num_completion_tokens  # it used its whole budget
  keep = grading.GradingConfig(overlong_policy="keep")
  mask = grading.GradingConfig(overlong_policy="mask")
  soft = grading.GradingConfig(overlong_policy="soft_penalty", overlong_buffer_tokens=4)
  assert grading.apply_overlong_policy(1.0, cut, keep, budget) == 1.0
  assert math.isnan(grading.apply_overlong_policy(1.0, cut, mask, budget))
  assert grading.apply_overlong_policy(1.0, cut, soft, budget) == 0.0   # 1 + (-1)
  # A completion that stopped on EOS is never masked; the soft penalty goes by length only.
  done = _rollout(1, "A: 12", finish=STOP)
  assert grading.apply_overlong_policy(1.0, done, mask, 100) == 1.0
  assert grading.apply_overlong_policy(1.0, done, soft, 100) == 1.0
  near = _rollout(2, "5+7=12\nA: 12", finish=STOP)                    # 12 tokens + EOS
  assert near.num_completion_tokens == 13
  # L_max 16, L_cache 4: ((16 - 4) - 13) / 4 = -0.25.
  assert grading.apply_overlong_policy(1.0, near, soft, 16) == pytest.approx(0.75)
  fixed = grading.GradingConfig(overlong_policy="soft_penalty", overlong_buffer_tokens=4,
                                overlong_max_tokens=1000)
  assert grading.apply_overlong_policy(1.0, cut, fixed, budget) == 1.0  # far below L_max
  assert math.isnan(grading.apply_overlong_policy(math.nan, cut, soft, budget))
  assert grading.batch_metrics([cut, done, near]) == {
      "frac_length_cut": pytest.approx(1 / 3), "samples_unrewarded": 0,
      "frac_prompt_truncated": 0.0}


# ---- item 3: prompts longer than the sampler allows ----------------------------------------------
LONG_PROMPT = "Q: " + "+".join(["7"] * 31) + "\n"   # BOS + 65 characters = 66 tokens


def test_issue_input_66_token_prompt_with_max_seq_len_48():
  assert len(TOK.encode_prompt(LONG_PROMPT)) == 66
  cfg = grading.GradingConfig()  # filter, min_completion_tokens 16
  filtered = grading.prepare_prompt(TOK, LONG_PROMPT, 48, cfg)
  assert filtered.ids is None and filtered.original_length == 66
  ok = grading.prepare_prompt(TOK, "Q: 1+2\n", 48, cfg)
  assert ok.ids.tolist() == TOK.encode_prompt("Q: 1+2\n") and not ok.truncated
  cut = grading.prepare_prompt(TOK, LONG_PROMPT, 48, grading.GradingConfig(
      prompt_policy="truncate"))
  assert cut.truncated and cut.ids.shape == (32,)            # 48 - 16: a real budget remains
  assert cut.ids[0] == TOK.bos_id                            # BOS kept
  assert TOK.decode(cut.ids) == LONG_PROMPT[:31]             # the head of the question kept
  with pytest.raises(ValueError, match="min_completion_tokens"):
    grading.prepare_prompt(TOK, "Q\n", 16, cfg)


def test_truncation_keeps_the_chat_generation_prompt(tmp_path):
  shutil.copy(tokenizer_lib.default_tokenizer_path(), tmp_path / "tokenizer.model")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
      "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
      "{% if add_generation_prompt %}<assistant>{% endif %}"), "bos_token": "<s>"}))
  tok = tokenizer_lib.load_tokenizer(tmp_path, prompt_format=tokenizer_lib.PromptFormat("chat"))
  tail = grading.generation_prompt_ids(tok)
  assert tok.decode(tail) == "<assistant>"
  cut = grading.prepare_prompt(tok, LONG_PROMPT, 64, grading.GradingConfig(
      prompt_policy="truncate"))
  ids = cut.ids.tolist()
  assert len(ids) == 48 and ids[0] == tok.bos_id and ids[-len(tail):] == tail
  assert tok.decode(ids).startswith("<user>Q: 7+7")   # BOS is skipped by decode
  assert tok.decode(ids).endswith("<assistant>")


# ---- item 4: rewards that fail -------------------------------------------------------------------
def test_issue_input_failed_reward_is_out_of_baseline_and_loss():
  rewards = [1.0, 0.0, math.nan, 1.0]  # [1, 0, None, 1]
  group = [_rollout(i, "A: 1", reward=r) for i, r in enumerate(rewards)]
  cfg = pconfig.PipelineConfig(group_size=4, seq_len=64,
                               staleness=staleness.StalenessConfig("block", max_lag=1, groups_per_step=1))
  batch, trained = trainer.build_batch([tuple(group)], cfg)
  assert [r.sample_id for r in trained] == [0, 1, 3]      # the unscored sample is not trained
  valid = np.asarray([1.0, 0.0, 1.0])
  expected = (valid - valid.mean()) / (valid.std() + 1e-6)   # GRPO over the scored samples only
  advantages = sorted(s.advantage for s in batching.unpack_batch(batch))
  np.testing.assert_allclose(advantages, sorted(expected), rtol=1e-5)
  assert int(batch.loss_mask.sum()) == 3 * group[0].num_completion_tokens
  # The old rule (failure = 0.0) would have given the failed sample advantage -1.


def test_group_without_any_reward_is_dropped_and_counted():
  queue = RolloutQueue(staleness.StalenessConfig(policy="drop", max_lag=4, groups_per_step=1),
                       group_size=2)
  for i in range(2):
    queue.put(_rollout(i, "A: 1", reward=math.nan, group=0))
  for i in range(2, 4):
    queue.put(_rollout(i, "A: 1", reward=1.0, group=1))
  waste = queue.stats().waste
  assert (waste.unscored_groups, waste.unscored_samples) == (1, 2)
  assert waste.unscored_tokens == 2 * _rollout(0, "A: 1").num_completion_tokens
  batch = queue.try_get_batch(1, learner_version=0)
  assert batch is not None and batch[0][0].group_id == 1


def test_failure_monitor_stops_with_a_message():
  monitor = grading.FailureMonitor(max_failure_fraction=0.5, window=4)
  ok, bad = safe_reward.Verdict(1.0, "ok"), safe_reward.Verdict(math.nan, "error",
                                                                "KeyError('bug')")
  for sid, v in enumerate([ok, bad, ok, bad, ok, bad]):  # 50%: not above the limit
    monitor.record(v, sid, "t")
  with pytest.raises(grading.RewardFailureError, match=r"3 of the last 4.*sample 1: error"):
    monitor.record(bad, 6, "t")                            # last 4: bad, ok, bad, bad
  never = grading.FailureMonitor(max_failure_fraction=1.0, window=2)
  for sid in range(5):
    never.record(bad, sid, "t")


def test_config_validation():
  for bad in ({"prompt_policy": "truncate_left"}, {"overlong_policy": "drop"},
              {"min_completion_tokens": 0}, {"overlong_max_tokens": 10,
                                             "overlong_buffer_tokens": 10},
              {"max_failure_fraction": 1.5}):
    with pytest.raises(ValueError):
      grading.GradingConfig(**bad)
