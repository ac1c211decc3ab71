"""Seeds, intervals and verdicts (experiments/lib/seeds.py) against independent references."""

import dataclasses
import json
import math

import numpy as np
import pytest

from lib import seeds
from rlax_pipe.run_dir import to_jsonable


def test_t_interval_matches_the_t_table():
  # t_{0.975, 2} = 4.3027 and t_{0.975, 4} = 2.7764 (any t table); s by hand.
  mean, hw = seeds.t_interval([0.40, 0.46, 0.43])
  s = math.sqrt(((0.40 - 0.43) ** 2 + 0.03 ** 2 + 0) / 2)
  assert mean == pytest.approx(0.43)
  assert hw == pytest.approx(4.3027 * s / math.sqrt(3), rel=1e-4)
  _, hw5 = seeds.t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
  assert hw5 == pytest.approx(2.7764 * math.sqrt(2.5) / math.sqrt(5), rel=1e-4)


def test_t_interval_coverage_is_95_percent():
  """Over many normal samples of 3, the interval holds the true mean ~95% of the time."""
  rng = np.random.default_rng(0)
  hits = 0
  for _ in range(4000):
    m, h = seeds.t_interval(rng.normal(1.0, 2.0, size=3))
    hits += abs(m - 1.0) <= h
  assert hits / 4000 == pytest.approx(0.95, abs=0.015)


def test_t_interval_edge_cases():
  assert math.isnan(seeds.t_interval([0.5])[1])
  assert seeds.t_interval([0.5, None, float("nan"), 0.5]) == (0.5, 0.0)
  with pytest.raises(ValueError, match="no finite value"):
    seeds.t_interval([None])


def test_binomial_half_width_of_the_stress_eval_is_within_two_points():
  # z_{0.975} = 1.95996; 2400 problems give 2.0004 points at accuracy 0.5, 2500 give 1.96.
  assert seeds.binomial_half_width(0.5, 2400) == pytest.approx(1.95996 * 0.5 / math.sqrt(2400),
                                                               rel=1e-5)
  assert seeds.binomial_half_width(0.5, 2400) > 0.02
  assert max(seeds.binomial_half_width(p, 2500) for p in np.linspace(0, 1, 101)) <= 0.02
  with pytest.raises(ValueError, match="n >= 1"):
    seeds.binomial_half_width(0.5, 0)


def test_aggregate_means_intervals_and_labels():
  rows = [{"label": "x", "max_lag": "4", "run_dir": "/a", "seed": s, "acc": a, "lag_max": 3,
           "maybe": None, "name": "text"} for s, a in enumerate((0.2, 0.3, 0.4))]
  out = seeds.aggregate(rows)
  assert out["label"] == "x" and out["max_lag"] == "4" and out["seeds"] == 3
  assert out["acc"] == pytest.approx(0.3) and out["acc_ci"] == pytest.approx(
      4.3027 * 0.1 / math.sqrt(3), rel=1e-4)
  assert out["lag_max"] == 3 and out["lag_max_ci"] == 0
  assert "seed" not in out and "run_dir" not in out and "name" not in out and "maybe" not in out
  assert len(out["per_seed"]) == 3
  with pytest.raises(ValueError, match="at least one seed"):
    seeds.aggregate([])


def _row(label, mean, hw, n=3):
  return {"label": label, "acc": mean, "acc_ci": hw, "seeds": n}


def test_verdicts():
  hi, lo = _row("tis", 0.45, 0.02), _row("none", 0.30, 0.05)
  assert seeds.separated(hi, lo, "acc")
  assert seeds.verdict(hi, lo, "acc")[0] == "shown"
  assert seeds.verdict(lo, hi, "acc")[0] == "contradicted"
  near = _row("none", 0.42, 0.02)
  v, reason = seeds.verdict(hi, near, "acc")
  assert v == "not shown" and "overlap" in reason
  one = _row("one", 0.1, float("nan"), n=1)  # one seed: no interval, never separates
  assert seeds.verdict(hi, one, "acc")[0] == "not shown"


