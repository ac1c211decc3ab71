"""Calibration recovers known costs from a synthetic timeline + metrics, and reads run dirs."""

import json

import numpy as np
import pytest

from rlax_pipe import timeline as timeline_lib
from rlax_pipe.sim import calibration
from rlax_pipe.sim import distributions as dist

DECODE_BASE, DECODE_SLOT = 0.012, 3e-4
TRAIN_BASE, TRAIN_TOKEN = 0.08, 2e-4
PUSH, PREFILL_TOKEN, PROMPT = 0.007, 5e-5, 12


def _synthetic(noise=0.0, seed=0, logged_lengths=False):
  """A sampler decoding with 1..16 active slots, a learner training 20 steps, pushes."""
  rng = np.random.default_rng(seed)
  tl = timeline_lib.Timeline(clock=timeline_lib.VirtualClock())
  t = 0.0
  for _ in range(400):
    active = int(rng.integers(1, 17))
    if rng.random() < 0.1:  # an admission of 4 samples: prefill of 4 prompts
      d = PREFILL_TOKEN * PROMPT * 4
      tl.record("sampler", "prefill", t, t + d)
      t += d
    d = (DECODE_BASE + DECODE_SLOT * active) * (1 + noise * rng.standard_normal())
    tl.record("sampler", "decode", t, t + d, slots_active=active, slots_total=16)
    t += d
  rows, t = [], 0.0
  for step in range(1, 21):
    lengths = rng.integers(5, 60, size=8)
    tokens = int(lengths.sum())
    d = (TRAIN_BASE + TRAIN_TOKEN * tokens) * (1 + noise * rng.standard_normal())
    tl.record("learner", "wait_batch", t, t + 0.01)
    tl.record("learner", "train_step", t + 0.01, t + 0.01 + d)
    tl.record("channel", "push", t + 0.01 + d, t + 0.01 + d + PUSH)
    t += 0.01 + d + PUSH
    row = {"kind": "train", "step": step, "time_s": t, "samples": 8,
           "completion_tokens": tokens, "lag_hist": [6, 2] if step % 2 else [8]}
    if logged_lengths:
      row["completion_lengths"] = lengths.tolist()
    rows.append(row)
  rows.append({"kind": "eval", "step": 20, "heldout_accuracy": 0.5})
  return tl.spans(), rows


def test_recovers_known_costs_exactly_without_noise():
  spans, rows = _synthetic()
  cal = calibration.calibrate(spans, rows)
  assert cal.decode.intercept == pytest.approx(DECODE_BASE)
  assert cal.decode.slope == pytest.approx(DECODE_SLOT)
  assert cal.train.intercept == pytest.approx(TRAIN_BASE)
  assert cal.train.slope == pytest.approx(TRAIN_TOKEN)
  assert cal.push_s == pytest.approx(PUSH)
  assert cal.decode.rel_rmse < 1e-9 and cal.train.rel_rmse < 1e-9
  costs = cal.costs()
  assert costs.decode.latency(10) == pytest.approx(DECODE_BASE + 10 * DECODE_SLOT)
  assert costs.train(1000) == pytest.approx(TRAIN_BASE + 1000 * TRAIN_TOKEN)


def test_recovers_costs_with_noise():
  spans, rows = _synthetic(noise=0.05, seed=1)
  cal = calibration.calibrate(spans, rows)
  assert cal.decode.intercept == pytest.approx(DECODE_BASE, rel=0.1)
  assert cal.decode.slope == pytest.approx(DECODE_SLOT, rel=0.1)
  assert cal.train.slope == pytest.approx(TRAIN_TOKEN, rel=0.25)
  assert 0.01 < cal.decode.rel_rmse < 0.1


def test_prefill_per_sample():
  # 10 decode slot-steps of 5-token samples = 2 samples; 0.004 s of prefill -> 0.002 per sample.
  spans = [timeline_lib.Span("sampler", "prefill", 0.0, 0.004)] + [
      timeline_lib.Span("sampler", "decode", 0.004 + i, 1.004 + i, 2, 4) for i in range(5)]
  assert calibration.prefill_per_sample(spans, 5.0) == pytest.approx(0.002)


def test_lengths_from_logged_rows_keep_groups():
  spans, rows = _synthetic(logged_lengths=True)
  cal = calibration.calibrate(spans, rows, group_size=4)
  assert cal.length_source == "completion_lengths"
  assert isinstance(cal.lengths, dist.GroupedEmpirical)
  assert len(cal.lengths.groups) == 40 and len(cal.lengths.groups[0]) == 4
  assert cal.lengths.mean() == pytest.approx(cal.mean_completion_tokens)


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


def test_fit_linear_constant_x():
  fit = calibration.fit_linear([4, 4, 4], [1.0, 2.0, 3.0])
  assert (fit.intercept, fit.slope) == (pytest.approx(2.0), 0.0)


def test_measured_window():
  spans, rows = _synthetic()
  m = calibration.measured(rows, spans, warmup_steps=2)
  tr = calibration.train_rows(rows)
  assert m["tokens_per_s"] == pytest.approx(
      sum(r["completion_tokens"] for r in tr[2:]) / (tr[-1]["time_s"] - tr[1]["time_s"]))
  # lag_hist rows alternate [6, 2] and [8]: 9 odd steps in 3..20 -> 18 tokens of lag 1.
  assert m["lag_mean"] == pytest.approx(18 / (18 * 8))
  assert m["lag_max"] == 1


def _write_run(run_dir, spans, rows):
  """Writes a run dir's timeline.jsonl and metrics.jsonl (the files calibration reads)."""
  tl = timeline_lib.Timeline()
  for s in spans:
    tl.record(s.component, s.kind, s.start, s.end, s.slots_active, s.slots_total)
  tl.to_jsonl(str(run_dir / "timeline.jsonl"))
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_calibrate_run_dir_and_sim_config(tmp_path):
  _write_run(tmp_path, *_synthetic(logged_lengths=True))
  config = {"sampler": {"num_slots": 16, "max_new_tokens": 64, "max_seq_len": 64},
            "pipeline": {"driver": "pipeline", "num_steps": 20, "group_size": 4,
                         "staleness": {"policy": "block", "max_lag": 2, "groups_per_step": 2,
                                       "queue_capacity_groups": None}}}
  (tmp_path / "config.json").write_text(json.dumps(config))
  cal = calibration.calibrate_run(tmp_path)
  assert cal.decode.slope == pytest.approx(DECODE_SLOT)
  assert cal.length_source == "completion_lengths"
  cfg = calibration.sim_config_for_run(config, cal, num_steps=10, warmup_steps=2)
  assert (cfg.driver, cfg.staleness.max_lag, cfg.group_size, cfg.concurrency) == (
      "pipeline", 2, 4, 16)
  assert calibration.completion_budget(config) == 63
