r"""Issue 26 item 3: the three drivers on truly separate compute (one pinned core per role).

  python3 experiments/pinned_systems_run.py --out_dir=/tmp/pinned          # needs an idle machine
  python3 experiments/pinned_systems_run.py --out_dir=/tmp/pinned --tiny --steps=4  # wiring only

For each driver (sync, async-batch, pipeline) one 2-process job of experiments/pipeline_rl.py
(launch/local_multiprocess.py): process 0 is the learner, pinned to --learner_core, process 1
the sampler replica, pinned to --sampler_core (`os.sched_setaffinity` right after start, before
JAX creates its threads; inherited by every thread), each with one XLA CPU thread
(--xla_cpu_multi_thread_eigen=false, intra_op_parallelism_threads=1) and one CPU device. Each
job times its own operations (run_dir/cost_records.jsonl: the lead's train steps, pushes and
host work, the replica's engine steps shipped to the lead in `multihost.messages.Costs`; the fit
with 95% intervals in run_dir/cost_fit.json). Then, per driver, against the measured wall clock
over the steps after --warmup_steps (throughput = trained samples/s, per-sample staleness = the
lag of each sample's oldest token; `calibration.measured`):
  * the simulator with the run's own fitted cost model (`sim_validation.compare`);
  * the virtual clock: the same configuration as one reproducible process whose clock charges
    that cost model (--virtual; a real run of the same steps, its times virtual);
and the goal: throughput within 10%, per-sample staleness within 0.3 steps.
--cost_model_file replaces the run's own fit (e.g. to test a model fitted elsewhere).
Prints one JSON object; writes <out_dir>/pinned.json and pinned.md (the table). Run it on an
otherwise idle machine: pinning separates the roles from each other, not from other jobs.
For the Pareto figure (issue 26 item 4) from its output:
  python3 experiments/gradient_fidelity.py --from_json=<fidelity.json> --out_dir=<dir> \
      --pareto_pinned=<out_dir>/pinned.json
"""

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

from absl import app
from absl import flags

from lib import sim_validation

_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "launch"))
import local_multiprocess  # pylint: disable=wrong-import-position

