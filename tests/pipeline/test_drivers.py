"""End-to-end driver tests: tiny model, few steps, every driver, on 8 virtual CPU devices."""

import dataclasses
import json
import os
import pathlib

import numpy as np

import pytest

from rlax_pipe.pipeline import run as run_lib

# The goldens of the level the tests compile at (tests/conftest.py): XLA's backend optimization
# level 0 by default (golden/O0/), XLA's default level with RLAX_PIPE_TEST_DEFAULT_XLA_OPT=1
# (golden/, the first recording); both recorded on the code before the redesign.
GOLDEN = pathlib.Path(__file__).parent / "golden"
if not os.environ.get("RLAX_PIPE_TEST_DEFAULT_XLA_OPT"):
  GOLDEN = GOLDEN / "O0"
# Wall-clock measurements: the only fields of a reproducible run's rows that may differ.
WALL_CLOCK_FIELDS = ("wall_s", "eta_s", "eval_wall_s")


def metrics_rows(run_dir) -> list[dict]:
  """Every row of run_dir/metrics.jsonl without its wall-clock fields."""
  rows = [json.loads(l) for l in open(f"{run_dir}/metrics.jsonl")]
  return [{k: v for k, v in r.items() if k not in WALL_CLOCK_FIELDS} for r in rows]


def write_golden(run_dir, path) -> None:
  """Stores a run's rows as the golden (only to record a new golden on purpose)."""
  pathlib.Path(path).write_text(json.dumps(metrics_rows(run_dir), indent=1, sort_keys=True))


def _assert_matches_golden(run_dir, path) -> None:
  got, want = metrics_rows(run_dir), json.loads(pathlib.Path(path).read_text())
  assert len(got) == len(want), (len(got), len(want))
  for i, (g, w) in enumerate(zip(got, want)):
    assert sorted(g) == sorted(w), (i, set(g) ^ set(w))
    # json text: exact for floats (shortest round-trip repr) and NaN equals NaN
    diff = {k: (g[k], w[k]) for k in w if json.dumps(g[k]) != json.dumps(w[k])}
    assert not diff, f"row {i} ({w['kind']}, step {w['step']}) differs from {path.name}: {diff}"


@pytest.mark.parametrize("driver,policy", [("sync", "block"), ("async-batch", "block"),
                                           ("pipeline", "block"), ("async-batch", "learner-wait"),
                                           ("pipeline", "learner-wait")])
def test_driver_runs_and_respects_lag_bound(tmp_path, driver, policy, tiny_config, train_rows):
  """With the shipped SFT warm start (non-zero rewards, so non-zero gradients); under policy
  block the metrics must equal, bit for bit, a golden recorded before the pipeline-floor
  redesign (issue #25; `GOLDEN`, written by `write_golden` on the code of 5eb5ab4 at the
  compiler level the tests run at: tests/pipeline/golden/README.md)."""
  max_lag = 1
  cfg = tiny_config(tmp_path, "builtin", driver=driver, max_lag=max_lag, policy=policy)
  summary = run_lib.run(cfg)
  if policy == "block":
    _assert_matches_golden(cfg.run_dir, GOLDEN / f"{driver}_block.json")
  rows = train_rows(cfg.run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert [r["version"] for r in rows] == [1, 2, 3]
  # learner-wait may train more than groups_per_step groups when more fall due at once
  assert all(r["samples"] >= cfg.pipeline.groups_per_step * cfg.pipeline.group_size
             for r in rows)
  for r in rows:
    # lag of every trained token = (version before the step) - token version
    assert 0 <= r["token_lag_max"] <= max_lag
    assert r["sample_lag_max"] <= max_lag
    assert r["sample_lag_mean"] >= r["token_lag_mean"]  # a sample's oldest token lags most
    if driver == "sync":
      assert r["token_lag_max"] == 0 and r["sample_lag_max"] == 0
  assert summary["steps"] == 3
  for name in ("metrics.jsonl", "timeline.jsonl", "gantt.png", "reward_accuracy.png",
               "lag_hist.png", "staleness.png", "idle.png", "summary.json", "config.json"):
    assert (tmp_path / "run" / name).exists(), name


def test_reproducible_mode_is_deterministic(tmp_path, tiny_init, tiny_config, train_rows):
  a = run_lib.run(tiny_config(tmp_path, tiny_init, run_name="a"))
  b = run_lib.run(tiny_config(tmp_path, tiny_init, run_name="b"))
  ra, rb = train_rows(tmp_path / "a"), train_rows(tmp_path / "b")
  drop = ("wall_s", "eta_s")
  assert [{k: v for k, v in r.items() if k not in drop} for r in ra] == [
      {k: v for k, v in r.items() if k not in drop} for r in rb]
  assert a["time_s"] == b["time_s"]


@pytest.mark.parametrize("policy", ["block", "learner-wait"])
def test_threaded_pipeline_runs(tmp_path, tiny_init, tiny_config, train_rows, policy):
  cfg = tiny_config(tmp_path, tiny_init, mode="threaded", steps=2, policy=policy)
  summary = run_lib.run(cfg)
  rows = train_rows(cfg.run_dir)
  assert [r["version"] for r in rows] == [1, 2]
  assert all(r["token_lag_max"] <= 1 for r in rows)
  assert summary["wall_s"] > 0
  # the threaded run timed its operations and stored the fitted cost model with the run
  fit = json.loads((tmp_path / "run" / "cost_fit.json").read_text())
  assert fit["cost_model"]["source"].startswith("measured")
  assert fit["ops"]["engine_step"]["n"] > 0
  # each of the 2 train steps is fitted, or left out because XLA compiled meanwhile (on any
  # thread: timing-dependent, e.g. 1 + 1 at XLA's default level); absent if both were left out
  train = fit["ops"].get("train_step")
  assert train is None or train["n"] + train["excluded"] == 2, train


def test_resume_continues_from_checkpoint(tmp_path, tiny_init, tiny_config, train_rows):
  first = tiny_config(tmp_path, tiny_init, steps=2)
  run_lib.run(first)
  resumed = dataclasses.replace(
      first, resume=True, pipeline=dataclasses.replace(first.pipeline, num_steps=4),
      change_on_resume=("pipeline.num_steps",))
  summary = run_lib.run(resumed)
  rows = train_rows(first.run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert summary["steps"] == 4


def test_an_error_checkpoints_the_last_step_before_re_raising(tmp_path, tiny_init, tiny_config,
                                                             train_rows):
  """`run_job`'s error path saves the state of the last finished step (no periodic checkpoint
  here), so a resume continues after it."""
  class FailAtStep2:
    def on_step(self, job, result, time_s):
      if job.learner.step == 2:
        raise RuntimeError("hook failed at step 2")

    def on_end(self, job, time_s):
      pass

  cfg = tiny_config(tmp_path, tiny_init, steps=3)
  cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, checkpoint_every=100))
  with pytest.raises(RuntimeError, match="hook failed at step 2"):
    run_lib.run(cfg, hooks=[FailAtStep2()])
  summary = run_lib.run(dataclasses.replace(cfg, resume=True))
  assert [r["step"] for r in train_rows(cfg.run_dir)] == [1, 2, 3]
  assert summary["steps"] == 3


