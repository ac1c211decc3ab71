"""SFT warm start: packing of reference traces, a few steps on a tiny model, HF-format output."""

import json

import jax
import numpy as np
import pytest

from rlax_pipe import envs
from rlax_pipe import sft
from rlax_pipe import tasks
from rlax_pipe.config import ModelConfig
from rlax_pipe.config_dict import ConfigError
from rlax_pipe.model import hf_io
from rlax_pipe.tokenizer import default_tokenizer


def test_reference_rollout_is_prompt_plus_solution_plus_eos():
  tok, task = default_tokenizer(), tasks.ArithmeticTask()
  p = task.problem(0)
  r = sft.reference_rollout(p, tok, sample_id=7)
  assert tok.decode(r.completion_tokens) == p.solution
  assert r.completion_tokens[-1] == tok.eos_id
  assert r.prompt_tokens[0] == tok.bos_id


def test_next_batch_packs_consecutive_problems_into_fixed_rows():
  tok, task = default_tokenizer(), tasks.ArithmeticTask()
  batch, nxt = sft.next_batch(task, tok, 5, rows=2, seq_len=384)
  assert batch.tokens.shape == (2, 384)
  rows, cols = np.nonzero(batch.segment_ids)
  assert nxt - 5 == len(set(zip(rows.tolist(), batch.segment_ids[rows, cols].tolist())))
  assert np.all(batch.advantages[batch.loss_mask > 0] == 1.0)


def test_run_sft_tiny_learns_and_writes_loadable_checkpoint(tmp_path):
  tok = default_tokenizer()
  task = tasks.ArithmeticTask(tasks.ArithmeticConfig(max_terms=4))
  model_cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2,
                          n_kv_heads=1, head_dim=16, d_ff=64, max_seq_len=96)
  cfg = sft.SFTConfig(steps=12, rows=2, seq_len=96, learning_rate=1e-2, warmup_steps=2,
                      eval_problems=4, eval_slots=4, log_every=4)
  summary = sft.run_sft(task, tok, cfg, tmp_path / "out", model=model_cfg)
  assert summary["final_loss"] < 2.5  # from ~log(278) = 5.6 at init
  assert 0.0 <= summary["greedy_accuracy"] <= 1.0 and 0.0 <= summary["t1_accuracy"] <= 1.0
  loaded_cfg, params = hf_io.load_hf_checkpoint(tmp_path / "out")
  assert loaded_cfg.d_model == 32 and params["embed"].shape == (tok.vocab_size, 32)
  assert json.loads((tmp_path / "out" / "sft_result.json").read_text())["steps"] == 12
  assert any((tmp_path / "out" / "orbax").iterdir())  # the learner state, for exact resumes


def test_next_batch_skips_problems_longer_than_a_row():
  tok, task = default_tokenizer(), tasks.ArithmeticTask()
  batch, nxt = sft.next_batch(task, tok, 0, rows=4, seq_len=40)
  assert np.all(batch.positions < 40)
  rows, cols = np.nonzero(batch.segment_ids)
  packed = len(set(zip(rows.tolist(), batch.segment_ids[rows, cols].tolist())))
  assert 0 < packed < nxt  # some problems of the default task are longer than 40 tokens


def test_direct_answer_demonstrations_are_a_fixed_share_and_earn_reward():
  tok, task = default_tokenizer(), tasks.ArithmeticTask()
  flags = [sft.answers_directly(i, 0.7, seed=3) for i in range(4000)]
  assert abs(np.mean(flags) - 0.7) < 0.03
  assert flags == [sft.answers_directly(i, 0.7, seed=3) for i in range(4000)]  # deterministic
  assert not any(sft.answers_directly(i, 0.0) for i in range(100))
  p = task.problem(0)
  direct = sft.reference_rollout(p, tok, sample_id=0, direct=True)
  text = tok.decode(direct.completion_tokens)
  assert text == f"A: {p.answer}" and task.reward(p, text) == 1.0
  _, nxt = sft.next_batch(task, tok, 0, rows=2, seq_len=384, direct_answer_fraction=0.7)
  _, nxt_plain = sft.next_batch(task, tok, 0, rows=2, seq_len=384)
  assert nxt > 1.5 * nxt_plain  # bare answers are short: many more problems fit in two rows


def test_direct_answer_fraction_must_be_below_one():
  import pytest  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="direct_answer_fraction"):
    sft.SFTConfig(direct_answer_fraction=1.0)


def test_sft_device_and_output_errors_name_the_fix(tmp_path):
  tok, task = default_tokenizer(), tasks.ArithmeticTask()
  many = sft.SFTConfig(learner_devices=len(jax.devices()) + 1)
  with pytest.raises(ConfigError, match=r"--config.sft.learner_devices.*device\(s\) found"):
    sft.run_sft(task, tok, many, tmp_path / "a")
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "config.json").write_text("{}")
  with pytest.raises(FileExistsError, match="already holds a model"):
    sft.run_sft(task, tok, sft.SFTConfig(), tmp_path / "b")
  with pytest.raises(NotADirectoryError):  # before any training step
    sft.run_sft(task, tok, sft.SFTConfig(), tmp_path / "b" / "config.json" / "out")


def test_tool_episode_demonstrations_mask_the_calculators_tokens():
  """`tool_rollout` is the calculator episode token for token (turn 1 + end id, the protocol's
  rendering of the tool result with loss mask 0, turn 2 + end id), packed with the
  environment tokens outside the loss; a task without a tool is refused."""
  tok, env = default_tokenizer(), envs.CalculatorArithmeticTask()
  p = env.problem(2)
  r = sft.tool_rollout(p, env, tok, sample_id=7)
  call, result, final = env.tool_solution(p)
  expected = (tok.encode(call) + [tok.eos_id] + tok.encode(result) + tok.encode(final)
              + [tok.eos_id])
  assert r.completion_tokens.tolist() == expected and r.num_turns == 2
  env_at = np.flatnonzero(r.loss_mask == 0.0)
  n1 = len(tok.encode(call)) + 1
  assert env_at.tolist() == list(range(n1, n1 + len(tok.encode(result))))
  assert tok.decode(r.last_turn_tokens) == final and env.reward(p, final) == 1.0
  flags = [sft.uses_tool(i, 0.3, seed=0) for i in range(3000)]
  assert abs(np.mean(flags) - 0.3) < 0.03 and not any(sft.uses_tool(i, 0.0) for i in range(50))
  batch, nxt = sft.next_batch(env, tok, 0, rows=2, seq_len=384, tool_fraction=0.3)
  tool_items = [i for i in range(nxt) if sft.uses_tool(i, 0.3)]
  assert tool_items  # some packed problems are tool episodes
  n_env = sum(len(tok.encode(env.tool_solution(env.problem(i))[1])) for i in tool_items)
  comp = (batch.segment_ids > 0) & (batch.loss_mask == 0)
  assert comp.sum() >= n_env  # prompts and tool results are context, never in the loss
  with pytest.raises(ValueError, match="arithmetic_calculator"):
    sft.next_batch(tasks.ArithmeticTask(), tok, 0, rows=2, seq_len=384, tool_fraction=0.5)
  with pytest.raises(ValueError, match="tool_fraction"):
    sft.SFTConfig(tool_fraction=1.0)
