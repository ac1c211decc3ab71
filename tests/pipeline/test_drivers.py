"""End-to-end driver tests: tiny model, few steps, every driver, on 8 virtual CPU devices."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from rlax_pipe import objectives
from rlax_pipe import tasks
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner import LearnerConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import hf_io, transformer
from rlax_pipe.pipeline import config as pconfig
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.pipeline import staleness
from rlax_pipe.sampler import SamplerConfig
from rlax_pipe.tokenizer import default_tokenizer

MAX_SEQ = 48


@pytest.fixture(scope="module")
def tiny_init(tmp_path_factory):
  tok = default_tokenizer()
  cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                    head_dim=8, d_ff=64, max_seq_len=MAX_SEQ)
  path = tmp_path_factory.mktemp("tiny_init")
  hf_io.save_hf_checkpoint(path / "ckpt", jax.device_get(transformer.init_params(
      cfg, jax.random.key(0))), cfg)
  return str(path / "ckpt")


def _config(tmp_path, init, *, driver="pipeline", mode="reproducible", steps=3, max_lag=1,
            policy="block", seed=0, resume=False, run_name="run"):
  tok = default_tokenizer()
  groups, size = 2, 2
  pipe = pconfig.PipelineConfig(
      driver=driver, mode=mode, num_steps=steps, groups_per_step=groups, group_size=size,
      seq_len=MAX_SEQ, staleness=staleness.StalenessConfig(policy=policy, max_lag=max_lag,
                                                           groups_per_step=groups),
      eval_every=100, eval_problems=4, checkpoint_every=1, wait_timeout_s=120.0, seed=seed)
  sampler = SamplerConfig(num_slots=4, page_size=8, num_pages=32, max_seq_len=MAX_SEQ,
                          max_new_tokens=MAX_SEQ, min_prefill_bucket=16, eos_id=tok.eos_id,
                          sampling=SamplingConfig(temperature=1.0), seed=seed)
  learner = LearnerConfig(mesh_axes=(("fsdp", 2), ("tp", 2)), learning_rate=1e-3, seed=seed,
                          async_checkpointing=False)
  return run_lib.RunConfig(
      run_dir=str(tmp_path / run_name), init=init, num_sampler_devices=2,
      num_learner_devices=4, sampler_mesh_axes=(("tp", 2),), learner=learner,
      objective=objectives.ObjectiveConfig(name="tis_pg"), sampler=sampler, pipeline=pipe,
      eval_slots=4, resume=resume,
      task_config=tasks.ArithmeticConfig(max_terms=4))


def _train_rows(run_dir):
  rows = [json.loads(l) for l in open(f"{run_dir}/metrics.jsonl")]
  return [r for r in rows if r["kind"] == "train"]


@pytest.mark.parametrize("driver", ["sync", "async-batch", "pipeline"])
def test_driver_runs_and_respects_lag_bound(tmp_path, tiny_init, driver):
  max_lag = 1
  cfg = _config(tmp_path, tiny_init, driver=driver, max_lag=max_lag)
  summary = run_lib.run(cfg)
  rows = _train_rows(cfg.run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert [r["version"] for r in rows] == [1, 2, 3]
  for r in rows:
    # lag of every trained token = (version before the step) - token version
    assert 0 <= r["lag_max"] <= max_lag
    assert r["token_lag_max_at_train"] <= max_lag
    if driver == "sync":
      assert r["lag_max"] == 0
  assert summary["steps"] == 3
  for name in ("metrics.jsonl", "timeline.jsonl", "gantt.png", "reward_accuracy.png",
               "lag_hist.png", "idle.png", "summary.json", "config.json"):
    assert (tmp_path / "run" / name).exists(), name


def test_reproducible_mode_is_deterministic(tmp_path, tiny_init):
  a = run_lib.run(_config(tmp_path, tiny_init, run_name="a"))
  b = run_lib.run(_config(tmp_path, tiny_init, run_name="b"))
  ra, rb = _train_rows(tmp_path / "a"), _train_rows(tmp_path / "b")
  drop = ("wall_s", "eta_s")
  assert [{k: v for k, v in r.items() if k not in drop} for r in ra] == [
      {k: v for k, v in r.items() if k not in drop} for r in rb]
  assert a["time_s"] == b["time_s"]


def test_threaded_pipeline_runs(tmp_path, tiny_init):
  cfg = _config(tmp_path, tiny_init, mode="threaded", steps=2)
  summary = run_lib.run(cfg)
  rows = _train_rows(cfg.run_dir)
  assert [r["version"] for r in rows] == [1, 2]
  assert all(r["lag_max"] <= 1 for r in rows)
  assert summary["wall_s"] > 0


def test_resume_continues_from_checkpoint(tmp_path, tiny_init):
  first = _config(tmp_path, tiny_init, steps=2)
  run_lib.run(first)
  resumed = dataclasses.replace(
      first, resume=True, pipeline=dataclasses.replace(first.pipeline, num_steps=4))
  summary = run_lib.run(resumed)
  rows = _train_rows(first.run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert summary["steps"] == 4


def test_reproducible_resume_equals_uninterrupted_run(tmp_path, tiny_init):
  whole = _config(tmp_path, tiny_init, steps=4, max_lag=2, run_name="whole")
  run_lib.run(whole)
  part = _config(tmp_path, tiny_init, steps=2, max_lag=2, run_name="part")
  run_lib.run(part)  # stands for a run killed after its step-2 checkpoint
  run_lib.run(dataclasses.replace(
      part, resume=True, pipeline=dataclasses.replace(part.pipeline, num_steps=4)))
  drop = ("wall_s", "eta_s")
  strip = lambda rows: [{k: v for k, v in r.items() if k not in drop} for r in rows]
  assert strip(_train_rows(tmp_path / "part")) == strip(_train_rows(tmp_path / "whole"))
