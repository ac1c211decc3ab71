r"""Issue 26 item 3: the three drivers on truly separate compute (one pinned core per role).

  python3 experiments/pinned_systems_run.py --out_dir=/tmp/pinned          # needs an idle machine
  python3 experiments/pinned_systems_run.py --out_dir=/tmp/pinned --tiny --steps=4  # correctness

For each driver (sync, async-batch, pipeline) one 2-process job of experiments/pipeline_rl.py
(launch/local_multiprocess.py): process 0 is the learner, pinned to --learner_core, process 1
the sampler replica, pinned to --sampler_core (`os.sched_setaffinity` right after start, before
JAX creates its threads; inherited by every thread), each with one XLA CPU thread
(--xla_cpu_multi_thread_eigen=false, intra_op_parallelism_threads=1) and one CPU device. Then,
per run, the measured steady-state throughput and per-sample staleness (`calibration.measured`),
and, when a cost model is available, the simulator's prediction and its errors against the goal
(throughput within 10%, per-sample staleness within 0.3 steps; `sim_validation.compare`):
  * the run's own timed operations (cost_records.jsonl) when the run wrote them;
  * else --cost_model_file (e.g. a fit from pinned single-role benches), labelled as such;
  * else "no cost model": the multi-process mode records no cost_records.jsonl at this commit
    (only the single-process threaded job has a CostRecorder), which the output says.
Prints one JSON object; writes it to <out_dir>/pinned.json. Run it on an otherwise idle machine:
pinning only separates the roles from each other, not from other jobs.
"""

import dataclasses
import json
import os
import pathlib
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


def compare(res: dict) -> dict:
  """Measured numbers and, with a cost model, the simulator's prediction and errors."""
  from rlax_pipe import costs as costs_lib  # pylint: disable=import-outside-toplevel
  from rlax_pipe.sim import calibration  # pylint: disable=import-outside-toplevel
  run_dir = pathlib.Path(res["run_dir"])
  spans, rows, _ = calibration.read_run(run_dir)
  # The multi-process lead names the replica's spans "sampler/<r>"; one replica = "sampler".
  spans = [dataclasses.replace(sp, component="sampler") if sp.component.startswith("sampler/")
           else sp for sp in spans]
  out = dict(measured=calibration.measured(rows, spans, _WARMUP.value, span_window=False))
  seeds = tuple(range(_SEEDS.value))
  if (run_dir / calibration.COST_RECORDS).exists():
    out.update(sim_validation.compare(str(run_dir), _WARMUP.value, seeds),
               cost_model_source="the run's own timed operations")
  elif _COST.value:
    out.update(sim_validation.compare(str(run_dir), _WARMUP.value, seeds,
                                      costs_lib.load_cost_model(_COST.value)),
               cost_model_source=f"given: {_COST.value}")
  else:
    out["cost_model_source"] = ("none: this run wrote no cost_records.jsonl (the multi-process "
                                "job records no timed operations at this commit); pass "
                                "--cost_model_file to compare with the simulator")
  return out


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
      res.update(compare(res))
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
  print(json.dumps(report, default=float))


if __name__ == "__main__":
  app.run(main)
