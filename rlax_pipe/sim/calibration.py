"""Fits the simulator's inputs from a run directory (timeline.jsonl + metrics.jsonl + config.json).

What is fitted, from what (all least squares are ordinary, `numpy.linalg.lstsq`):
  * decode latency of the sampler vs active slots: duration = base + per_slot * slots_active over
    the "decode" spans (`fit_decode`);
  * prefill seconds per started sample: total "prefill" span time / samples started, where
    samples started = total decode slot-steps (every active slot emits one token per decode
    step) / mean completion length (`prefill_per_sample`);
  * learner step time vs trained completion tokens: the n-th "train_step" span against the n-th
    train row's `completion_tokens` (matched from the end, so a resumed run's shorter timeline
    pairs with its last rows) (`fit_train`);
  * weight push: mean "push" span duration of component "channel" (0 when the timeline has none:
    the threaded driver times the push inside train_step);
  * completion lengths: each train row's `completion_lengths` (one entry per trained sample,
    group by group) if the run logged them, resampled by whole groups, else a log-normal
    matched to the moments of the per-step means m_j:
    E[L] = mean_j m_j and Var[L] = B * Var_j(m_j) (the mean of B i.i.d. lengths has variance
    Var[L] / B), sigma^2 = ln(1 + Var[L] / E[L]^2) (method of moments for the log-normal), capped
    at the sampler's completion budget.

experiments/lib/sim_validation.py runs real pipelines and compares the calibrated simulator with
them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Sequence

import numpy as np

from rlax_pipe import timeline as timeline_lib
from rlax_pipe.pipeline import staleness as staleness_lib
from rlax_pipe.run_dir import read_metrics
from rlax_pipe.sim import distributions
from rlax_pipe.sim.costs import DecodeCurve, SimCosts
from rlax_pipe.sim.simulator import SimConfig


@dataclasses.dataclass(frozen=True)
class LinearFit:
  """y ~ intercept + slope * x.

  Attributes:
    intercept, slope: least-squares coefficients (slope 0 when x never varies).
    rel_rmse: root-mean-square residual / mean(y) (0 for a perfect fit).
    n: points used.
  """

  intercept: float
  slope: float
  rel_rmse: float
  n: int


def fit_linear(x: Sequence[float], y: Sequence[float]) -> LinearFit:
  """Ordinary least squares of y on [1, x].

  When x is constant the slope is not identifiable: the fit is then y ~ mean(y) (slope 0), which
  is exact at the only x observed.

  Raises:
    ValueError: with no points, or x and y of different lengths.
  """
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.ndim != 1 or x.shape != y.shape or x.size == 0:
    raise ValueError(f"fit_linear: need equal-length non-empty 1-D x, y; got {x.shape}, "
                     f"{y.shape}.")
  if np.ptp(x) == 0:
    a, b = float(y.mean()), 0.0
  else:
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
  resid = y - (a + b * x)
  scale = abs(float(y.mean())) or 1.0
  return LinearFit(float(a), float(b), float(np.sqrt(np.mean(resid ** 2)) / scale), int(x.size))


def fit_decode(spans: Sequence[timeline_lib.Span], component: str = "sampler") -> LinearFit:
  """Decode-step seconds vs active slots from the "decode" spans of `component`.

  Raises:
    ValueError: if there is no decode span with slot counts.
  """
  pts = [(s.slots_active, s.duration) for s in spans
         if s.component == component and s.kind == "decode" and s.slots_active is not None]
  if not pts:
    raise ValueError(f"fit_decode: no '{component}/decode' span with slots_active.")
  x, y = zip(*pts)
  return fit_linear(x, y)


def train_rows(rows: Sequence[dict]) -> list[dict]:
  """The metrics rows of kind "train", sorted by step."""
  return sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r["step"])


def fit_train(spans: Sequence[timeline_lib.Span], rows: Sequence[dict]) -> LinearFit:
  """Learner step seconds vs trained completion tokens.

  Pairs the k-th last "learner/train_step" span with the k-th last train row.

  Raises:
    ValueError: if there is no train_step span or no train row.
  """
  steps = [s.duration for s in spans if s.component == "learner" and s.kind == "train_step"]
  tr = train_rows(rows)
  n = min(len(steps), len(tr))
  if n == 0:
    raise ValueError("fit_train: need learner/train_step spans and train rows.")
  return fit_linear([r["completion_tokens"] for r in tr[-n:]], steps[-n:])


def push_seconds(spans: Sequence[timeline_lib.Span]) -> float:
  """Mean duration of "channel/push" spans (0.0 if none)."""
  d = [s.duration for s in spans if s.component == "channel" and s.kind == "push"]
  return float(np.mean(d)) if d else 0.0


def prefill_per_sample(spans: Sequence[timeline_lib.Span], mean_completion_tokens: float,
                       component: str = "sampler") -> float:
  """Prefill seconds per started sample (see module docstring); 0.0 without decode spans."""
  prefill = sum(s.duration for s in spans if s.component == component and s.kind == "prefill")
  tokens = sum(s.slots_active or 0 for s in spans
               if s.component == component and s.kind == "decode")
  if tokens == 0 or mean_completion_tokens <= 0:
    return 0.0
  return prefill / (tokens / mean_completion_tokens)


def lengths_from_rows(rows: Sequence[dict], max_len: int | None = None,
                      group_size: int = 1) -> tuple[Any, str]:
  """The completion-length distribution of the trained samples (see module docstring).

  Args:
    rows: metrics rows.
    max_len: completion budget capping the moment-matched log-normal.
    group_size: samples per group, for resampling logged lengths by whole groups.

  Returns:
    (LengthDist, source) with source "completion_lengths" (exact, `GroupedEmpirical`) or
    "moments" (`LogNormal` fitted to the per-step means).

  Raises:
    ValueError: without train rows.
  """
  tr = train_rows(rows)
  if not tr:
    raise ValueError("lengths_from_rows: no train rows.")
  if all("completion_lengths" in r for r in tr):
    return distributions.GroupedEmpirical.of(
        [x for r in tr for x in r["completion_lengths"]], group_size), "completion_lengths"
  means = np.asarray([r["completion_tokens"] / r["samples"] for r in tr], np.float64)
  batch = float(np.mean([r["samples"] for r in tr]))
  mean = float(means.mean())
  var = batch * float(means.var(ddof=1)) if means.size > 1 else 0.0
  sigma = math.sqrt(math.log1p(var / mean ** 2))
  return distributions.LogNormal(mean, sigma, max_len), "moments"


@dataclasses.dataclass(frozen=True)
class Calibration:
  """Simulator inputs fitted from one run.

  Attributes:
    decode: decode-step fit (seconds vs active slots).
    train: learner-step fit (seconds vs trained completion tokens).
    prefill_per_sample_s: seconds of prefill per started sample.
    push_s: seconds per weight push.
    lengths: completion-length distribution (tokens).
    length_source: "completion_lengths", "moments" or "given".
    mean_completion_tokens: mean completion length of the trained samples.
  """

  decode: LinearFit
  train: LinearFit
  prefill_per_sample_s: float
  push_s: float
  lengths: Any
  length_source: str
  mean_completion_tokens: float

  def costs(self) -> SimCosts:
    """The fitted durations as `SimCosts` (negative fitted coefficients clipped to 0)."""
    return SimCosts(DecodeCurve(max(0.0, self.decode.intercept), max(0.0, self.decode.slope)),
                    self.prefill_per_sample_s, max(0.0, self.train.intercept),
                    max(0.0, self.train.slope), self.push_s)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready summary (the length distribution by name and mean)."""
    return {"decode_base_s": self.decode.intercept, "decode_per_slot_s": self.decode.slope,
            "decode_rel_rmse": self.decode.rel_rmse,
            "train_base_s": self.train.intercept, "train_per_token_s": self.train.slope,
            "train_rel_rmse": self.train.rel_rmse,
            "prefill_per_sample_s": self.prefill_per_sample_s, "push_s": self.push_s,
            "length_source": self.length_source,
            "length_dist": type(self.lengths).__name__,
            "mean_completion_tokens": self.mean_completion_tokens}


