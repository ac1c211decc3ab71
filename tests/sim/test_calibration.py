"""Calibration: costs fitted to a threaded run's timed operations, lengths from metrics rows, the
measured side of the comparison, and the simulated run that mirrors a config."""

import json

import numpy as np
import pytest

from rlax_pipe import costs as costs_lib
from rlax_pipe import timeline as timeline_lib
from rlax_pipe.sim import calibration
from rlax_pipe.sim import distributions as dist

STEP_S, SLOT_S, TRAIN_S, TOKEN_S, PUSH_S = 0.012, 3e-4, 0.08, 2e-6, 0.007


def _synthetic(seed=0, logged_lengths=False):
  """A sampler decoding with 1..16 active slots, a learner training 20 steps, pushes."""
  rng = np.random.default_rng(seed)
  tl = timeline_lib.Timeline(clock=timeline_lib.VirtualClock())
  t = 0.0
  for _ in range(400):
    active = int(rng.integers(1, 17))
    d = STEP_S + SLOT_S * active
    tl.record("sampler", "decode", t, t + d, slots_active=active, slots_total=16)
    t += d
  rows, t = [], 0.0
  for step in range(1, 21):
    lengths = rng.integers(5, 60, size=8)
    d = TRAIN_S + TOKEN_S * 1024
    tl.record("learner", "wait_batch", t, t + 0.01)
    tl.record("learner", "train_step", t + 0.01, t + 0.01 + d)
    tl.record("channel", "push", t + 0.01 + d, t + 0.01 + d + PUSH_S)
    t += 0.01 + d + PUSH_S
    row = {"kind": "train", "step": step, "time_s": t, "samples": 8,
           "completion_tokens": int(lengths.sum()), "lag_hist": [6, 2] if step % 2 else [8],
           "sample_lag_mean": 0.25 if step % 2 else 0.0, "sample_lag_max": step % 2}
    if logged_lengths:
      row["completion_lengths"] = lengths.tolist()
      row["prompt_lengths"] = [7] * 4 + [9] * 4
    rows.append(row)
  rows.append({"kind": "eval", "step": 20, "heldout_accuracy": 0.5})
  return tl.spans(), rows


def _records(run_dir, noise=0.0, seed=0):
  rng = np.random.default_rng(seed)
  rec = costs_lib.CostRecorder()
  for _ in range(300):
    slots = int(rng.integers(1, 17))
    rec.record("engine_step", (STEP_S + SLOT_S * slots) * (1 + noise * rng.standard_normal()),
               dispatches=1, decode_steps=1, slot_steps=slots)
  for rows in (16, 32, 64, 16, 32):
    rec.record("train_step", TRAIN_S + TOKEN_S * rows * 64, tokens=rows * 64, micro_batches=1)
    rec.record("push", PUSH_S, bytes=10**6)
  rec.to_jsonl(run_dir / calibration.COST_RECORDS)


def test_calibrate_run_fits_the_timed_operations(tmp_path):
  _records(tmp_path)
  fit = calibration.calibrate_run(tmp_path)
  m = fit.cost_model
  assert m.slot_step_s == pytest.approx(SLOT_S, rel=1e-6)
  assert m.engine_step_s == pytest.approx(STEP_S, rel=1e-6)  # aliased dispatch / step columns
  assert m.train_token_s == pytest.approx(TOKEN_S, rel=1e-6)
  assert m.push(10**6) == pytest.approx(PUSH_S, rel=1e-6)
  assert m.source.startswith("measured: threaded runs")


def test_calibrate_run_with_noise_has_intervals_covering_the_truth(tmp_path):
  _records(tmp_path, noise=0.05, seed=1)
  c = calibration.calibrate_run(tmp_path).coefficients["slot_step_s"]
  assert c.ci95[0] < SLOT_S < c.ci95[1] and c.status == "fitted"


def test_calibrate_refuses_a_reproducible_run(tmp_path):
  with pytest.raises(FileNotFoundError, match="calibrate from a threaded run"):
    calibration.calibrate_run(tmp_path)


