"""The rollout worker's grading path with a scripted engine (no model): prompts that do not fit,
prompt ids as the sampler sees them, failed and cut samples, per-step metrics."""

import json
import math
import shutil

import numpy as np
import pytest

from rlax_pipe import grading
from rlax_pipe import tasks
from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.pipeline import config as pconfig
from rlax_pipe.pipeline import staleness, trainer
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.pipeline.rollout_worker import RolloutWorker
from rlax_pipe.sampler import SamplerConfig
from rlax_pipe.types import FINISH_REASONS
from rlax_pipe.types import Rollout

STOP = "stop" if "stop" in FINISH_REASONS else "eos"  # finish reason of a stop token

TOK = tokenizer_lib.default_tokenizer()
LONG_PROMPT = "Q: " + "+".join(["7"] * 31) + "\n"   # 66 tokens with BOS


class ScriptedEngine:
  """Stands in for SamplerEngine: every request finishes at the next step with `complete(req)`
  -> (completion ids, finish_reason)."""

  def __init__(self, cfg, complete):
    self.cfg, self.complete, self.version = cfg, complete, 0
    self.latest_version = 0  # newest version handed over (SamplerEngine.latest_version)
    self.requests = []

  @property
  def has_work(self):
    return bool(self.requests)

  num_active = 0

  @property
  def num_slots(self):  # all replicas' slots (SamplerEngine.num_slots)
    return self.cfg.num_slots

  @property
  def num_waiting(self):
    return len(self.requests)

  def submit(self, request):
    assert request.prompt_tokens.shape[0] <= self.cfg.max_seq_len - 1
    self.requests.append(request)

  def unfinished(self):
    return {r.sample_id: None for r in self.requests}  # none has a token yet

  def step(self):
    out = []
    for req in self.requests:
      ids, reason = self.complete(req)
      ids = np.asarray(ids, np.int32)
      out.append(Rollout(sample_id=req.sample_id, group_id=req.group_id,
                         prompt_tokens=req.prompt_tokens, completion_tokens=ids,
                         behavior_logprobs=np.zeros(ids.shape, np.float32),
                         policy_versions=np.zeros(ids.shape, np.int32), finish_reason=reason,
                         prompt_index=req.prompt_index))
    self.requests = []
    return out


class VerdictTask:
  """Rewards by completion text: "A: <n>" right -> 1.0, "raise" -> error, "none" -> None."""

  name = "verdicts"

  def __init__(self, inner):
    self.inner = inner

  def problem(self, index, split="train"):
    return self.inner.problem(index, split)

  def num_problems(self, split="train"):
    return self.inner.num_problems(split)

  def sample_prompts(self, rng, n, split="train"):
    return self.inner.sample_prompts(rng, n, split)

  def reward(self, problem, completion):
    if completion == "raise":
      raise RuntimeError("verifier bug")
    if completion == "none":
      return None
    return self.inner.reward(problem, completion)


def _jsonl_task(tmp_path, prompts):
  path = tmp_path / "problems.jsonl"
  path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
  return tasks.JsonlTask(tasks.JsonlConfig(path=path, eval_fraction=0.0))


def _worker(task, complete, tok=TOK, group_size=2, max_seq_len=48, **grading_kw):
  sampler = SamplerConfig(num_slots=8, page_size=8, num_pages=64, max_seq_len=max_seq_len,
                          max_new_tokens=32)
  pipe = pconfig.PipelineConfig(
      group_size=group_size, seq_len=max_seq_len,
      staleness=staleness.StalenessConfig(policy="drop", max_lag=4, groups_per_step=1),
      grading=grading.GradingConfig(**grading_kw))
  queue = RolloutQueue(pipe.staleness, group_size)
  return RolloutWorker(ScriptedEngine(sampler, complete), task, tok, queue, pipe)


def _answer(text, reason=STOP):
  return lambda req: (TOK.encode(text) + ([TOK.eos_id] if reason == STOP else []), reason)


def test_issue_input_overlong_prompt_is_filtered_and_counted(tmp_path):
  task = _jsonl_task(tmp_path, ["Q: 1\n", LONG_PROMPT, "Q: 2\n"])
  worker = _worker(task, _answer("A: 1"))
  try:
    submitted = []
    for _ in range(3):
      worker.top_up()
      submitted += [r.prompt_index for r in worker.engine.requests]
      worker.step()
    texts = {task.problem(i).prompt for i in set(submitted)}
    assert LONG_PROMPT not in texts                          # never sampled, run goes on
    assert worker.pop_metrics()["filtered_overlong"] >= 1
    assert worker.pop_metrics()["filtered_overlong"] == 0    # per-step counts reset
  finally:
    worker.close()