_OUT = flags.DEFINE_string("out_dir", "runs/pinned", "Run directories and pinned.json.")
_DRIVERS = flags.DEFINE_list("drivers", ["sync", "async-batch", "pipeline"], "Drivers to run.")
_STEPS = flags.DEFINE_integer("steps", 16, "Learner steps per run.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 3, "Steps excluded from the measured window.")
_LEARNER_CORE = flags.DEFINE_integer("learner_core", 0, "CPU core of the learner process.")
_SAMPLER_CORE = flags.DEFINE_integer("sampler_core", 1, "CPU core of the sampler process.")
_TINY = flags.DEFINE_bool("tiny", False, "The tiny preset (correctness check, not a measure).")
_COST = flags.DEFINE_string("cost_model_file", None, "Cost model for runs without records.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 1800.0, "Wall-clock limit per run (seconds).")
_SEEDS = flags.DEFINE_integer("seeds", 4, "Simulator seeds averaged.")
_VIRTUAL = flags.DEFINE_bool("virtual", True, "Also run each driver on the virtual clock with "
                             "the run's own cost model (one more process per driver).")

ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


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


def run_pinned(driver: str, out: pathlib.Path) -> dict:
  """One 2-process job with each role on its own core; returns its exit codes and wall time."""
  run_dir = out / f"run_{driver}"
  procs = local_multiprocess.launch(
      2, 1, run_args(driver, str(run_dir), _STEPS.value, _TINY.value), devices_per_process=1,
      log_dir=out / f"logs_{driver}", env=pinned_env(os.environ))
  for p, core in zip(procs, (_LEARNER_CORE.value, _SAMPLER_CORE.value)):
    os.sched_setaffinity(p.pid, {core})
  t0 = time.perf_counter()
  codes = local_multiprocess.wait(procs, _TIMEOUT.value)
  return dict(driver=driver, run_dir=str(run_dir), exit_codes=codes,
              wall_s=time.perf_counter() - t0,
              affinity={"learner": _LEARNER_CORE.value, "sampler": _SAMPLER_CORE.value})


def _measured(run_dir: pathlib.Path, span_window: bool) -> dict:
  """`calibration.measured` of a run; the multi-process lead names the replica's lane
  "sampler/<r>", counted as the sampler (one replica here)."""
  from rlax_pipe.sim import calibration  # pylint: disable=import-outside-toplevel
  spans, rows, _ = calibration.read_run(run_dir)
  spans = [dataclasses.replace(sp, component="sampler") if sp.component.startswith("sampler/")
           else sp for sp in spans]
  return calibration.measured(rows, spans, _WARMUP.value, span_window=span_window)


def run_virtual(driver: str, out: pathlib.Path, cost_fit: pathlib.Path) -> dict:
  """The driver's configuration as one reproducible process charging `cost_fit` (the virtual
  clock); returns its numbers over the same steps (`calibration.measured` on virtual time)."""
  run_dir = out / f"virtual_{driver}"
  args = [a for a in run_args(driver, str(run_dir), _STEPS.value, _TINY.value)
          if not a.startswith("--config.pipeline.mode=")]
  args += ["--config.pipeline.mode=reproducible",
           f"--config.pipeline.cost_model_file={cost_fit}"]
  env = pinned_env(os.environ)
  env["XLA_FLAGS"] = env["XLA_FLAGS"].replace(ONE_THREAD, "").strip()  # virtual: any speed
  log = out / f"logs_{driver}" / "virtual.log"
  with open(log, "w") as f:
    code = subprocess.run([sys.executable, str(_ROOT / "experiments" / "pipeline_rl.py"), *args],
                          stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(_ROOT),
                          timeout=_TIMEOUT.value, check=False).returncode
  if code:
    return dict(error=f"virtual run exit code {code}; see {log}")
  return dict(run_dir=str(run_dir), measured=_measured(run_dir, span_window=True))


def compare(res: dict, out: pathlib.Path) -> dict:
  """Measured numbers, the simulator's and the virtual clock's predictions and their errors."""
  from rlax_pipe import costs as costs_lib  # pylint: disable=import-outside-toplevel
  from rlax_pipe.sim import calibration  # pylint: disable=import-outside-toplevel
  run_dir = pathlib.Path(res["run_dir"])
  seeds = tuple(range(_SEEDS.value))
  own = run_dir / calibration.COST_FIT
  if _COST.value:
    model, source, fit_path = costs_lib.load_cost_model(_COST.value), f"given: {_COST.value}", \
        pathlib.Path(_COST.value)
  elif own.exists():
    model, source, fit_path = None, "the run's own timed operations (cost_fit.json)", own
  else:
    return dict(measured=_measured(run_dir, False), cost_model_source=(
        "none: the run wrote no cost_records.jsonl; pass --cost_model_file"))
  out_d = sim_validation.compare(str(run_dir), _WARMUP.value, seeds, model)
  out_d["measured"] = meas = _measured(run_dir, span_window=False)
  out_d["cost_model_source"] = source
  out_d["throughput_rel_err"] = out_d["predicted"]["samples_per_s"] / meas["samples_per_s"] - 1
  out_d["sample_lag_abs_err"] = out_d["predicted"]["sample_lag_mean"] - meas["sample_lag_mean"]
  out_d["compile_excluded"] = {k: v["excluded"] for k, v in json.loads(
      own.read_text())["ops"].items()} if own.exists() else None
  if _VIRTUAL.value:
    virt = run_virtual(res["driver"], out, fit_path)
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


def main(argv):
  del argv
  if len(os.sched_getaffinity(0)) < 2:
    raise app.UsageError("needs 2 CPU cores (learner and sampler each pinned to one).")
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  results = []
  for d in _DRIVERS.value:
    res = run_pinned(d, out)
    if all(c == 0 for c in res["exit_codes"]):
      res.update(compare(res, out))
    else:
      log = (out / f"logs_{d}" / "process_0.log").read_text().splitlines()[-5:]
      res["error"] = "\n".join(log)
    results.append(res)
  report = dict(results=results, steps=_STEPS.value, warmup_steps=_WARMUP.value,
                tiny=_TINY.value, nproc=os.cpu_count(),
                load_average=list(os.getloadavg()),
                goal=dict(throughput_rel=sim_validation.THROUGHPUT_TOL,
                          staleness_steps=sim_validation.STALENESS_TOL))
  (out / "pinned.json").write_text(json.dumps(report, indent=1, default=float))
  (out / "pinned.md").write_text(table(results))
  print(json.dumps(report, default=float))


if __name__ == "__main__":
  app.run(main)