def test_with_seed_and_config_key(tiny_config, tmp_path):
  cfg = tiny_config(tmp_path, "builtin")
  s3 = seeds.with_seed(cfg, 3)
  assert (s3.sampler.seed, s3.learner.seed) == (3, 3)
  assert seeds.config_key(cfg) == seeds.config_key(dataclasses.replace(cfg, run_dir="/else"))
  assert seeds.config_key(cfg) != seeds.config_key(s3)
  with pytest.raises(ValueError, match="seed=-1"):
    seeds.with_seed(cfg, -1)


def test_run_cell_reuses_finished_runs_and_reruns_broken_ones(tiny_config, tmp_path,
                                                               monkeypatch):
  from rlax_pipe.pipeline import run as run_lib  # pylint: disable=import-outside-toplevel
  calls = []

  def fake_run(cfg):
    calls.append(cfg.run_dir)
    import pathlib  # pylint: disable=import-outside-toplevel
    pathlib.Path(cfg.run_dir).mkdir(parents=True)
    (pathlib.Path(cfg.run_dir) / "summary.json").write_text("{}")

  monkeypatch.setattr(run_lib, "run", fake_run)
  cfg = tiny_config(tmp_path, "builtin")
  cells = str(tmp_path / "cells")
  broken = tmp_path / "cells" / seeds.config_key(seeds.with_seed(cfg, 1))
  broken.mkdir(parents=True)  # an interrupted run: no summary.json
  (broken / "metrics.jsonl").write_text("")
  rows = seeds.run_seeds([("a", cfg, lambda d: {"d": d, "v": 1.0})], (0, 1), cells)
  assert len(calls) == 2 and rows[0]["seeds"] == 2 and rows[0]["v_ci"] == 0
  seeds.run_seeds([("a", cfg, lambda d: {"d": d, "v": 1.0})], (0, 1), cells)
  assert len(calls) == 2  # both reused


def test_paired_difference_removes_the_shared_seed_noise():
  def row(label, values):
    per_seed = [{"seed": s, "acc": v} for s, v in enumerate(values)]
    out = seeds.aggregate(per_seed)
    out.update(label=label, per_seed=per_seed)
    return out
  # Seed noise much larger than the effect, but the same in both cells: the unpaired intervals
  # overlap, the paired difference is exactly +0.05 (half-width 0).
  a, b = row("a", [0.30, 0.50, 0.70]), row("b", [0.25, 0.45, 0.65])
  mean, hw, n = seeds.paired_difference(a, b, "acc")
  assert (mean, n) == (pytest.approx(0.05), 3) and hw == pytest.approx(0, abs=1e-12)
  v, reason = seeds.verdict(a, b, "acc")
  assert v == "not shown" and "paired difference over 3 common seeds +0.050" in reason
  assert seeds.paired_verdict(a, b, "acc") == "shown"
  assert seeds.paired_verdict(b, a, "acc") == "contradicted"
  assert seeds.paired_verdict(a, row("d", [0.2, 0.6, 0.6]), "acc") == "not shown"
  assert seeds.paired_difference(a, row("c", [0.1]), "acc") is None
  assert seeds.paired_verdict(a, row("c", [0.1]), "acc") == "not shown"


def test_strict_to_jsonable_writes_strict_json():
  """One seed gives nan intervals; the written JSON has null there (strict parsers reject NaN)."""
  row = seeds.aggregate([{"label": "x", "heldout_end": 0.4, "seed": 0}])
  assert math.isnan(row["heldout_end_ci"])
  out = to_jsonable({"rows": [row], "t": (1.0, float("inf")), "n": np.float32("nan")},
                    strict=True)
  text = json.dumps(out, allow_nan=False)
  back = json.loads(text)
  assert back["rows"][0]["heldout_end_ci"] is None and back["rows"][0]["heldout_end"] == 0.4
  assert back["t"] == [1.0, None] and back["n"] is None
  assert math.isnan(to_jsonable(float("nan")))  # not strict: unchanged (run records keep NaN)


def test_aggregate_keeps_the_throughput_clock_label():
  rows = [{"label": "x", "throughput_clock": "measured cost model fit.json", "v": 1.0, "seed": 0},
          {"label": "x", "throughput_clock": "measured cost model fit.json", "v": 3.0, "seed": 1}]
  out = seeds.aggregate(rows)
  assert out["throughput_clock"] == "measured cost model fit.json" and out["v"] == 2.0
