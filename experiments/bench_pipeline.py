"""sync vs async-batch vs pipeline on the same task, model, devices and seed; one JSON line last.

  python3 experiments/bench_pipeline.py --config.pipeline.num_steps=30 \
      --out_dir=runs/bench_pipeline

The base run is --config (experiments/configs/pipeline_rl.py and overrides); the driver is set
per run. Reproducible mode (default) gives the device
time that separate hardware would take (virtual clock) next to this machine's wall clock.
"""

import json

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

from lib import bench
from lib import config_cli

_OUT = flags.DEFINE_string("out_dir", "runs/bench_pipeline", "Parent of the three run dirs.")
_TARGET = flags.DEFINE_float("target_accuracy", -1.0, "Held-out accuracy to reach, above the "
                             "starting accuracy (refused otherwise); < 0 = the starting accuracy "
                             "+ 90% of the lowest gain over the drivers.")
_DRIVERS = flags.DEFINE_list("drivers", ["sync", "async-batch", "pipeline"], "Drivers to run.")
_CONFIG = config_cli.define_rl_flags()


def main(argv):
  del argv
  config_cli.setup_logging()
  target = None if _TARGET.value < 0 else _TARGET.value
  with config_cli.user_errors():
    hooks = [] if target is None else [bench.TargetCheck(target)]  # refused after step 1
    summaries = bench.run_drivers(config_cli.run_config(_CONFIG.value), tuple(_DRIVERS.value),
                                  _OUT.value, hooks=hooks)
    result = bench.compare(summaries, target)
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