def calibrate(spans: Sequence[timeline_lib.Span], rows: Sequence[dict], lengths: Any = None,
              max_len: int | None = None, group_size: int = 1) -> Calibration:
  """Fits every simulator input from a run's spans and metrics rows.

  Args:
    spans: the run's timeline spans.
    rows: the run's metrics rows (train rows need completion_tokens and samples).
    lengths: a `LengthDist` to use instead of the one estimated from `rows`.
    max_len: completion budget (tokens) capping the estimated distribution.
    group_size: samples per prompt group (to resample logged lengths by group).

  Raises:
    ValueError: if the spans or rows lack what a fit needs.
  """
  tr = train_rows(rows)
  if not tr:
    raise ValueError("calibrate: no train rows in the metrics.")
  mean_len = sum(r["completion_tokens"] for r in tr) / sum(r["samples"] for r in tr)
  if lengths is None:
    lengths, source = lengths_from_rows(rows, max_len, group_size)
  else:
    source = "given"
  return Calibration(decode=fit_decode(spans), train=fit_train(spans, rows),
                     prefill_per_sample_s=prefill_per_sample(spans, mean_len),
                     push_s=push_seconds(spans), lengths=lengths, length_source=source,
                     mean_completion_tokens=mean_len)


# ---------------------------------------------------------------------------------------------
# Run directories.


