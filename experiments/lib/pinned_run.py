"""Issue 26 item 3: the drivers as 2-process jobs pinned one core per role, against the models.

`run_all(settings)` runs, per driver, one 2-process job of experiments/pipeline_rl.py (process 0
the learner, process 1 the sampler replica, each pinned to its own core with one XLA CPU thread
and one CPU device), then compares the measured wall clock (steady state after the warm-up steps,
`calibration.measured`) with the simulator charging the run's own fitted cost model
(`sim_validation.compare`; the multi-process job records both roles' timed operations) and with
the virtual clock (the same configuration as one reproducible process charging that model).
Goal: throughput within 10%, per-sample staleness within 0.3 steps (`sim_validation`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

from lib import sim_validation

_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT / "launch"))
import local_multiprocess  # pylint: disable=wrong-import-position

ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


@dataclasses.dataclass(frozen=True)
class Settings:
  """One pinned comparison.

  Attributes:
    out_dir: run directories, logs, pinned.json and pinned.md.
    drivers: drivers to run (each a fresh 2-process job).
    steps: learner steps per run; warmup_steps: steps left out of the measured window.
    learner_core, sampler_core: CPU cores of the two processes.
    tiny: the tiny preset (a wiring check, not a measurement).
    cost_model_file: a cost model to use instead of each run's own fit (None: the run's own).
    timeout_s: wall-clock limit per process (seconds).
    seeds: simulator seeds averaged.
    virtual: also run each driver on the virtual clock.
  """

  out_dir: str
  drivers: tuple[str, ...] = ("sync", "async-batch", "pipeline")
  steps: int = 16
  warmup_steps: int = 3
  learner_core: int = 0
  sampler_core: int = 1
  tiny: bool = False
  cost_model_file: str | None = None
  timeout_s: float = 1800.0
  seeds: int = 4
  virtual: bool = True

  def __post_init__(self):
    if self.steps <= self.warmup_steps:
      raise ValueError(f"steps={self.steps} must exceed warmup_steps={self.warmup_steps} "
                       "(the measured window is the steps after the warm-up).")
    if self.learner_core == self.sampler_core:
      raise ValueError(f"learner_core and sampler_core are both {self.learner_core}: pin the "
                       "roles to different cores (--learner_core=0 --sampler_core=1).")


def pinned_env(base: dict) -> dict:
  """The environment of one pinned role: one XLA CPU thread, CPU platform, our PYTHONPATH."""
  env = dict(base)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {ONE_THREAD}".strip()
  env["PYTHONPATH"] = f"{_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
  env["JAX_PLATFORMS"] = "cpu"
  for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    env[var] = "1"
  return env


def run_args(driver: str, run_dir: str, steps: int, tiny: bool) -> list[str]:
  """experiments/pipeline_rl.py arguments of one driver's run (1-device meshes, threaded)."""
  return ["--config=experiments/configs/pipeline_rl.py" + (":tiny" if tiny else ""),
          f"--config.run_dir={run_dir}", "--config.pipeline.mode=threaded",
          f"--config.pipeline.driver={driver}", f"--config.pipeline.num_steps={steps}",
          f"--config.pipeline.eval_every={10 * steps}", "--config.pipeline.eval_problems=2",
          f"--config.pipeline.checkpoint_every={10 * steps}",
          "--config.learner.mesh_axes=(('fsdp', 1), ('tp', 1))",
          "--config.sampler_mesh_axes=(('tp', 1),)", "--config.export_hf=False"]


