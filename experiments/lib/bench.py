"""Side-by-side comparison of the drivers on the same task, model, devices and seed.

Used by `experiments/bench_pipeline.py`. Each driver runs as a full RL job (its own run
directory); the comparison reads their metrics:

- time to target: the first held-out evaluation whose accuracy reaches the target, in the run's
  time axis (`time_s`: the virtual device clock in reproducible mode, i.e. what separate
  hardware would take; `wall_s`: this machine's wall clock, evaluation time excluded).
- samples/s: samples trained per second of run time.
- idle fraction per mesh and sampler slot occupancy, from the timeline.
"""

from __future__ import annotations

import dataclasses
import pathlib

from rlax_pipe.config_dict import ConfigError
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.run_dir import read_metrics


def time_to_target(rows: list[dict], target: float, key: str) -> float | None:
  """`key` ("time_s" or "wall_s") of the first eval row with accuracy >= target, else None."""
  for r in rows:
    if r["kind"] == "eval" and r["heldout_accuracy"] >= target:
      return float(r[key])
  return None


def run_drivers(base: run_lib.RunConfig, drivers: tuple[str, ...], out_dir: str,
                hooks=()) -> dict:
  """Runs each driver with `base` (only the driver and run_dir change); returns {driver: summary}.
  `hooks` (step hooks) are passed to every run."""
  out = {}
  for d in drivers:
    cfg = dataclasses.replace(base, run_dir=str(pathlib.Path(out_dir) / d), resume=False,
                              pipeline=dataclasses.replace(base.pipeline, driver=d))
    out[d] = run_lib.run(cfg, hooks=hooks)
  return out


def check_target(target: float, start: float) -> None:
  """A time to target is only measured when the target lies above the starting accuracy.

  Raises:
    ConfigError: when `target` <= `start` (every driver would reach it at time 0, and a
      speedup would compare noise), naming --target_accuracy and the fix.
  """
  if not target > start:
    raise ConfigError(
        f"--target_accuracy={target:g} is not above the starting held-out accuracy {start:g} "
        "(step 0, the same for every driver): every driver reaches it at time 0. Choose a target "
        f"above {start:g} (and below what the drivers reach), or leave it unset.")


class TargetCheck:
  """Step hook: after a run's first learner step (its step-0 evaluation is done), refuses a
  target at or below the starting accuracy before the benchmark spends its time."""

  def __init__(self, target: float):
    self.target = target

  def on_step(self, job, result, time_s) -> None:
    del result, time_s
    if job.learner.step == 1:
      evals = [r for r in job.run_dir.read_metrics() if r["kind"] == "eval"]
      if evals:
        check_target(self.target, evals[0]["heldout_accuracy"])

  def on_end(self, job, time_s) -> None:
    del job, time_s


def compare(summaries: dict, target: float | None = None) -> dict:
  """The comparison table (flat dict of numbers) from `run_drivers` output.

  Args:
    summaries: {driver: run summary}.
    target: held-out accuracy to reach, above the starting accuracy; None = the starting
      accuracy plus 90% of the lowest gain over the drivers (so every driver reaches it).

  Raises:
    ConfigError: when the target is not above the starting accuracy (`check_target`), or, with
      target None, when some driver never rose above it (no time to target exists).

  Returns:
    Flat dict with per-driver keys and the ratios `speedup_pipeline_vs_sync` (wall clock to
    target) and `device_time_speedup_pipeline_vs_sync` (virtual device time to target), when
    both drivers are present.
  """
  rows = {d: read_metrics(s["run_dir"]) for d, s in summaries.items()}
  best = {d: max(r["heldout_accuracy"] for r in rs if r["kind"] == "eval")
          for d, rs in rows.items()}
  start = min(next(r["heldout_accuracy"] for r in rs if r["kind"] == "eval")
              for rs in rows.values())
  if target is None:
    gain = min(best.values()) - start
    if not gain > 0:
      raise ConfigError(
          f"no time to target: a driver never rose above the starting held-out accuracy "
          f"{start:g} (best per driver {best}); run more steps (--config.pipeline.num_steps).")
    target = start + 0.9 * gain
  check_target(target, start)
  res: dict = {"target_accuracy": target, "starting_accuracy": start}
  for d, s in summaries.items():
    train = [r for r in rows[d] if r["kind"] == "train"]
    k = d.replace("-", "_")
    samples = sum(r["samples"] for r in train)
    res[f"time_to_target_s_{k}"] = time_to_target(rows[d], target, "time_s")
    res[f"wall_to_target_s_{k}"] = time_to_target(rows[d], target, "wall_s")
    res[f"samples_per_s_{k}"] = samples / max(s["time_s"], 1e-9)
    res[f"wall_samples_per_s_{k}"] = samples / max(train[-1]["wall_s"], 1e-9) if train else None
    res[f"idle_fraction_{k}"] = s["idle_fraction"]
    res[f"slot_occupancy_{k}"] = s["slot_occupancy"]
    res[f"best_heldout_accuracy_{k}"] = best[d]
    res[f"final_heldout_accuracy_{k}"] = s["final_heldout_accuracy"]
  if "pipeline" in summaries and "sync" in summaries:
    for key, name in (("wall_to_target_s", "speedup_pipeline_vs_sync"),
                      ("time_to_target_s", "device_time_speedup_pipeline_vs_sync")):
      a, b = res[f"{key}_sync"], res[f"{key}_pipeline"]
      res[name] = (a / b) if a is not None and b else None
    res["throughput_ratio_pipeline_vs_sync"] = (res["samples_per_s_pipeline"] /
                                                max(res["samples_per_s_sync"], 1e-12))
  return res
