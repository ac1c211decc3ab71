"""Staleness sweeps: the same RL job over a grid of max_lag x objective, one table, five plots.

Used by `experiments/sweep_staleness.py`. Every cell is a full reproducible run (same seed, task,
model, devices); the table holds, per cell, throughput in device time (virtual clock), idle
fraction of each mesh, mean ESS and importance-ratio variance, both staleness measures (per-token
lag and per-sample lag of the oldest token, mean and max) and the held-out accuracy at the start
and the end.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

import numpy as np

from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.run_dir import read_metrics


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


def summarize_cell(run_dir: str, max_lag: int | None, objective: str) -> dict:
  """One table row from a finished run directory."""
  rows = read_metrics(run_dir)
  summary = json.loads((pathlib.Path(run_dir) / "summary.json").read_text())
  train = [r for r in rows if r["kind"] == "train"]
  evals = [r for r in rows if r["kind"] == "eval"]
  samples = sum(r["samples"] for r in train)

  def train_mean(key: str) -> float | None:
    # A step logs a statistic only when it had tokens it describes (learner metrics are absent,
    # not 0, otherwise): average over the steps that have it.
    values = [r[key] for r in train if key in r]
    return float(np.mean(values)) if values else None

  return {
      "max_lag": lag_name(max_lag), "objective": objective, "run_dir": run_dir,
      "samples_per_s": samples / max(summary["time_s"], 1e-9),
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
      "heldout_end": evals[-1]["heldout_accuracy"] if evals else None,
      "reward_last5": float(np.mean([r["reward_mean"] for r in train[-5:]])) if train else None,
  }


def run_sweep(base: run_lib.RunConfig, max_lags: Sequence[int | None],
              objectives_: Sequence[str], out_dir: str) -> list[dict]:
  """Runs every cell (lags outer, objectives inner); returns the table rows."""
  table = []
  for lag in max_lags:
    for obj in objectives_:
      cfg = cell_config(base, lag, obj, out_dir)
      run_lib.run(cfg)
      table.append(summarize_cell(cfg.run_dir, lag, obj))
  return table


def plot_sweep(table: Sequence[dict], out_dir: str) -> list[str]:
  """Writes the sweep figures; returns their paths.

  reward_vs_time.png and reward_vs_samples.png (batch reward curves per cell), ess_vs_lag.png,
  ratio_var_vs_lag.png, staleness_vs_lag.png (per-sample and per-token mean staleness),
  throughput_idle_vs_lag.png.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  out, paths = pathlib.Path(out_dir), []

  def save(fig, name):
    FigureCanvasAgg(fig)
    fig.savefig(out / name, dpi=90)
    paths.append(str(out / name))

  for key, name, label in (("time_s", "reward_vs_time.png", "device time (s, virtual clock)"),
                           ("samples_cum", "reward_vs_samples.png", "samples trained")):
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    for row in table:
      rows = read_metrics(row["run_dir"])
      train = [r for r in rows if r["kind"] == "train"]
      xs = (np.cumsum([r["samples"] for r in train]) if key == "samples_cum"
            else [r["time_s"] for r in train])
      ax.plot(xs, [r["reward_mean"] for r in train],
              label=f"lag {row['max_lag']} {row['objective']}", alpha=0.8)
    ax.set_xlabel(label)
    ax.set_ylabel("batch reward")
    ax.set_title(f"Batch reward vs {label}")
    ax.legend(fontsize=7)
    save(fig, name)
  lags = sorted({r["max_lag"] for r in table}, key=lambda x: float("inf") if x == "inf"
                else int(x))
  objs = sorted({r["objective"] for r in table})
  for metrics, name in ((("ess_mean",), "ess_vs_lag.png"),
                        (("ratio_var_mean",), "ratio_var_vs_lag.png"),
                        (("sample_lag_mean", "token_lag_mean"), "staleness_vs_lag.png")):
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot(1, 1, 1)
    for obj in objs:
      for metric in metrics:
        ys = [next(r[metric] for r in table if r["max_lag"] == l and r["objective"] == obj)
              for l in lags]
        ax.plot(range(len(lags)), ys, "o-",
                label=obj if len(metrics) == 1 else f"{obj}: {metric}")
    metric = metrics[0] if len(metrics) == 1 else "staleness (learner steps)"
    ax.set_xticks(range(len(lags)))
    ax.set_xticklabels(lags)
    ax.set_xlabel("max_lag (steps)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs max_lag")
    ax.legend(fontsize=7)
    save(fig, name)
  fig = Figure(figsize=(10, 4))
  ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
  first = [next(r for r in table if r["max_lag"] == l) for l in lags]
  ax1.plot(range(len(lags)), [r["samples_per_s"] for r in first], "o-")
  ax1.set_ylabel("samples/s (device time)")
  ax1.set_title("Throughput vs max_lag (virtual device time)")
  ax2.plot(range(len(lags)), [r["idle_sampler"] for r in first], "o-", label="sampler")
  ax2.plot(range(len(lags)), [r["idle_learner"] for r in first], "o-", label="learner")
  ax2.set_ylabel("idle fraction")
  ax2.set_title("Idle fraction of each mesh vs max_lag")
  ax2.legend()
  for ax in (ax1, ax2):
    ax.set_xticks(range(len(lags)))
    ax.set_xticklabels(lags)
    ax.set_xlabel("max_lag (steps)")
  save(fig, "throughput_idle_vs_lag.png")
  return paths