def run_pinned(st: Settings, driver: str, out: pathlib.Path) -> dict:
  """One 2-process job with each role on its own core; returns its exit codes and wall time."""
  run_dir = out / f"run_{driver}"
  procs = local_multiprocess.launch(
      2, 1, run_args(driver, str(run_dir), st.steps, st.tiny), devices_per_process=1,
      log_dir=out / f"logs_{driver}", env=pinned_env(os.environ))
  for p, core in zip(procs, (st.learner_core, st.sampler_core)):
    os.sched_setaffinity(p.pid, {core})
  t0 = time.perf_counter()
  codes = local_multiprocess.wait(procs, st.timeout_s)
  return dict(driver=driver, run_dir=str(run_dir), exit_codes=codes,
              wall_s=time.perf_counter() - t0,
              affinity={"learner": st.learner_core, "sampler": st.sampler_core})


def _measured(run_dir: pathlib.Path, warmup_steps: int, span_window: bool) -> dict:
  """`calibration.measured` of a run; the multi-process lead names the replica's lane
  "sampler/<r>", counted as the sampler (one replica here)."""
  from rlax_pipe.sim import calibration  # pylint: disable=import-outside-toplevel
  spans, rows, _ = calibration.read_run(run_dir)
  spans = [dataclasses.replace(sp, component="sampler") if sp.component.startswith("sampler/")
           else sp for sp in spans]
  return calibration.measured(rows, spans, warmup_steps, span_window=span_window)


def virtual_args(st: Settings, driver: str, run_dir: str, cost_fit: str) -> list[str]:
  """`run_args` of the same run on the virtual clock: reproducible mode charging `cost_fit`."""
  return [a for a in run_args(driver, run_dir, st.steps, st.tiny)
          if not a.startswith("--config.pipeline.mode=")] + [
              "--config.pipeline.mode=reproducible", f"--config.pipeline.cost_model_file={cost_fit}"]


def run_virtual(st: Settings, driver: str, out: pathlib.Path, cost_fit: pathlib.Path) -> dict:
  """The driver's configuration as one reproducible process charging `cost_fit` (the virtual
  clock); returns its numbers over the same steps (`calibration.measured` on virtual time)."""
  run_dir = out / f"virtual_{driver}"
  args = virtual_args(st, driver, str(run_dir), str(cost_fit))
  env = pinned_env(os.environ)
  env["XLA_FLAGS"] = env["XLA_FLAGS"].replace(ONE_THREAD, "").strip()  # virtual: any speed
  log = out / f"logs_{driver}" / "virtual.log"
  with open(log, "w") as f:
    code = subprocess.run([sys.executable, str(_ROOT / "experiments" / "pipeline_rl.py"), *args],
                          stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(_ROOT),
                          timeout=st.timeout_s, check=False).returncode
  if code:
    return dict(error=f"virtual run exit code {code}; see {log}")
  return dict(run_dir=str(run_dir),
              measured=_measured(run_dir, st.warmup_steps, span_window=True))


