"""The honest driver comparison of `bench_pipeline.py --suite=drivers` (issue #13 point 3).

For each driver (sync, async-batch, pipeline):
  1. measured: a threaded run (sampler and learner threads on their own device sets) in a FRESH
     process, so no driver inherits another's compiled programs. XLA compile time is taken
     from `jax.monitoring` (`compile_s`), and the steady state is the learner-step intervals
     after `warmup_steps` during which nothing compiled. The run times every operation
     (run_dir/cost_records.jsonl).
  2. calibration: one cost model fitted to the timed operations of all measured runs
     (`sim.calibration.calibrate_run`, 95% intervals), stored as out_dir/cost_fit.json.
  3. virtual: a reproducible run whose virtual clock uses that cost model (same config).
  4. simulated: the simulator with that cost model and the measured run's logged lengths.
Numbers compared over the same steps: trained samples/s, per-sample staleness (lag of each
sample's oldest token) and per-token staleness, slot occupancy. Then a prediction off this
machine: the analytic accelerator cost model for a named model and chip on a long-tailed
workload stated beside the founding talk's (`accelerator_prediction`).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import pathlib
import time
from typing import Any, Sequence

import numpy as np

from rlax_pipe import costs as costs_lib
from rlax_pipe import timeline as timeline_lib
from rlax_pipe.pipeline import driver as driver_lib
from rlax_pipe.pipeline import rules
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.sim import calibration, distributions
from rlax_pipe.sim import simulator as sim_lib
from rlax_pipe.sim import whatif

MEASURED = "measured.json"


class StepClock:
  """Step hook: wall time (the driver's clock) and compile events count at every step end."""

  def __init__(self, compiles: driver_lib.CompileCounter):
    self._compiles = compiles
    self.rows: list[dict] = []

  def on_step(self, job, result, time_s) -> None:
    v = result.trained_at
    lags = [rules.sample_lag(r.policy_versions, v) for r in result.rollouts
            if r.policy_versions.size and not np.isnan(r.reward)]
    now = time_s if job.reproducible else job.timeline.now()  # virtual t_l / perf_counter
    self.rows.append({"now": now, "time_s": time_s,
                      "compiles": self._compiles.count, "samples": len(result.rollouts),
                      "tokens": result.completion_tokens,
                      "lag_hist": np.asarray(result.metrics["lag_hist"]).tolist(),
                      "sample_lags": lags})

  def on_end(self, job, time_s) -> None:
    del job, time_s


def _slot_sums(spans, lo: float, hi: float) -> tuple[float, float]:
  num = den = 0.0
  for s in spans:
    if s.component == "sampler" and s.kind == "decode" and s.slots_total is not None:
      dt = min(s.end, hi) - max(s.start, lo)
      if dt > 0:
        num += s.slots_active * dt
        den += s.slots_total * dt
  return num, den


def steady_state(rows: Sequence[dict], spans, warmup_steps: int, start: float) -> dict:
  """Numbers over the learner-step intervals after `warmup_steps` in which nothing compiled.

  Args:
    rows: `StepClock.rows` (interval i runs from step i-1's end, or `start`, to step i's end).
    spans: the run's timeline spans (same clock as rows' "now").
    warmup_steps: first steps left out.
    start: the driver's clock when the run started.

  Returns:
    samples_per_s, tokens_per_s, sample_lag_mean, token_lag_mean, slot_occupancy, steps_used,
    window_s (seconds of the intervals used), compile_intervals (intervals left out).
  """
  used, dropped, prev_c = [], 0, 0
  for i, r in enumerate(rows):
    t0 = rows[i - 1]["now"] if i else start
    if i >= warmup_steps:
      if r["compiles"] == prev_c:
        used.append((t0, r["now"], r))
      else:
        dropped += 1
    prev_c = r["compiles"]
  if not used:
    raise ValueError(f"steady_state: no compile-free learner step after {warmup_steps} warm-up "
                     f"steps among {len(rows)}; run more steps.")
  secs = sum(b - a for a, b, _ in used)
  hist = np.zeros(max(len(r["lag_hist"]) for _, _, r in used), np.int64)
  for _, _, r in used:
    hist[:len(r["lag_hist"])] += r["lag_hist"]
  sample_lags = [x for _, _, r in used for x in r["sample_lags"]]
  num = den = 0.0
  for a, b, _ in used:
    n, d = _slot_sums(spans, a, b)
    num, den = num + n, den + d
  return {"samples_per_s": sum(r["samples"] for _, _, r in used) / secs,
          "tokens_per_s": sum(r["tokens"] for _, _, r in used) / secs,
          "sample_lag_mean": float(np.mean(sample_lags)) if sample_lags else 0.0,
          "token_lag_mean": float((hist * np.arange(hist.size)).sum() / max(hist.sum(), 1)),
          "slot_occupancy": num / den if den else 0.0, "steps_used": len(used),
          "window_s": secs, "compile_intervals": dropped}


def _measure(cfg: run_lib.RunConfig, warmup_steps: int) -> dict:
  """Runs `cfg` in this process with compile events counted; writes and returns run_dir/
  measured.json."""
  with driver_lib.CompileCounter() as compiles:
    clock = StepClock(compiles)
    t_start = time.perf_counter()
    summary = run_lib.run(cfg, hooks=[clock])
  spans = timeline_lib.Timeline.from_jsonl(
      str(pathlib.Path(cfg.run_dir) / "timeline.jsonl")).spans()
  start = t_start if cfg.pipeline.mode == "threaded" else 0.0
  out = {"driver": cfg.pipeline.driver, "mode": cfg.pipeline.mode, "run_dir": cfg.run_dir,
         "compile_s": compiles.seconds, "wall_s": summary["wall_s"],
         "final_heldout_accuracy": summary["final_heldout_accuracy"],
         "steady": steady_state(clock.rows, spans, warmup_steps, start)}
  (pathlib.Path(cfg.run_dir) / MEASURED).write_text(json.dumps(out, indent=2))
  return out


def _child(cfg: run_lib.RunConfig, warmup_steps: int) -> None:
  _measure(cfg, warmup_steps)


def measure_fresh(cfg: run_lib.RunConfig, warmup_steps: int, timeout_s: float = 3600) -> dict:
  """`_measure` in a fresh process (spawned: nothing compiled, nothing cached).

  Raises:
    RuntimeError: if the child fails (its exit code; the child's traceback is on stderr).
  """
  ctx = multiprocessing.get_context("spawn")
  p = ctx.Process(target=_child, args=(cfg, warmup_steps))
  p.start()
  p.join(timeout_s)
  if p.is_alive():
    p.terminate()
    raise RuntimeError(f"measured run {cfg.run_dir} did not finish within {timeout_s} s.")
  if p.exitcode:
    raise RuntimeError(f"measured run {cfg.run_dir} failed (exit code {p.exitcode}).")
  return json.loads((pathlib.Path(cfg.run_dir) / MEASURED).read_text())


def driver_config(base: run_lib.RunConfig, driver: str, mode: str, run_dir: str,
                  cost_model_file: str | None = None) -> run_lib.RunConfig:
  """`base` for one driver and mode: its own run dir, evaluation and checkpoints only at the
  ends (their host time stays out of the measured steps)."""
  n = base.pipeline.num_steps
  pipe = dataclasses.replace(base.pipeline, driver=driver, mode=mode, eval_every=10 * n,
                             checkpoint_every=10 * n, cost_model_file=cost_model_file)
  return dataclasses.replace(base, run_dir=run_dir, resume=False, pipeline=pipe)


def simulate_run(measured_dir: str, cost_model: costs_lib.CostModel, warmup_steps: int,
                 seeds: Sequence[int], push_bytes: int) -> dict:
  """The simulator's prediction for a measured run: its config, the given costs, its logged
  completion and prompt lengths (resampled by group), averaged over `seeds`."""
  _, rows, config = calibration.read_run(measured_dir)
  g = int(config["pipeline"]["group_size"])
  lengths, _ = calibration.lengths_from_rows(rows, group_size=g)
  prompts, _ = calibration.lengths_from_rows(rows, group_size=g, key="prompt_lengths")
  res = [sim_lib.simulate(calibration.sim_config_for_run(
      config, cost_model, lengths, prompts, warmup_steps=warmup_steps, seed=s,
      push_bytes=push_bytes)) for s in seeds]
  return {k: float(np.mean([getattr(r, k) for r in res]))
          for k in ("samples_per_s", "tokens_per_s", "sample_lag_mean", "token_lag_mean",
                    "slot_occupancy", "idle_sampler", "idle_learner")}


def _push_bytes(records_path: pathlib.Path) -> int:
  recs = [r for r in costs_lib.read_records(records_path) if r.op == "push"]
  return int(recs[0].features.get("bytes", 0)) if recs else 0


def _errors(res: dict, k: str, m: dict, v: dict, sim: dict, suffix: str) -> None:
  res[f"virtual_vs_measured_throughput_error{suffix}_{k}"] = (v["samples_per_s"]
                                                              / m["samples_per_s"] - 1)
  res[f"sim_vs_measured_throughput_error{suffix}_{k}"] = (sim["samples_per_s"]
                                                          / m["samples_per_s"] - 1)
  res[f"virtual_vs_measured_staleness_error_steps{suffix}_{k}"] = (v["sample_lag_mean"]
                                                                   - m["sample_lag_mean"])
  res[f"sim_vs_measured_staleness_error_steps{suffix}_{k}"] = (sim["sample_lag_mean"]
                                                               - m["sample_lag_mean"])


def compare_drivers(base: run_lib.RunConfig, drivers: Sequence[str], out_dir: str,
                    warmup_steps: int = 3, seeds: Sequence[int] = (0, 1, 2, 3),
                    fresh_process: bool = True) -> dict:
  """Steps 1-4 of the module docstring; returns the flat JSON-ready comparison.

  Two calibrations are compared with each measured run: the cost model fitted to that run's own
  timed operations (stored with it, run_dir/cost_fit.json; on a machine whose "separate device
  sets" share CPU cores, it carries the contention that driver's overlap of sampler and learner
  caused) and one model fitted to all runs pooled (out_dir/cost_fit.json, the machine's average:
  the gap between the two is contention, which separate accelerators would not have).

  Keys per driver d (dashes as underscores): compile_s_<d>, compile_free_steps_<d>,
  {measured, virtual, sim}_{samples_per_s, sample_lag_mean, token_lag_mean, slot_occupancy}_<d>
  (virtual and sim with the run's own fit; `_pooled` variants with the pooled one),
  virtual_vs_measured_throughput_error_<d>, sim_vs_measured_throughput_error_<d> (relative),
  virtual_/sim_vs_measured_staleness_error_steps_<d> (per-sample staleness, steps), each also
  with `_pooled`; the largest absolute errors over drivers under the names without the driver
  suffix; wall_throughput_ratio_pipeline_vs_sync (measured steady-state samples/s).
  """
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  res: dict[str, Any] = {"drivers": list(drivers), "warmup_steps": warmup_steps,
                         "steps": base.pipeline.num_steps}
  measured = {}
  for d in drivers:
    cfg = driver_config(base, d, "threaded", str(out / f"measured_{d}"))
    measured[d] = measure_fresh(cfg, warmup_steps) if fresh_process else _measure(
        cfg, warmup_steps)
  pooled = calibration.calibrate_run([m["run_dir"] for m in measured.values()],
                                     source=f"measured: threaded bench runs in {out} (pooled)")
  pooled_path = out / calibration.COST_FIT
  pooled.save(pooled_path)
  res["cost_model_pooled"] = pooled.cost_model.to_dict()
  res["cost_fit_path"] = str(pooled_path)
  push = _push_bytes(pathlib.Path(measured[drivers[0]]["run_dir"]) / calibration.COST_RECORDS)
  for d in drivers:
    k = d.replace("-", "_")
    run_dir = pathlib.Path(measured[d]["run_dir"])
    own_path = run_dir / calibration.COST_FIT
    own = costs_lib.load_cost_model(own_path)
    m = measured[d]["steady"]
    res[f"compile_s_{k}"] = measured[d]["compile_s"]
    res[f"compile_free_steps_{k}"] = m["steps_used"]
    res[f"final_heldout_accuracy_{k}"] = measured[d]["final_heldout_accuracy"]
    res[f"cost_model_{k}"] = own.to_dict()
    for suffix, model, path in (("", own, own_path), ("_pooled", pooled.cost_model,
                                                       pooled_path)):
      v = _measure(driver_config(base, d, "reproducible", str(out / f"virtual{suffix}_{d}"),
                                 str(path)), warmup_steps)["steady"]
      sim = simulate_run(str(run_dir), model, warmup_steps, seeds, push)
      for name, src in (("virtual", v), ("sim", sim)):
        for key in ("samples_per_s", "sample_lag_mean", "token_lag_mean", "slot_occupancy"):
          res[f"{name}_{key}{suffix}_{k}"] = src[key]
      _errors(res, k, m, v, sim, suffix)
    for key in ("samples_per_s", "sample_lag_mean", "token_lag_mean", "slot_occupancy"):
      res[f"measured_{key}_{k}"] = m[key]
  for suffix in ("", "_pooled"):
    for name in ("virtual_vs_measured_throughput_error", "sim_vs_measured_throughput_error",
                 "virtual_vs_measured_staleness_error_steps",
                 "sim_vs_measured_staleness_error_steps"):
      res[name + suffix] = max((res[f"{name}{suffix}_{d.replace('-', '_')}"] for d in drivers),
                               key=abs)
  if "pipeline" in drivers and "sync" in drivers:
    res["wall_throughput_ratio_pipeline_vs_sync"] = (res["measured_samples_per_s_pipeline"]
                                                     / res["measured_samples_per_s_sync"])
    res["virtual_throughput_ratio_pipeline_vs_sync"] = (res["virtual_samples_per_s_pipeline"]
                                                        / res["virtual_samples_per_s_sync"])
  return res


# ---------------------------------------------------------------------------------------------
# Off this machine: the analytic accelerator model.


def talk_workload(groups_per_step: int = 32, group_size: int = 16) -> whatif.Workload:
  """A long-tailed workload shaped like the founding talk's ("99% of samples finish in ~40 s,
  the last 1% take ~80 s more"): 512-token prompts; 99% of completions log-normal with mean
  1500 tokens, log-std 0.6, capped at 3300; 1% stragglers uniform in 3300..24000 tokens. The
  seconds this gives on a cluster are reported beside it (`sync_round_t99_s`,
  `sync_round_t100_s` of the simulated sync driver)."""
  body = distributions.LogNormal(1500.0, 0.6, 3300)
  return whatif.Workload(groups_per_step=groups_per_step, group_size=group_size,
                         prompt_tokens=512, max_completion_tokens=24000,
                         length_dist=distributions.BodyTail(body, 0.01, 3300, 24000))


def accelerator_prediction(chip: str = "H200", num_devices: int = 8, max_lag: int = 4,
                           num_steps: int = 20, warmup_steps: int = 5,
                           workload: whatif.Workload | None = None) -> dict:
  """Predicted pipeline / sync throughput for Llama-3-8B on `num_devices` chips at its best
  split for each driver, pipeline and async-batch at `max_lag` (policy learner-wait; sync is
  lag 0), on `talk_workload`. Every number is a prediction of the analytic model."""
  c = whatif.Cluster(num_devices=num_devices, chip=chip, workload=workload or talk_workload(),
                     max_slots=256)
  lo = whatif.min_learner_devices(c)
  splits = list(range(lo, num_devices))
  settings = [("sync", 0, "block"), ("async-batch", max_lag, "learner-wait"),
              ("pipeline", max_lag, "learner-wait")]
  rows = whatif.sweep(c, settings, splits, num_steps, warmup_steps)
  best = {r["driver"]: r for r in whatif.best_splits(rows)}
  out = {"accelerator_model": f"Llama-3-8B on {num_devices} x {chip} (analytic cost model)",
         "accelerator_workload": ("512-token prompts; completions: 99% log-normal mean 1500 "
                                  "log-std 0.6 capped 3300, 1% uniform 3300..24000 tokens"),
         "accelerator_max_lag": max_lag, "accelerator_engine_slots": whatif.engine_slots(c),
         "accelerator_cost_model": whatif.costs(c, best["pipeline"]["learner_devices"]).to_dict(),
         "predicted_accelerator_speedup_pipeline_vs_sync": (
             best["pipeline"]["tokens_per_s"] / best["sync"]["tokens_per_s"]),
         "predicted_accelerator_speedup_pipeline_vs_async_batch": (
             best["pipeline"]["tokens_per_s"] / best["async-batch"]["tokens_per_s"]),
         "sync_round_t99_s": best["sync"]["sync_t99_s"],
         "sync_round_t100_s": best["sync"]["sync_t100_s"]}
  for d, r in best.items():
    k = d.replace("-", "_")
    out[f"predicted_accelerator_{k}"] = {key: r[key] for key in (
        "learner_devices", "sampler_devices", "tokens_per_s", "samples_per_s", "sample_lag_mean",
        "token_lag_mean", "idle_learner", "slot_idle", "device_idle")}
  return out
