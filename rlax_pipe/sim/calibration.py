"""The simulator's inputs from a run directory, and the numbers it predicts measured on the run.

Costs come from what was measured, never from the virtual clock that produced a reproducible
run (fitting those spans recovers the clock's own constants: a model checked against itself):
`calibrate_run` fits `rlax_pipe.costs.CostModel` to the operations a threaded run timed
(run_dir/cost_records.jsonl, written by the job in threaded mode) with
`costs.fit_cost_model`, confidence intervals included.

Lengths: each train row's `completion_lengths` and `prompt_lengths` (one entry per trained
sample, group by group) when the run logged them, resampled by whole groups
(`distributions.GroupedEmpirical`); else a log-normal matched to the moments of the per-step means
m_j: E[L] = mean_j m_j and Var[L] = B * Var_j(m_j) (the mean of B i.i.d. lengths has variance
Var[L] / B), sigma^2 = ln(1 + Var[L] / E[L]^2) (method of moments for the log-normal), capped at
the sampler's completion budget.

`measured` gives the numbers `SimResult` predicts over the same window: throughput, both
staleness measures (per-token lag and per-sample lag of the oldest token), idle fractions and
slot occupancy. experiments/lib/sim_validation.py compares them.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Sequence

import numpy as np

from rlax_pipe import costs as costs_lib
from rlax_pipe import timeline as timeline_lib
from rlax_pipe.pipeline import staleness as staleness_lib
from rlax_pipe.run_dir import read_metrics
from rlax_pipe.sim import distributions
from rlax_pipe.sim.sim_config import SimConfig

COST_RECORDS = "cost_records.jsonl"
COST_FIT = "cost_fit.json"


def train_rows(rows: Sequence[dict]) -> list[dict]:
  """The metrics rows of kind "train", sorted by step."""
  return sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r["step"])


def lengths_from_rows(rows: Sequence[dict], max_len: int | None = None,
                      group_size: int = 1, key: str = "completion_lengths") -> tuple[Any, str]:
  """The length distribution of the trained samples (module docstring).

  Args:
    rows: metrics rows.
    max_len: completion budget capping the moment-matched log-normal.
    group_size: samples per group, for resampling logged lengths by whole groups.
    key: "completion_lengths" or "prompt_lengths" (prompts: one per group, no moment fallback).

  Returns:
    (LengthDist, source) with source `key` (exact, `GroupedEmpirical`) or "moments"
    (`LogNormal` fitted to the per-step means).

  Raises:
    ValueError: without train rows, or without logged prompt lengths.
  """
  tr = train_rows(rows)
  if not tr:
    raise ValueError("lengths_from_rows: no train rows.")
  if all(key in r for r in tr):
    values = [x for r in tr for x in r[key]]
    if key == "prompt_lengths":
      return distributions.GroupedEmpirical.of(values[::group_size], 1), key
    return distributions.GroupedEmpirical.of(values, group_size), key
  if key == "prompt_lengths":
    raise ValueError("lengths_from_rows: the run did not log prompt_lengths.")
  means = np.asarray([r["completion_tokens"] / r["samples"] for r in tr], np.float64)
  batch = float(np.mean([r["samples"] for r in tr]))
  mean = float(means.mean())
  var = batch * float(means.var(ddof=1)) if means.size > 1 else 0.0
  sigma = math.sqrt(math.log1p(var / mean ** 2))
  return distributions.LogNormal(mean, sigma, max_len), "moments"


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


def calibrate_run(run_dirs: str | pathlib.Path | Sequence[str | pathlib.Path],
                  source: str | None = None) -> costs_lib.CostFit:
  """Fits the cost model to the operations timed by one or more threaded runs (pooled).

  Raises:
    FileNotFoundError: when a run has no cost_records.jsonl (a reproducible run: its spans
      come from the virtual clock, which cannot calibrate itself).
  """
  dirs = [run_dirs] if isinstance(run_dirs, (str, pathlib.Path)) else list(run_dirs)
  records = []
  for d in dirs:
    path = pathlib.Path(d) / COST_RECORDS
    if not path.exists():
      raise FileNotFoundError(
          f"{path} does not exist: calibrate from a threaded run (PipelineConfig.mode="
          "'threaded' records every timed operation); a reproducible run's spans come from the "
          "virtual clock and would only give its own costs back.")
    records += costs_lib.read_records(path)
  return costs_lib.fit_cost_model(
      records, source or f"measured: threaded runs {[str(d) for d in dirs]}")


def sim_config_for_run(config: dict, cost_model: costs_lib.CostModel, lengths: Any,
                       prompt_lengths: Any, num_steps: int | None = None, warmup_steps: int = 0,
                       seed: int = 0, push_bytes: int = 0) -> SimConfig:
  """The `SimConfig` that mirrors a run's config.json (driver, staleness, batch, the sampler's
  slots and data replicas (one simulated engine each), row length, prefill rows, sequence
  capacity, decode steps per dispatch, prompt sharing, the learner's batch split) with the given
  costs and lengths.

  Args:
    config: the run's config.json as a dict.
    cost_model: the costs (e.g. `calibrate_run(...).cost_model`).
    lengths, prompt_lengths: completion and prompt length distributions.
    num_steps: learner steps to simulate (default: the run's).
    warmup_steps: steps excluded from the reported numbers.
    seed: length-draw seed.
    push_bytes: bytes of one weight push.
  """
  p, s, lr = config["pipeline"], config["sampler"], config.get("learner", {})
  replicas = dict(map(tuple, config.get("sampler_mesh_axes", ()))).get("data", 1)
  st = p["staleness"]
  return SimConfig(
      driver=p["driver"],
      staleness=staleness_lib.StalenessConfig(st["policy"], st["max_lag"], st["groups_per_step"],
                                              st["queue_capacity_groups"]),
      group_size=int(p["group_size"]), num_steps=int(num_steps or p["num_steps"]),
      slots_per_engine=int(s["num_slots"]), num_engines=int(replicas), lengths=lengths,
      costs=cost_model,
      warmup_steps=warmup_steps, seed=seed, prompt_lengths=prompt_lengths,
      prefill_rows=int(s.get("prefill_rows", 4)), seq_len=int(p["seq_len"]),
      micro_batch_rows=lr.get("micro_batch_rows"),
      num_minibatches=int(lr.get("num_minibatches", 1)),
      push_bytes=push_bytes, max_seq_len=int(s["max_seq_len"]),
      decode_steps_per_dispatch=int(s.get("decode_steps_per_dispatch", 1)),
      share_prompt_pages=bool(s.get("share_prompt_pages", False)))


def measured(rows: Sequence[dict], spans: Sequence[timeline_lib.Span], warmup_steps: int = 0,
             span_window: bool = True) -> dict[str, float]:
  """The numbers `SimResult` predicts, measured on a run over the same window.

  Window: from the end of step `warmup_steps` (its row's time_s; 0 when warmup_steps is 0) to
  the last train row's time_s. The spans' idle fractions and occupancy use the same window when
  `span_window` (reproducible runs: rows and spans share the virtual clock); else the whole
  timeline (threaded runs: the spans' clock is perf_counter, the rows' is run time).

  Returns:
    dict with tokens_per_s, samples_per_s, token_lag_mean / token_lag_max (per token, from
    lag_hist), sample_lag_mean / sample_lag_max (per sample, the oldest token's lag),
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
  summary = timeline_lib.summarize(spans, window=(lo, hi) if span_window else None)
  nz = np.nonzero(hist)[0]
  samples = sum(r["samples"] for r in kept)
  return {"tokens_per_s": sum(r["completion_tokens"] for r in kept) / (hi - lo),
          "samples_per_s": samples / (hi - lo),
          "token_lag_mean": float((hist * np.arange(hist.shape[0])).sum() / max(hist.sum(), 1)),
          "token_lag_max": int(nz.max()) if nz.size else 0,
          "sample_lag_mean": float(sum(r.get("sample_lag_mean", 0.0) * r["samples"]
                                       for r in kept) / max(samples, 1)),
          "sample_lag_max": int(max(r.get("sample_lag_max", 0) for r in kept)),
          "idle_sampler": summary.idle.get("sampler", float("nan")),
          "idle_learner": summary.idle.get("learner", float("nan")),
          "slot_occupancy": summary.slot_occupancy}
