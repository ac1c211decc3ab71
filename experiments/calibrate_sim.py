"""Validates the simulator (and the virtual clock) against measured runs.

  python experiments/calibrate_sim.py --run_dir=runs/x   # a threaded run: fit + simulate + compare
  python experiments/calibrate_sim.py --validate --work_dir=/tmp/val --steps=16

--run_dir: the cost model fitted to the run's own timed operations (cost_records.jsonl), the
simulator with its logged lengths, against the run (experiments/lib/sim_validation.py).
--validate: the three drivers measured in fresh processes, one fitted cost model, the virtual
clock and the simulator against them (bench_pipeline's driver suite on a small config).
Prints one JSON line.
"""

import json

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

from lib import sim_validation as validation

_RUN_DIR = flags.DEFINE_string("run_dir", None, "A threaded run directory to compare.")
_VALIDATE = flags.DEFINE_bool("validate", False, "Measure the three drivers and compare.")
_WORK = flags.DEFINE_string("work_dir", None, "--validate: where the run directories go.")
_INIT = flags.DEFINE_string("init", None, "--validate: initial policy (default: shipped SFT "
                            "warm start if present, else a tiny random model).")
_STEPS = flags.DEFINE_integer("steps", 16, "--validate: learner steps per run.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 3, "Steps excluded from the window.")
_SEEDS = flags.DEFINE_integer("seeds", 4, "Simulator seeds averaged per prediction.")


def main(argv):
  del argv
  seeds = tuple(range(_SEEDS.value))
  if _VALIDATE.value:
    out = validation.validate(init=_INIT.value, work_dir=_WORK.value, seeds=seeds,
                              steps=_STEPS.value, warmup_steps=_WARMUP.value)
  elif _RUN_DIR.value:
    out = validation.compare(_RUN_DIR.value, _WARMUP.value, seeds)
  else:
    raise app.UsageError("pass --run_dir=... or --validate")
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
