"""sync vs async-batch vs pipeline on the same task, model, devices and seed; one JSON line last.

  python experiments/bench_pipeline.py --steps=30 --out_dir=runs/bench_pipeline

All rl_flags apply (driver is overridden per run). Reproducible mode (default) gives the device
time that separate hardware would take (virtual clock) next to this machine's wall clock.
"""

import json

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

import rl_flags  # pylint: disable=unused-import
from rlax_pipe.pipeline import bench

_OUT = flags.DEFINE_string("out_dir", "runs/bench_pipeline", "Parent of the three run dirs.")
_TARGET = flags.DEFINE_float("target_accuracy", -1.0, "Held-out accuracy to reach; < 0 = 90% "
                             "of the lowest best accuracy over the drivers.")
_DRIVERS = flags.DEFINE_list("drivers", ["sync", "async-batch", "pipeline"], "Drivers to run.")


def main(argv):
  del argv
  summaries = bench.run_drivers(rl_flags.run_config_from_flags(), tuple(_DRIVERS.value),
                                _OUT.value)
  target = None if _TARGET.value < 0 else _TARGET.value
  print(json.dumps(bench.compare(summaries, target)))


if __name__ == "__main__":
  app.run(main)