def read_run(run_dir: str | pathlib.Path) -> tuple[list[timeline_lib.Span], list[dict], dict]:
  """(spans, metrics rows, config dict) of a run directory."""
  d = pathlib.Path(run_dir)
  spans = timeline_lib.Timeline.from_jsonl(str(d / "timeline.jsonl")).spans()
  rows = read_metrics(d)
  return spans, rows, json.loads((d / "config.json").read_text())


def completion_budget(config: dict) -> int:
  """The sampler's completion cap in tokens (max_new_tokens, at most max_seq_len - 1)."""
  s = config["sampler"]
  return int(min(s["max_new_tokens"], s["max_seq_len"] - 1))


def calibrate_run(run_dir: str | pathlib.Path, lengths: Any = None) -> Calibration:
  """`calibrate` on a run directory."""
  spans, rows, config = read_run(run_dir)
  return calibrate(spans, rows, lengths, completion_budget(config),
                   int(config["pipeline"]["group_size"]))


def sim_config_for_run(config: dict, calibration: Calibration, num_steps: int | None = None,
                       warmup_steps: int = 0, seed: int = 0) -> SimConfig:
  """The `SimConfig` that mirrors a run's config.json (driver, staleness, batch, slots).

  Args:
    config: the run's config.json as a dict.
    calibration: fitted costs and lengths.
    num_steps: learner steps to simulate (default: the run's).
    warmup_steps: steps excluded from the reported numbers.
    seed: length-draw seed.
  """
  p = config["pipeline"]
  st = p["staleness"]
  return SimConfig(
      driver=p["driver"],
      staleness=staleness_lib.StalenessConfig(st["policy"], st["max_lag"], st["groups_per_step"],
                                              st["queue_capacity_groups"]),
      group_size=int(p["group_size"]), num_steps=int(num_steps or p["num_steps"]),
      slots_per_engine=int(config["sampler"]["num_slots"]), lengths=calibration.lengths,
      costs=calibration.costs(), warmup_steps=warmup_steps, seed=seed)


def measured(rows: Sequence[dict], spans: Sequence[timeline_lib.Span], warmup_steps: int = 0
             ) -> dict[str, float]:
  """The numbers `SimResult` predicts, measured on a run over the same window.

  Window: from the end of step `warmup_steps` (its row's time_s; 0 when warmup_steps is 0) to
  the last train row's time_s.

  Returns:
    dict with tokens_per_s, samples_per_s, lag_mean (per-token, from lag_hist), lag_max,
    idle_sampler, idle_learner, slot_occupancy.

  Raises:
    ValueError: if there are not more train rows than warmup_steps.
  """
  tr = train_rows(rows)
  if len(tr) <= warmup_steps:
    raise ValueError(f"measured: {len(tr)} train rows, warmup_steps={warmup_steps}.")
  lo = tr[warmup_steps - 1]["time_s"] if warmup_steps else 0.0
  hi = tr[-1]["time_s"]
  kept = tr[warmup_steps:]
  hist = np.zeros(max(len(r["lag_hist"]) for r in kept), np.int64)
  for r in kept:
    hist[:len(r["lag_hist"])] += np.asarray(r["lag_hist"], np.int64)
  summary = timeline_lib.summarize(spans, window=(lo, hi))
  nz = np.nonzero(hist)[0]
  return {"tokens_per_s": sum(r["completion_tokens"] for r in kept) / (hi - lo),
          "samples_per_s": sum(r["samples"] for r in kept) / (hi - lo),
          "lag_mean": float((hist * np.arange(hist.shape[0])).sum() / max(hist.sum(), 1)),
          "lag_max": int(nz.max()) if nz.size else 0,
          "idle_sampler": summary.idle.get("sampler", float("nan")),
          "idle_learner": summary.idle.get("learner", float("nan")),
          "slot_occupancy": summary.slot_occupancy}