def test_truncated_prompt_keeps_bos_and_head_and_marks_rollouts(tmp_path):
  task = _jsonl_task(tmp_path, [LONG_PROMPT])
  worker = _worker(task, _answer("A: 1"), prompt_policy="truncate", min_completion_tokens=16)
  try:
    worker.top_up()
    req = worker.engine.requests[0]
    assert req.prompt_tokens.shape == (32,) and req.prompt_tokens[0] == TOK.bos_id
    assert TOK.decode(req.prompt_tokens) == LONG_PROMPT[:31]
    rollouts = worker.step()
    assert rollouts and all(r.prompt_truncated for r in rollouts)
    metrics = worker.pop_metrics()
    groups = len({r.group_id for r in rollouts})
    assert metrics["prompts_truncated"] == groups and metrics["filtered_overlong"] == 0
    assert grading.batch_metrics(rollouts)["frac_prompt_truncated"] == 1.0
  finally:
    worker.close()


def test_failed_rewards_are_nan_counted_and_stop_the_run(tmp_path):
  outcomes = iter(["A: 1", "raise", "none", "A: 0"] + ["raise"] * 40)
  worker = _worker(VerdictTask(_jsonl_task(tmp_path, ["Q: 1\n"])),
                   lambda req: (TOK.encode(next(outcomes)), STOP), group_size=4,
                   failure_window=16, max_failure_fraction=0.5)
  try:
    worker.top_up()                                    # 3 groups of 4 fill the 8 slots + 1
    rollouts = worker.step()
    rewards = [r.reward for r in rollouts]
    assert rewards[0] == 1.0 and rewards[3] == 0.0
    assert all(math.isnan(x) for x in rewards[1:3] + rewards[4:])  # failures: no reward
    metrics = worker.pop_metrics()
    assert (metrics["reward_ok"], metrics["reward_error"], metrics["reward_invalid"]) == (2, 9, 1)
    assert metrics["reward_failed_frac"] == pytest.approx(10 / 12)
    worker.top_up()
    with pytest.raises(grading.RewardFailureError, match="of the last 16 reward calls"):
      worker.step()
  finally:
    worker.close()


@pytest.mark.parametrize("policy,expected", [("keep", 1.0), ("mask", math.nan),
                                             ("soft_penalty", 0.0), ("zero", 0.0)])
def test_overlong_policy_on_cut_completions(tmp_path, policy, expected):
  # The issue's sample: cut by the length limit while writing "5+7=12\nA: 12", graded 1.0.
  path = tmp_path / "p.jsonl"
  path.write_text(json.dumps({"prompt": "Q: 5+7\n", "answer": "12"}) + "\n")
  task = tasks.JsonlTask(tasks.JsonlConfig(path=path, eval_fraction=0.0))
  text_ids = TOK.encode("5+7=12\nA: 12")
  worker = _worker(task, lambda req: (text_ids, "length"), overlong_policy=policy,
                   overlong_buffer_tokens=4, overlong_max_tokens=len(text_ids))
  try:
    worker.top_up()
    rollouts = worker.step()
    for r in rollouts:
      assert (math.isnan(r.reward) and math.isnan(expected)) or r.reward == expected
    assert grading.batch_metrics(rollouts)["frac_length_cut"] == 1.0
  finally:
    worker.close()


def test_chat_prompt_ids_reach_the_learner_unchanged(tmp_path):
  """Sampler and learner see the same ids: chat-rendered prompt + sampled completion ids, even
  when the sampled ids are not how the tokenizer would encode the completion text."""
  shutil.copy(tokenizer_lib.default_tokenizer_path(), tmp_path / "tokenizer.model")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
      "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
      "{% if add_generation_prompt %}[assistant]{% endif %}"), "bos_token": "<s>"}))
  tok = tokenizer_lib.load_tokenizer(tmp_path, prompt_format=tokenizer_lib.PromptFormat("chat"))
  task = _jsonl_task(tmp_path, ["Q: 3+4\n"])
  # "A: 7" sampled as bytes of "7" (byte fallback pieces), not the canonical single piece.
  byte_7 = next(i for i in range(tok.vocab_size) if tok.id_to_piece(i) == "<0x37>")
  sampled = tok.encode("A: ") + [byte_7, tok.eos_id]
  assert tok.decode(sampled) == "A: 7" and tok.encode("A: 7") + [tok.eos_id] != sampled
  worker = _worker(task, lambda req: (sampled, STOP), tok=tok)
  try:
    worker.top_up()
    prompt = worker.engine.requests[0].prompt_tokens.tolist()
    assert prompt == tok.encode_prompt("Q: 3+4\n") and prompt[0] == tok.bos_id
    assert tok.decode(prompt) == "[user]Q: 3+4\n[assistant]"
    group = tuple(worker.step())
    batch, _ = trainer.build_batch([group], worker.cfg)
    row = batch.tokens[0][batch.segment_ids[0] == 1].tolist()
    assert row == prompt + sampled                          # exactly what was sampled
    mask = batch.loss_mask[0][batch.segment_ids[0] == 1]
    assert mask.tolist() == [0.0] * len(prompt) + [1.0] * len(sampled)
  finally:
    worker.close()


