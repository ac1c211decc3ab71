"""Staleness sweeps: the same RL job over a grid of max_lag x objective, one table, six plots.

Used by `experiments/sweep_staleness.py`. Every cell is a full reproducible run per seed (same
task, model, devices; `lib.seeds` sets the seed and reduces the seeds to a mean and a 95%
t-interval per metric); the table holds, per cell, throughput in device time (virtual clock)
also per device-second, idle fraction of each mesh, mean ESS and importance-ratio variance, both
staleness measures (per-token lag and per-sample lag of the oldest token, mean and max) and the
held-out accuracy at the start and the end with its evaluation noise.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

import numpy as np

from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.run_dir import read_config, read_metrics


def lag_name(max_lag: int | None) -> str:
  return "inf" if max_lag is None else str(max_lag)


def cell_config(base: run_lib.RunConfig, max_lag: int | None, objective: str,
                out_dir: str) -> run_lib.RunConfig:
  """`base` with one (max_lag, objective) cell applied and its own run directory."""
  pipe = base.pipeline
  stale = dataclasses.replace(pipe.staleness, max_lag=max_lag)
  return dataclasses.replace(
      base, run_dir=str(pathlib.Path(out_dir) / f"lag{lag_name(max_lag)}_{objective}"),
      resume=False, objective=dataclasses.replace(base.objective, name=objective),
      pipeline=dataclasses.replace(pipe, staleness=stale))


def num_devices(run_dir: str) -> int | None:
  """Sampler + learner devices of a finished run (its run_info.json's resolved mesh axes), or
  None when the run recorded none."""
  p = pathlib.Path(run_dir) / "run_info.json"
  if not p.exists():
    return None
  info = json.loads(p.read_text())
  axes = info.get("sampler_mesh_axes"), info.get("learner_mesh_axes")
  if not all(axes):
    return None
  return sum(int(np.prod([size for _, size in a])) for a in axes)


def summarize_cell(run_dir: str, max_lag: int | None, objective: str) -> dict:
  """One table row from a finished run directory.

  Throughput: `samples_per_s` = trained samples / run time (the virtual device clock of the
  reproducible mode, driven by pipeline.cost_model; measured wall time in threaded mode), and
  `samples_per_device_s` = the same per device-second (divided by sampler + learner devices);
  `throughput_clock` names that time (a measured cost-model file, the hand-set default's
  source, or the measured wall clock). `heldout_end_eval_hw` = binomial 95% half-width of the
  final held-out accuracy on its `eval_problems` problems (the evaluation noise of one run).
  """
  from lib import seeds as seeds_lib  # pylint: disable=import-outside-toplevel
  rows = read_metrics(run_dir)
  summary = json.loads((pathlib.Path(run_dir) / "summary.json").read_text())
  config = read_config(run_dir) or {}
  devices = num_devices(run_dir)
  eval_problems = config.get("pipeline", {}).get("eval_problems")
  train = [r for r in rows if r["kind"] == "train"]
  evals = [r for r in rows if r["kind"] == "eval"]
  samples = sum(r["samples"] for r in train)

  def train_mean(key: str) -> float | None:
    # A step logs a statistic only when it had tokens it describes (learner metrics are absent,
    # not 0, otherwise): average over the steps that have it.
    values = [r[key] for r in train if key in r]
    return float(np.mean(values)) if values else None

  pcfg = config.get("pipeline", {})
  if pcfg.get("mode") == "threaded":
    clock = "measured wall clock (threaded)"
  elif pcfg.get("cost_model_file"):
    clock = f"measured cost model {pathlib.Path(pcfg['cost_model_file']).name}"
  else:
    clock = pcfg.get("cost_model", {}).get("source", "default: hand-set, not a measurement")
  samples_per_s = samples / max(summary["time_s"], 1e-9)
  end = evals[-1]["heldout_accuracy"] if evals else None
  return {
      "max_lag": lag_name(max_lag), "objective": objective, "run_dir": run_dir,
      "throughput_clock": clock,
      "samples_per_s": samples_per_s,
      "samples_per_device_s": samples_per_s / devices if devices else None,
      "devices": devices, "time_s": summary["time_s"], "wall_s": summary.get("wall_s"),
      "tokens_per_s": train[-1]["tokens_per_s"] if train else 0.0,
      "idle_sampler": summary["idle_fraction"].get("sampler"),
      "idle_learner": summary["idle_fraction"].get("learner"),
      "slot_occupancy": summary["slot_occupancy"],
      "ess_mean": train_mean("ess"),
      "ratio_var_mean": train_mean("ratio_var"),
      "kl_k3_mean": train_mean("kl_k3"),
      "logp_mismatch_mean": train_mean("logp_mismatch_mean"),
      "frac_truncated_mean": train_mean("frac_truncated"),
      "token_lag_mean": train_mean("token_lag_mean"),
      "token_lag_max": max((r["token_lag_max"] for r in train), default=0),
      "sample_lag_mean": train_mean("sample_lag_mean"),
      "sample_lag_max": max((r["sample_lag_max"] for r in train), default=0),
      "heldout_start": evals[0]["heldout_accuracy"] if evals else None,
      "heldout_end": end,
      "eval_problems": eval_problems,
      "heldout_end_eval_hw": (seeds_lib.binomial_half_width(end, eval_problems)
                              if end is not None and eval_problems else None),
      "reward_last5": float(np.mean([r["reward_mean"] for r in train[-5:]])) if train else None,
  }


def run_sweep(base: run_lib.RunConfig, max_lags: Sequence[int | None],
              objectives_: Sequence[str], out_dir: str, seeds: Sequence[int] = (0,)) -> list[dict]:
  """Runs every cell (lags outer, objectives inner) once per seed; returns one row per cell with
  each metric the mean over seeds and `<metric>_ci` its 95% t half-width (`lib.seeds`). Runs live
  in <out_dir>/cells/<config hash>; finished ones are reused."""
  from lib import seeds as seeds_lib  # pylint: disable=import-outside-toplevel
  cells_dir = str(pathlib.Path(out_dir) / "cells")
  cells = []
  for lag in max_lags:
    for obj in objectives_:
      cfg = cell_config(base, lag, obj, cells_dir)
      cells.append((f"lag{lag_name(lag)}_{obj}", cfg,
                    lambda d, lag=lag, obj=obj: summarize_cell(d, lag, obj)))
  return seeds_lib.run_seeds(cells, seeds, cells_dir)


def _lag_order(table: Sequence[dict]) -> list[str]:
  return sorted({r["max_lag"] for r in table},
                key=lambda x: float("inf") if x == "inf" else int(x))


def _ci(row: dict, metric: str) -> float:
  v = row.get(metric + "_ci")
  return 0.0 if v is None or not np.isfinite(v) else float(v)


def _seed_curves(row: dict, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(x, mean reward, 95% t half-width) over the seeds of a cell, per learner step; x is the
  mean over seeds of the step's device time or cumulative samples."""
  from lib import seeds as seeds_lib  # pylint: disable=import-outside-toplevel
  runs = [[r for r in read_metrics(s["run_dir"]) if r["kind"] == "train"]
          for s in row.get("per_seed", [row])]
  n = min(len(t) for t in runs)
  xs = [np.cumsum([r["samples"] for r in t[:n]]) if key == "samples_cum"
        else np.array([r["time_s"] for r in t[:n]]) for t in runs]
  stats = [seeds_lib.t_interval([t[i]["reward_mean"] for t in runs]) for i in range(n)]
  return (np.mean(xs, axis=0), np.array([m for m, _ in stats]),
          np.nan_to_num(np.array([h for _, h in stats])))


def plot_pareto(table: Sequence[dict], out_dir: str, name: str = "pareto.png",
                title: str = "Throughput vs final accuracy") -> str:
  """The trade-off figure: samples per device-second (x) against final held-out accuracy (y),
  one point per cell (max lag, objective / label) with 95% intervals over seeds on both axes;
  returns its path. Throughput is in the runs' time: the virtual device clock of their cost
  model (the row's `throughput_clock` names it: a measured cost-model file or the hand-set
  default) in the reproducible mode, measured wall clock in the threaded mode."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(7, 5))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  per_dev = all(r.get("samples_per_device_s") is not None for r in table)
  xkey = "samples_per_device_s" if per_dev else "samples_per_s"
  markers = dict(zip(sorted({r["objective"] for r in table}), "osD^vP*X"))
  for r in table:  # marker = objective (cells that ran identically draw on top of each other)
    label = r.get("label") or f"lag {r['max_lag']} {r['objective']}"
    ax.errorbar(r[xkey], r["heldout_end"], xerr=_ci(r, xkey), yerr=_ci(r, "heldout_end"),
                fmt=markers[r["objective"]], capsize=3, label=label, alpha=0.8)
  clocks = sorted({str(r.get("throughput_clock", "pipeline.cost_model")) for r in table})
  ax.set_xlabel(("samples per device-second" if per_dev else "samples per second") +
                f" (clock: {'; '.join(clocks)})", fontsize=8)
  ax.set_ylabel("final held-out accuracy")
  nseeds = max(r.get("seeds", 1) for r in table)
  ax.set_title(f"{title} (mean, 95% CI, {nseeds} seeds)", fontsize=10)
  ax.legend(fontsize=6)
  path = pathlib.Path(out_dir) / name
  fig.savefig(path, dpi=90)
  return str(path)


def plot_sweep(table: Sequence[dict], out_dir: str) -> list[str]:
  """Writes the sweep figures, every value a mean over seeds with its 95% interval; returns
  their paths.

  reward_vs_time.png and reward_vs_samples.png (batch reward per step, shaded interval),
  ess_vs_lag.png, ratio_var_vs_lag.png, staleness_vs_lag.png (per-sample and per-token mean
  staleness), throughput_idle_vs_lag.png, pareto.png (`plot_pareto`).
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  out, paths = pathlib.Path(out_dir), []
  nseeds = max(r.get("seeds", 1) for r in table)
  ci = f"mean, 95% CI, {nseeds} seeds"

  def save(fig, name):
    FigureCanvasAgg(fig)
    fig.savefig(out / name, dpi=90)
    paths.append(str(out / name))

  for key, name, label in (("time_s", "reward_vs_time.png", "device time (s, virtual clock)"),
                           ("samples_cum", "reward_vs_samples.png", "samples trained")):
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    for row in table:
      xs, mean, hw = _seed_curves(row, key)
      line, = ax.plot(xs, mean, label=f"lag {row['max_lag']} {row['objective']}", alpha=0.8)
      ax.fill_between(xs, mean - hw, mean + hw, color=line.get_color(), alpha=0.15)
    ax.set_xlabel(label)
    ax.set_ylabel("batch reward")
    ax.set_title(f"Batch reward vs {label} ({ci})", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, name)
  lags = _lag_order(table)
  objs = sorted({r["objective"] for r in table})
  for metrics, name in ((("ess_mean",), "ess_vs_lag.png"),
                        (("ratio_var_mean",), "ratio_var_vs_lag.png"),
                        (("sample_lag_mean", "token_lag_mean"), "staleness_vs_lag.png")):
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot(1, 1, 1)
    for obj in objs:
      sel = [next(r for r in table if r["max_lag"] == l and r["objective"] == obj) for l in lags]
      for metric in metrics:
        ax.errorbar(range(len(lags)), [r[metric] for r in sel],
                    yerr=[_ci(r, metric) for r in sel], fmt="o-", capsize=3,
                    label=obj if len(metrics) == 1 else f"{obj}: {metric}")
    metric = metrics[0] if len(metrics) == 1 else "staleness (learner steps)"
    ax.set_xticks(range(len(lags)))
    ax.set_xticklabels(lags)
    ax.set_xlabel("max_lag (steps)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs max_lag ({ci})", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, name)
  fig = Figure(figsize=(10, 4))
  ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
  first = [next(r for r in table if r["max_lag"] == l) for l in lags]
  ax1.errorbar(range(len(lags)), [r["samples_per_s"] for r in first],
               yerr=[_ci(r, "samples_per_s") for r in first], fmt="o-", capsize=3)
  ax1.set_ylabel("samples/s (device time)")
  ax1.set_title(f"Throughput vs max_lag (virtual device time; {ci})", fontsize=9)
  for mesh in ("sampler", "learner"):
    ax2.errorbar(range(len(lags)), [r[f"idle_{mesh}"] for r in first],
                 yerr=[_ci(r, f"idle_{mesh}") for r in first], fmt="o-", capsize=3, label=mesh)
  ax2.set_ylabel("idle fraction")
  ax2.set_title(f"Idle fraction of each mesh vs max_lag ({ci})", fontsize=9)
  ax2.legend()
  for ax in (ax1, ax2):
    ax.set_xticks(range(len(lags)))
    ax.set_xticklabels(lags)
    ax.set_xlabel("max_lag (steps)")
  save(fig, "throughput_idle_vs_lag.png")
  paths.append(plot_pareto(table, out_dir))
  return paths
