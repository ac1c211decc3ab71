"""sync vs async-batch vs pipeline, measured honestly; one JSON line last.

  python3 experiments/bench_pipeline.py --config.pipeline.num_steps=24 --out_dir=runs/bench
  python3 experiments/bench_pipeline.py --suite=control_plane          # host costs at 10k groups
  python3 experiments/bench_pipeline.py --suite=accuracy --target_accuracy=0.6

--suite=drivers (default, experiments/lib/bench_drivers.py): each driver's threaded run in a
fresh process (compile_s apart, steady state = compile-free steps after
--steady_warmup_steps), one cost model fitted to their timed operations
(out_dir/cost_fit.json), the virtual clock and the simulator with that model against the
measurements, and the accelerator prediction.
--suite=accuracy: the reproducible runs' time to a target held-out accuracy (virtual clock).
"""

import json

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

from lib import bench
from lib import bench_drivers
from lib import config_cli
from lib import control_plane

_SUITE = flags.DEFINE_enum("suite", "drivers", ["drivers", "control_plane", "accuracy"],
                           "What to measure (module docstring).")
_OUT = flags.DEFINE_string("out_dir", "runs/bench_pipeline", "Parent of the run dirs.")
_TARGET = flags.DEFINE_float("target_accuracy", -1.0, "--suite=accuracy: held-out accuracy to "
                             "reach, above the starting accuracy (refused otherwise); < 0 = the "
                             "starting accuracy + 90% of the lowest gain over the drivers.")
_DRIVERS = flags.DEFINE_list("drivers", ["sync", "async-batch", "pipeline"], "Drivers to run.")
_WARMUP = flags.DEFINE_integer("steady_warmup_steps", 3, "Learner steps left out of the "
                              "steady state.")
_SEEDS = flags.DEFINE_integer("sim_seeds", 4, "Simulator length seeds averaged.")
_LIVE = flags.DEFINE_integer("live_groups", 10_000, "--suite=control_plane: live groups.")
_CONFIG = config_cli.define_rl_flags()


def main(argv):
  del argv
  config_cli.setup_logging()
  if _SUITE.value == "control_plane":
    print(json.dumps(control_plane.control_plane(live_groups=_LIVE.value)))
    return
  drivers = tuple(_DRIVERS.value)
  with config_cli.user_errors():
    base = config_cli.run_config(_CONFIG.value)
    if _SUITE.value == "accuracy":
      target = None if _TARGET.value < 0 else _TARGET.value
      hooks = [] if target is None else [bench.TargetCheck(target)]  # refused after step 1
      summaries = bench.run_drivers(base, drivers, _OUT.value, hooks=hooks)
      print(json.dumps(bench.compare(summaries, target)))
      return
    out = bench_drivers.compare_drivers(base, drivers, _OUT.value, _WARMUP.value,
                                        tuple(range(_SEEDS.value)))
  out.update(bench_drivers.accelerator_prediction())
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