def test_default_does_not_reward_a_cut_answer(tmp_path):
  """Issue #27 item 12: with the default policy a completion cut inside (or after) its answer
  gets the wrong-answer reward 0.0; the same text that stopped gets 1.0."""
  assert grading.GradingConfig().overlong_policy == "zero"
  path = tmp_path / "p.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"Q: {k}\n", "answer": "12"}) + "\n"
                          for k in range(2)))
  task = tasks.JsonlTask(tasks.JsonlConfig(path=path, eval_fraction=0.0))
  text_ids = TOK.encode("5+7=12\nA: 12")
  finish = {"Q: 0\n": "length", "Q: 1\n": STOP}

  def complete(req):
    reason = finish[task.problem(req.prompt_index).prompt]
    return text_ids + ([TOK.eos_id] if reason == STOP else []), reason
  worker = _worker(task, complete)
  try:
    rewards = {}
    for _ in range(2):
      worker.top_up()
      rewards.update({task.problem(r.prompt_index).prompt: r.reward for r in worker.step()})
    assert rewards == {"Q: 0\n": 0.0, "Q: 1\n": 1.0}
  finally:
    worker.close()


def test_max_prefill_len_caps_prompts_below_the_sequence_budget(tmp_path):
  """Issue #27 item 8: prompts longer than max_prefill_len are filtered (or truncated to it)
  although they fit max_seq_len - min_completion_tokens; None keeps the old budget."""
  prompts = ["Q: 1+2\n", "Q: 1+2+3+4+5+6\n", "Q: 3\n"]    # 8, 16 and 6 tokens with BOS
  assert [len(TOK.encode_prompt(p)) for p in prompts] == [8, 16, 6]
  task = _jsonl_task(tmp_path, prompts)
  for kw, seen, lengths in [({}, {0, 1, 2}, {8, 16, 6}),
                            ({"max_prefill_len": 10}, {0, 2}, {8, 6}),
                            ({"max_prefill_len": 10, "prompt_policy": "truncate"}, {0, 1, 2},
                             {8, 10, 6})]:
    seen = {prompts[k] for k in seen}
    worker = _worker(task, _answer("A: 1"), max_seq_len=48, **kw)
    try:
      worker.top_up()  # 4 groups fill the 8 slots: more than one epoch of the 3 prompts
      requests = worker.engine.requests
      got = {task.problem(r.prompt_index).prompt for r in requests}
      got_lengths = {int(r.prompt_tokens.shape[0]) for r in requests}
      assert (got, got_lengths) == (seen, lengths), kw
      filtered = worker.pop_metrics()["filtered_overlong"]
      assert (filtered > 0) == (kw == {"max_prefill_len": 10})
    finally:
      worker.close()
  with pytest.raises(ValueError, match="max_prefill_len=40 exceeds"):
    _worker(task, _answer("A: 1"), max_seq_len=48, max_prefill_len=40)
  with pytest.raises(ValueError, match="max_prefill_len"):
    grading.GradingConfig(max_prefill_len=0)


THINK_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% if opened %}<think>\n{% endif %}"
                  "{% endif %}{# reasoning goes in <think> ... </think> #}")


def _think_tokenizer(tmp_path, **template_kwargs):
  shutil.copy(tokenizer_lib.default_tokenizer_path(), tmp_path / "tokenizer.model")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "chat_template": THINK_TEMPLATE, "bos_token": "<s>"}))
  return tokenizer_lib.load_tokenizer(tmp_path, prompt_format=tokenizer_lib.PromptFormat(
      "chat", template_kwargs=template_kwargs))


@pytest.mark.parametrize("opened", [False, True])
def test_grading_sees_only_the_text_after_the_reasoning_block(tmp_path, opened):
  """Issue #27 item 5: a tentative answer in <think>...</think> (markers from the chat template)
  is never graded; an unclosed block has no final answer. With `opened`, the generation prompt
  opens the block (DeepSeek-R1 style) and the completion starts inside it."""
  tok = _think_tokenizer(tmp_path, opened=opened)
  assert tok.reasoning_markers == ("<think>", "</think>")
  head = "" if opened else "<think>"
  completions = {   # prompt index -> (completion text, expected reward; the answer is "1")
      0: (head + "\nA: 1\nmaybe?</think>\nA: 2", 0.0),   # right only in the reasoning
      1: (head + "\nA: 2\nmaybe?</think>\nA: 1", 1.0),   # right after it
      2: (head + "\nso\nA: 1", 0.0),                       # never closed: no final answer
  }
  task = _jsonl_task(tmp_path, [f"Q: {k}\n" for k in completions])

  def key(req):
    return int(task.problem(req.prompt_index).prompt[3])

  def complete(req):
    return tok.encode(completions[key(req)][0]) + [tok.eos_id], STOP
  worker = _worker(task, complete, tok=tok, max_seq_len=64)
  plain = _worker(task, complete, tok=tok, max_seq_len=64, reasoning_markers="none")
  try:
    for w, expected in [(worker, {k: v[1] for k, v in completions.items()}),
                        (plain, {0: 1.0, 1: 0.0, 2: 1.0})]:  # "none": the first "A:" counts
      rewards = {}
      for _ in range(3):
        w.top_up()
        rewards.update({key(r): r.reward for r in w.step()})
      assert rewards == expected
  finally:
    worker.close()
    plain.close()
