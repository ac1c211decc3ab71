"""Seeds and confidence intervals for the learning ablations and the staleness sweep (issue 16).

A *cell* is one RunConfig (an ablation's label or a sweep's (max_lag, objective)); it is run once
per seed (`with_seed`: the sampling and learner seeds; the prompt stream is the task config's), each seed's run
summarised into a row (`sweep.summarize_cell`), and the rows reduced to one row per cell whose
every metric is the mean over seeds with a 95% Student-t interval (`aggregate`). A claim is
"shown" only when the two intervals do not overlap (`separated`).

Finished runs are reused: a run's directory is named by a hash of its configuration, so a cell
that two ablations share (or a command run again after an interruption) runs once; a directory
without summary.json (an interrupted run) is removed and run again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import shutil
from typing import Callable, Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
# Row fields that are labels, not metrics (copied from the first seed's row).
_LABELS = ("ablation", "label", "max_lag", "objective", "throughput_clock")


def with_seed(cfg, seed: int):
  """`cfg` with the run's seeds (sampler: sampling; learner: init and PRNG) set to `seed`.

  The prompt stream is the task's (its own config seed), the same for every seed of a claim.

  Raises:
    ValueError: seed < 0.
  """
  if seed < 0:
    raise ValueError(f"seed={seed} must be >= 0.")
  return dataclasses.replace(
      cfg, sampler=dataclasses.replace(cfg.sampler, seed=seed),
      learner=dataclasses.replace(cfg.learner, seed=seed))


def config_key(cfg) -> str:
  """12 hex digits of SHA-1 of the configuration without its run_dir / resume fields."""
  from rlax_pipe.run_dir import to_jsonable  # pylint: disable=import-outside-toplevel
  body = to_jsonable(dataclasses.replace(cfg, run_dir="", resume=False))
  return hashlib.sha1(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_cell(cfg, cells_dir: str, summarize: Callable[[str], dict]) -> dict:
  """Runs `cfg` in `<cells_dir>/<config_key>` unless a finished run is there; returns its row.

  Args:
    cfg: the RunConfig of one cell and seed (its run_dir is replaced).
    cells_dir: parent of the run directories.
    summarize: run_dir -> row (e.g. `sweep.summarize_cell` with the cell's labels bound).
  """
  from rlax_pipe.pipeline import run as run_lib  # pylint: disable=import-outside-toplevel
  run_dir = pathlib.Path(cells_dir) / config_key(cfg)
  if not (run_dir / "summary.json").exists():
    if run_dir.exists():
      shutil.rmtree(run_dir)
    run_lib.run(dataclasses.replace(cfg, run_dir=str(run_dir), resume=False))
  return summarize(str(run_dir))


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
  """(mean, half-width) of the Student-t confidence interval of the mean of `values`.

  half-width = t_{(1+confidence)/2, n-1} * s / sqrt(n), s the sample standard deviation
  (ddof=1); one value gives half-width nan (no interval from one seed). NaN / None values are
  dropped first.

  Raises:
    ValueError: no finite value.
  """
  x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
  if x.size == 0:
    raise ValueError(f"t_interval of {list(values)!r}: no finite value.")
  if x.size == 1:
    return float(x[0]), float("nan")
  q = stats.t.ppf(0.5 + confidence / 2, df=x.size - 1)
  return float(x.mean()), float(q * x.std(ddof=1) / math.sqrt(x.size))


def binomial_half_width(accuracy: float, n: int, confidence: float = CONFIDENCE) -> float:
  """Normal-approximation half-width z * sqrt(p (1 - p) / n) of an accuracy on n problems: the
  evaluation noise of one run's held-out accuracy (Wald interval).

  Raises:
    ValueError: n < 1 or accuracy outside [0, 1].
  """
  if n < 1 or not 0 <= accuracy <= 1:
    raise ValueError(f"binomial_half_width(accuracy={accuracy}, n={n}): need n >= 1 and 0 <= "
                     "accuracy <= 1.")
  return float(stats.norm.ppf(0.5 + confidence / 2) * math.sqrt(accuracy * (1 - accuracy) / n))


def aggregate(rows: Sequence[dict]) -> dict:
  """One row from the per-seed rows of a cell: labels from the first row; for every numeric
  metric m, `m` = mean over seeds and `m_ci` = the 95% t half-width (nan with one seed); `seeds`
  = number of rows, `per_seed` = the rows.

  Raises:
    ValueError: no rows.
  """
  if not rows:
    raise ValueError("aggregate: no rows (a cell needs at least one seed).")
  out = {k: rows[0][k] for k in _LABELS if k in rows[0]}
  for key in rows[0]:
    if key in _LABELS or key in ("run_dir", "seed"):
      continue
    values = [r.get(key) for r in rows]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values if v is not None
           ) and any(v is not None for v in values):
      finite = [v for v in values if v is not None and math.isfinite(v)]
      if finite:
        out[key], out[key + "_ci"] = t_interval(finite)
      else:
        out[key], out[key + "_ci"] = float("nan"), float("nan")
  out["seeds"] = len(rows)
  out["per_seed"] = list(rows)
  return out


def interval(row: dict, metric: str) -> tuple[float, float]:
  """(low, high) of a reduced row's metric (mean -+ half-width)."""
  m, h = row[metric], row.get(metric + "_ci", float("nan"))
  return m - h, m + h


def separated(a: dict, b: dict, metric: str) -> bool:
  """True when the 95% intervals of `metric` in reduced rows a and b do not overlap (both need
  >= 2 seeds: an interval of one seed is nan and never separates)."""
  (lo_a, hi_a), (lo_b, hi_b) = interval(a, metric), interval(b, metric)
  if any(math.isnan(v) for v in (lo_a, hi_a, lo_b, hi_b)):
    return False
  return hi_a < lo_b or hi_b < lo_a


def verdict(better: dict, worse: dict, metric: str = "heldout_end") -> tuple[str, str]:
  """("shown" | "contradicted" | "not shown", reason) for the claim "`better` beats `worse` on
  `metric`" (higher is better): shown when the intervals separate in the claimed direction,
  contradicted when they separate the other way, else not shown."""
  diff = better[metric] - worse[metric]
  ia, ib = interval(better, metric), interval(worse, metric)
  text = (f"{better.get('label', '?')} {better[metric]:.3f} [{ia[0]:.3f}, {ia[1]:.3f}] vs "
          f"{worse.get('label', '?')} {worse[metric]:.3f} [{ib[0]:.3f}, {ib[1]:.3f}] "
          f"({better['seeds']} / {worse['seeds']} seeds)")
  paired = paired_difference(better, worse, metric)
  if paired is not None:
    text += (f"; paired difference over {paired[2]} common seeds {paired[0]:+.3f} +- "
             f"{paired[1]:.3f}")
  if separated(better, worse, metric):
    return ("shown" if diff > 0 else "contradicted"), text + ": intervals separate"
  return "not shown", text + ": intervals overlap"


def paired_verdict(better: dict, worse: dict, metric: str = "heldout_end") -> str:
  """The verdict of the paired design: "shown" when the 95% t-interval of the same-seed
  difference better - worse lies above 0, "contradicted" below 0, else "not shown" (also with
  fewer than 2 common seeds). Reported beside `verdict` (the issue's unpaired rule)."""
  paired = paired_difference(better, worse, metric)
  if paired is None or math.isnan(paired[1]):
    return "not shown"
  mean, hw, _ = paired
  return "shown" if mean - hw > 0 else "contradicted" if mean + hw < 0 else "not shown"


def paired_difference(a: dict, b: dict, metric: str) -> tuple[float, float, int] | None:
  """(mean, 95% t half-width, n) of a - b over the seeds both reduced rows ran (same seed = same
  prompt order and sampling seed, so the difference removes the shared part of the seed noise);
  None with fewer than 2 common seeds or no value. Reported beside the verdict, which uses the
  unpaired intervals (the issue's rule)."""
  va = {r.get("seed"): r.get(metric) for r in a.get("per_seed", [])}
  vb = {r.get("seed"): r.get(metric) for r in b.get("per_seed", [])}
  common = [s for s in va if s in vb and va[s] is not None and vb[s] is not None]
  if len(common) < 2:
    return None
  mean, hw = t_interval([va[s] - vb[s] for s in common])
  return mean, hw, len(common)


def run_seeds(cells: Sequence[tuple[str, object, Callable[[str], dict]]], seeds: Sequence[int],
              cells_dir: str) -> list[dict]:
  """Runs each (label, RunConfig, summarize) cell once per seed (seeds outer, so a partial run
  covers every cell); returns one reduced row per cell (`aggregate`), in the cells' order."""
  per_cell: dict[str, list[dict]] = {label: [] for label, _, _ in cells}
  for seed in seeds:
    for label, cfg, summarize in cells:
      row = run_cell(with_seed(cfg, seed), cells_dir, summarize)
      row.update(label=label, seed=seed)
      per_cell[label].append(row)
  return [aggregate(per_cell[label]) for label, _, _ in cells]