@pytest.mark.parametrize("driver,filter_groups", [("pipeline", "off"),
                                                  ("sync", "zero_variance")])
def test_reproducible_resume_equals_uninterrupted_run(tmp_path, tiny_init, tiny_config,
                                                     train_rows, driver, filter_groups):
  """Also with dynamic sampling: the queue's drop counters and the worker's re-opened count
  are checkpointed, so the resumed run drops and replaces the same groups."""
  def config(steps, name):
    cfg = tiny_config(tmp_path, tiny_init, driver=driver, steps=steps, max_lag=2,
                      run_name=name)
    return dataclasses.replace(cfg, pipeline=dataclasses.replace(
        cfg.pipeline, filter_groups=filter_groups,
        **({} if filter_groups == "off" else {"filter_max_dropped_per_step": 2})))
  whole = config(4, "whole")
  run_lib.run(whole)
  part = config(2, "part")
  run_lib.run(part)  # stands for a run killed after its step-2 checkpoint
  run_lib.run(dataclasses.replace(
      part, resume=True, pipeline=dataclasses.replace(part.pipeline, num_steps=4),
      change_on_resume=("pipeline.num_steps",)))
  drop = ("wall_s", "eta_s")
  strip = lambda rows: [{k: v for k, v in r.items() if k not in drop} for r in rows]
  assert strip(train_rows(tmp_path / "part")) == strip(train_rows(tmp_path / "whole"))
  if filter_groups != "off":
    assert train_rows(tmp_path / "whole")[-1]["filtered_groups"] > 0, "nothing filtered"


def test_threaded_resume_continues_the_sampling_random_stream(tmp_path, tiny_init, tiny_config):
  """Issue #14 item 11: after a threaded resume the sampler's key is the checkpointed one, not
  key(seed) again (which would replay the first run's random stream)."""
  from rlax_pipe.pipeline import job as job_lib  # pylint: disable=import-outside-toplevel
  from rlax_pipe.learner.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  first = tiny_config(tmp_path, tiny_init, mode="threaded", steps=2)
  run_lib.run(first)
  extra = Checkpointer(f"{first.run_dir}/checkpoints").restore_extra()
  saved = [np.asarray(k, np.uint32) for k in extra["sampler_rng"]]
  job = job_lib.build_job(dataclasses.replace(first, resume=True))
  try:
    now = job.engine.rng_state()
    running = job.engine.weights.running
    fresh = job_lib.SamplerEngine(job.engine.model, first.sampler, running.params,
                                  version=running.version, mesh=job.engine.mesh).rng_state()
    assert len(now) == len(saved) >= 1
    for got, want, initial in zip(now, saved, fresh):
      np.testing.assert_array_equal(got, want)
      assert not np.array_equal(got, initial)
  finally:
    job.learner.close()
    job.worker.close()
