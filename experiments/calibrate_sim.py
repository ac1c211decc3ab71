"""Calibrates the systems simulator from a run, or validates it against fresh real runs.

  python experiments/calibrate_sim.py --run_dir=runs/pipeline_rl        # fit + compare one run
  python experiments/calibrate_sim.py --validate                        # 5 real tiny runs vs sim
  python experiments/calibrate_sim.py --validate --work_dir=/tmp/val --reuse_runs

Prints one JSON line: the comparison row (--run_dir) or the validation table (--validate).
"""

import json

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

from lib import sim_validation as validation

_RUN_DIR = flags.DEFINE_string("run_dir", None, "Run directory to calibrate from and compare.")
_VALIDATE = flags.DEFINE_bool("validate", False, "Run the validation cases (real pipelines).")
_WORK = flags.DEFINE_string("work_dir", None, "--validate: where the run directories go.")
_INIT = flags.DEFINE_string("init", None, "--validate: initial policy (default: shipped SFT "
                            "warm start if present, else a tiny random model).")
_REUSE = flags.DEFINE_bool("reuse_runs", False, "--validate: reuse the runs in --work_dir.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 5, "--run_dir: steps excluded from the window.")
_SEEDS = flags.DEFINE_integer("seeds", 8, "Simulator seeds averaged per prediction.")


def main(argv):
  del argv
  seeds = tuple(range(_SEEDS.value))
  if _VALIDATE.value:
    out = validation.validate(init=_INIT.value, work_dir=_WORK.value, seeds=seeds,
                              reuse_runs=_REUSE.value)
  elif _RUN_DIR.value:
    out = validation.compare(_RUN_DIR.value, _WARMUP.value,
                             validation.read_recorded(_RUN_DIR.value), seeds)
  else:
    raise app.UsageError("pass --run_dir=... or --validate")
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