def compare(st: Settings, res: dict, out: pathlib.Path) -> dict:
  """Measured numbers, the simulator's and the virtual clock's predictions and their errors."""
  from rlax_pipe import costs as costs_lib  # pylint: disable=import-outside-toplevel
  from rlax_pipe.sim import calibration  # pylint: disable=import-outside-toplevel
  run_dir = pathlib.Path(res["run_dir"])
  seeds = tuple(range(st.seeds))
  own = run_dir / calibration.COST_FIT
  if st.cost_model_file:
    model, source = costs_lib.load_cost_model(st.cost_model_file), f"given: {st.cost_model_file}"
    fit_path = pathlib.Path(st.cost_model_file)
  elif own.exists():
    model, source, fit_path = None, "the run's own timed operations (cost_fit.json)", own
  else:
    return dict(measured=_measured(run_dir, st.warmup_steps, False), cost_model_source=(
        "none: the run wrote no cost_records.jsonl; pass --cost_model_file"))
  out_d = sim_validation.compare(str(run_dir), st.warmup_steps, seeds, model)
  out_d["measured"] = meas = _measured(run_dir, st.warmup_steps, span_window=False)
  out_d["cost_model_source"] = source
  out_d["throughput_rel_err"] = out_d["predicted"]["samples_per_s"] / meas["samples_per_s"] - 1
  out_d["sample_lag_abs_err"] = out_d["predicted"]["sample_lag_mean"] - meas["sample_lag_mean"]
  out_d["compile_excluded"] = {k: v["excluded"] for k, v in json.loads(
      own.read_text())["ops"].items()} if own.exists() else None
  if st.virtual:
    virt = run_virtual(st, res["driver"], out, fit_path)
    out_d["virtual"] = virt
    if "measured" in virt:
      v = virt["measured"]
      out_d["virtual_throughput_rel_err"] = v["samples_per_s"] / meas["samples_per_s"] - 1
      out_d["virtual_sample_lag_abs_err"] = v["sample_lag_mean"] - meas["sample_lag_mean"]
  errs = [abs(out_d["throughput_rel_err"]) <= sim_validation.THROUGHPUT_TOL,
          abs(out_d["sample_lag_abs_err"]) <= sim_validation.STALENESS_TOL]
  if "virtual_throughput_rel_err" in out_d:
    errs += [abs(out_d["virtual_throughput_rel_err"]) <= sim_validation.THROUGHPUT_TOL,
             abs(out_d["virtual_sample_lag_abs_err"]) <= sim_validation.STALENESS_TOL]
  out_d["pass"] = bool(all(errs))
  return out_d


def table(results: list[dict]) -> str:
  """The comparison as markdown: measured vs simulator vs virtual clock, per driver."""
  lines = ["| driver | measured samples/s | sim | virtual | sim err | virtual err | measured "
           "sample lag | sim | virtual | goal met |", "| --- " * 10 + "|"]
  g = lambda d, *k: functools.reduce(lambda x, y: (x or {}).get(y), k, d)
  fmt = lambda x, spec: "n/a" if x is None else format(x, spec)
  for r in results:
    lines.append(" | ".join([
        f"| {r['driver']}", fmt(g(r, "measured", "samples_per_s"), ".3f"),
        fmt(g(r, "predicted", "samples_per_s"), ".3f"),
        fmt(g(r, "virtual", "measured", "samples_per_s"), ".3f"),
        fmt(r.get("throughput_rel_err"), "+.1%"), fmt(r.get("virtual_throughput_rel_err"), "+.1%"),
        fmt(g(r, "measured", "sample_lag_mean"), ".2f"),
        fmt(g(r, "predicted", "sample_lag_mean"), ".2f"),
        fmt(g(r, "virtual", "measured", "sample_lag_mean"), ".2f"),
        str(r.get("pass", r.get("error", "n/a")))]) + " |")
  return "\n".join(lines) + "\n"


def run_all(st: Settings) -> dict:
  """Every driver's pinned job and comparison; writes out_dir/pinned.json and pinned.md.

  Raises:
    RuntimeError: on a machine with fewer than 2 usable CPU cores.
  """
  if len(os.sched_getaffinity(0)) < 2:
    raise RuntimeError("needs 2 CPU cores (learner and sampler each pinned to one).")
  out = pathlib.Path(st.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  results = []
  for d in st.drivers:
    res = run_pinned(st, d, out)
    if all(c == 0 for c in res["exit_codes"]):
      res.update(compare(st, res, out))
    else:
      log = (out / f"logs_{d}" / "process_0.log").read_text().splitlines()[-5:]
      res["error"] = "\n".join(log)
    results.append(res)
  report = dict(results=results, steps=st.steps, warmup_steps=st.warmup_steps, tiny=st.tiny,
                nproc=os.cpu_count(), load_average=list(os.getloadavg()),
                date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                goal=dict(throughput_rel=sim_validation.THROUGHPUT_TOL,
                          staleness_steps=sim_validation.STALENESS_TOL))
  (out / "pinned.json").write_text(json.dumps(report, indent=1, default=float))
  (out / "pinned.md").write_text(table(results))
  return report
