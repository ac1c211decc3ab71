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

import json

from absl import app
from absl import flags

from lib import pinned_run

_OUT = flags.DEFINE_string("out_dir", "runs/pinned", "Run directories and pinned.json.")
_DRIVERS = flags.DEFINE_list("drivers", ["sync", "async-batch", "pipeline"], "Drivers to run.")
_STEPS = flags.DEFINE_integer("steps", 16, "Learner steps per run.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 3, "Steps excluded from the measured window.")
_LEARNER_CORE = flags.DEFINE_integer("learner_core", 0, "CPU core of the learner process.")
_SAMPLER_CORE = flags.DEFINE_integer("sampler_core", 1, "CPU core of the sampler process.")
_TINY = flags.DEFINE_bool("tiny", False, "The tiny preset (wiring check, not a measure).")
_COST = flags.DEFINE_string("cost_model_file", None, "A cost model instead of the run's own.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 1800.0, "Wall-clock limit per run (seconds).")
_SEEDS = flags.DEFINE_integer("seeds", 4, "Simulator seeds averaged.")
_VIRTUAL = flags.DEFINE_bool("virtual", True, "Also run each driver on the virtual clock with "
                             "the run's own cost model (one more process per driver).")


def main(argv):
  del argv
  try:
    report = pinned_run.run_all(pinned_run.Settings(
        out_dir=_OUT.value, drivers=tuple(_DRIVERS.value), steps=_STEPS.value,
        warmup_steps=_WARMUP.value, learner_core=_LEARNER_CORE.value,
        sampler_core=_SAMPLER_CORE.value, tiny=_TINY.value, cost_model_file=_COST.value,
        timeout_s=_TIMEOUT.value, seeds=_SEEDS.value, virtual=_VIRTUAL.value))
  except (RuntimeError, ValueError) as e:
    raise app.UsageError(str(e)) from e
  print(json.dumps(report, default=float))


if __name__ == "__main__":
  app.run(main)
