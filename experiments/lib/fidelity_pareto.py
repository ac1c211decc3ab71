"""Issue 26 item 4: throughput per device-second against gradient fidelity, per max lag.

Throughput side: a staleness sweep's table (`experiments/sweep_staleness.py`'s table.json; rows
with max_lag, objective, samples_per_device_s and its interval, token_lag_mean, heldout_end),
whatever clock it was measured with; its `throughput_clock` field is carried into the figure's
label (e.g. the issue-16 sweep: the virtual clock with the cost model measured on the 2-core CPU,
not a wall-clock measurement on separate devices).

Fidelity side: the instrument's fixed-lag rows (`fidelity_run.measure`). A pipeline run at
max_lag K trains tokens of many lags; its fidelity is read at the run's measured mean token lag,
linearly interpolated between the instrument's measured lags (the interval's bounds likewise).
That is an approximation (the fidelity of a mixture of lags is not the fidelity at its mean lag);
the in-flight-mix rows of the instrument are the direct measurement where they exist.

From the pinned systems run (issue 26 item 3, experiments/pinned_systems_run.py's pinned.json)
instead of a sweep: `sweep_from_pinned` predicts each max lag K's throughput and mean token lag
with the simulator charging the pinned pipeline run's own fitted cost model (the model item 3
validates against the measured wall clock, with its errors carried in the clock label), the run's
configuration with only max_lag changed, and its logged lengths.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

_OBJECTIVE_OF_SWEEP = {"tis_pg": "tis", "no_correction": "no_correction",
                       "untruncated_is": "untruncated_is", "cispo": "cispo"}


def fidelity_at(rows: Sequence[dict], objective: str, lag: float, metric: str = "cosine"
                ) -> list[float] | None:
  """[value, low, high] of `metric` at a (fractional) lag, interpolated over the fixed-lag rows;
  None when the objective has no rows or the lag is beyond the largest measured lag."""
  pts = sorted((r["lag"], r[metric]) for r in rows if r["case"] == "lag"
               and r["objective"] == objective)
  if not pts or lag > pts[-1][0] or lag < pts[0][0]:
    return None
  x = np.array([p[0] for p in pts], np.float64)
  y = np.array([p[1] for p in pts], np.float64)
  return [float(np.interp(lag, x, y[:, i])) for i in range(3)]


def pareto_rows(fidelity_table: dict, sweep_rows: Sequence[dict]) -> list[dict]:
  """One row per sweep cell: max_lag, objective, throughput (+- half-width), its clock, mean
  token lag, held-out accuracy, and the interpolated cosine and bias along g*."""
  out = []
  for r in sweep_rows:
    obj = _OBJECTIVE_OF_SWEEP.get(r["objective"], r["objective"])
    lag = float(r["token_lag_mean"])
    out.append(dict(
        max_lag=int(r["max_lag"]), objective=obj, token_lag_mean=lag,
        samples_per_device_s=float(r["samples_per_device_s"]),
        samples_per_device_s_hw=float(r.get("samples_per_device_s_ci", float("nan"))),
        throughput_clock=r.get("throughput_clock", "unknown"),
        heldout_end=float(r.get("heldout_end", float("nan"))),
        heldout_end_hw=float(r.get("heldout_end_ci", float("nan"))),
        cosine=fidelity_at(fidelity_table["rows"], obj, lag),
        bias_parallel=fidelity_at(fidelity_table["rows"], obj, lag, "bias_parallel"),
        mse=(fidelity_at(fidelity_table["rows"], obj, lag, "mse")
             if all("mse" in x for x in fidelity_table["rows"]) else None)))
  return out


def plot(rows: Sequence[dict], path: str) -> None:
  """Throughput per device-second (x) against cosine with g* and held-out accuracy (y)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fid = "mse" if rows and all(r.get("mse") is not None for r in rows) else "cosine"
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  objectives = list(dict.fromkeys(r["objective"] for r in rows))
  for o, name in enumerate(objectives):
    pts = sorted((r for r in rows if r["objective"] == name), key=lambda r: r["max_lag"])
    for ax, key in zip(axes, (fid, "heldout_end")):
      sel = [r for r in pts if r[key] is not None and not (
          isinstance(r[key], float) and np.isnan(r[key]))]
      if not sel:
        continue
      x = [r["samples_per_device_s"] for r in sel]
      xe = [r["samples_per_device_s_hw"] for r in sel]
      if key == fid:
        y = [r[key][0] for r in sel]
        ye = [[r[key][0] - r[key][1] for r in sel], [r[key][2] - r[key][0] for r in sel]]
      else:
        y = [r[key] for r in sel]
        ye = [r["heldout_end_hw"] for r in sel]
      ax.errorbar(x, y, xerr=xe, yerr=ye, fmt="-o", color=f"C{o}", capsize=2, label=name)
      for r, xi, yi in zip(sel, x, y):
        ax.annotate(f"K={r['max_lag']} (lag {r['token_lag_mean']:.1f})", (xi, yi), fontsize=6)
  clock = rows[0]["throughput_clock"] if rows else ""
  axes[0].set_ylabel("cos(g_i, g*) at the run's mean token lag (instrument)" if fid == "cosine"
                     else "per-batch MSE vs IS anchor / E|g_on|^2 [rf] at the mean token lag")
  axes[1].set_ylabel("held-out accuracy at the end (sweep)")
  for ax in axes:
    ax.set_xlabel(f"samples per device-second [{clock}]")
    ax.legend(fontsize=7)
  fig.suptitle("Staleness trade-off: throughput vs gradient fidelity and accuracy per max_lag K")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def sweep_from_pinned(pinned_path: str, max_lags: Sequence[int], objectives: Sequence[str],
                      seeds: Sequence[int] = (0, 1, 2, 3)) -> list[dict]:
  """Sweep-like rows (module docstring): per max lag K and objective, the simulator's samples
  per device-second (2 devices: learner + sampler) and mean token lag for the pinned pipeline
  run's configuration at max_lag K, with that run's own cost model.

  Raises:
    ValueError: when pinned.json holds no successful pipeline run with a cost model.
  """
  # pylint: disable=import-outside-toplevel
  from rlax_pipe.sim import calibration
  from rlax_pipe.sim import simulator as sim_lib
  with open(pinned_path) as f:
    pinned = json.load(f)
  runs = [r for r in pinned["results"] if r["driver"] == "pipeline" and "predicted" in r]
  if not runs:
    raise ValueError(f"{pinned_path}: no pipeline run with a cost model; rerun "
                     "pinned_systems_run.py with --drivers including pipeline.")
  run = runs[0]
  _, rows, config = calibration.read_run(run["run_dir"])
  model = calibration.calibrate_run(run["run_dir"]).cost_model
  g = int(config["pipeline"]["group_size"])
  lengths, _ = calibration.lengths_from_rows(rows, group_size=g)
  prompts, _ = calibration.lengths_from_rows(rows, group_size=g, key="prompt_lengths")
  clock = (f"simulator, cost model of the pinned pipeline run (its error vs measured wall: "
           f"{run['throughput_rel_err']:+.1%} throughput, {run['sample_lag_abs_err']:+.2f} "
           "steps lag)")
  out = []
  for k in max_lags:
    cfg = json.loads(json.dumps(config))
    cfg["pipeline"]["staleness"]["max_lag"] = int(k)
    res = [sim_lib.simulate(calibration.sim_config_for_run(
        cfg, model, lengths, prompts, warmup_steps=pinned["warmup_steps"], seed=s))
           for s in seeds]
    tput = np.array([r.samples_per_s for r in res]) / 2.0
    lag = float(np.mean([r.token_lag_mean for r in res]))
    for obj in objectives:
      out.append(dict(max_lag=int(k), objective=obj, samples_per_device_s=float(tput.mean()),
                      samples_per_device_s_ci=float(1.96 * tput.std(ddof=1) / np.sqrt(len(res)))
                      if len(res) > 1 else float("nan"),
                      token_lag_mean=lag, throughput_clock=clock))
  return out


def write(fidelity_table: dict, sweep_table_path: str, out_prefix: str,
          sweep: Sequence[dict] | None = None) -> list[dict]:
  """Reads the sweep table (or takes `sweep` rows), writes <out_prefix>.json and .png; returns
  the rows."""
  if sweep is None:
    with open(sweep_table_path) as f:
      sweep = json.load(f)
  rows = pareto_rows(fidelity_table, sweep)
  with open(out_prefix + ".json", "w") as f:
    json.dump(dict(sweep_table=sweep_table_path, rows=rows), f, indent=1)
  plot(rows, out_prefix + ".png")
  return rows