def test_lengths_from_logged_rows_keep_groups():
  _, rows = _synthetic(logged_lengths=True)
  d, source = calibration.lengths_from_rows(rows, group_size=4)
  assert source == "completion_lengths" and isinstance(d, dist.GroupedEmpirical)
  assert len(d.groups) == 40 and len(d.groups[0]) == 4
  p, source = calibration.lengths_from_rows(rows, group_size=4, key="prompt_lengths")
  assert source == "prompt_lengths" and p.mean() == 8.0 and len(p.groups) == 40


def test_lengths_from_moments():
  # Per-step means 10 and 30 with 8 samples: E[L] = 20, Var[L] = 8 * var([10, 30]) = 8 * 200
  # (ddof 1), sigma^2 = ln(1 + 1600 / 400) = ln 5.
  rows = [{"kind": "train", "step": 1, "samples": 8, "completion_tokens": 80},
          {"kind": "train", "step": 2, "samples": 8, "completion_tokens": 240}]
  d, source = calibration.lengths_from_rows(rows, max_len=100)
  assert source == "moments"
  assert d.mean_tokens == pytest.approx(20.0)
  assert d.sigma == pytest.approx(np.sqrt(np.log(5.0)))
  assert d.max_len == 100


def test_measured_window():
  spans, rows = _synthetic()
  m = calibration.measured(rows, spans, warmup_steps=2)
  tr = calibration.train_rows(rows)
  assert m["tokens_per_s"] == pytest.approx(
      sum(r["completion_tokens"] for r in tr[2:]) / (tr[-1]["time_s"] - tr[1]["time_s"]))
  # lag_hist rows alternate [6, 2] and [8]: 9 odd steps in 3..20 -> 18 tokens of lag 1.
  assert m["token_lag_mean"] == pytest.approx(18 / (18 * 8))
  assert m["token_lag_max"] == 1
  assert m["sample_lag_mean"] == pytest.approx(9 * 0.25 / 18)  # per sample, weighted by samples
  assert m["sample_lag_max"] == 1


def test_sim_config_for_run():
  config = {"sampler": {"num_slots": 16, "max_new_tokens": 64, "max_seq_len": 64,
                        "prefill_rows": 2},
            "pipeline": {"driver": "pipeline", "num_steps": 20, "group_size": 4, "seq_len": 96,
                         "staleness": {"policy": "block", "max_lag": 2, "groups_per_step": 2,
                                       "queue_capacity_groups": None}}}
  cfg = calibration.sim_config_for_run(config, costs_lib.CostModel(), dist.Constant(5),
                                       dist.Constant(3), num_steps=10, warmup_steps=2,
                                       push_bytes=123)
  assert (cfg.driver, cfg.staleness.max_lag, cfg.group_size, cfg.concurrency, cfg.seq_len,
          cfg.prefill_rows, cfg.push_bytes) == ("pipeline", 2, 4, 16, 96, 2, 123)
  assert calibration.completion_budget(config) == 63
  assert (cfg.decode_steps_per_dispatch, cfg.share_prompt_pages, cfg.num_engines) == (1, False, 1)
  json.dumps(cfg.staleness.__dict__)
  # A run of main's engine: K-step dispatches, shared prompts, 2 data replicas, learner split.
  config["sampler"].update(decode_steps_per_dispatch=8, share_prompt_pages=True)
  config["sampler_mesh_axes"] = [["data", 2], ["tp", 2]]
  config["learner"] = {"micro_batch_rows": 4, "num_minibatches": 2}
  cfg = calibration.sim_config_for_run(config, costs_lib.CostModel(), dist.Constant(5),
                                       dist.Constant(3))
  assert (cfg.decode_steps_per_dispatch, cfg.share_prompt_pages, cfg.num_engines,
          cfg.concurrency, cfg.micro_batch_rows, cfg.num_minibatches) == (8, True, 2, 32, 4, 2)
