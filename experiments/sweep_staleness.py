r"""Sweep max_lag x objective over seeds; one results table (JSON + table.json) and six plots.

  python3 experiments/sweep_staleness.py --lags=0,1,2,4,8,16,-1 \
      --objectives=tis_pg,no_correction --config.pipeline.num_steps=30 \
      --out_dir=runs/sweep_staleness
  python3 experiments/sweep_staleness.py --lags=0,4,16,64 --seeds=3 \
      --config=experiments/configs/stress.py --out_dir=runs/sweep_stress

-1 = unbounded. Every cell is --config (experiments/configs/pipeline_rl.py and overrides) with
its max_lag and objective (mode reproducible by default), run once per seed 0..N-1; every metric
of the table is the mean over seeds with its 95% t half-width in `<metric>_ci`, and every plot
draws the intervals; pareto.png is throughput (samples per device-second) vs final accuracy.
Runs live in <out_dir>/cells/<config hash>; a finished one is reused when the command is rerun.
"""

import json
import pathlib

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

from lib import config_cli
from lib import sweep
from rlax_pipe.run_dir import to_jsonable

_OUT = flags.DEFINE_string("out_dir", "runs/sweep_staleness", "Parent of the cell run dirs.")
_LAGS = flags.DEFINE_list("lags", ["0", "1", "2", "4", "8", "16", "-1"], "max_lag values; -1 = "
                          "unbounded.")
_OBJS = flags.DEFINE_list("objectives", ["tis_pg", "no_correction"], "Objectives to sweep.")
_SEEDS = flags.DEFINE_integer("seeds", 1, "Seeds per cell (0..N-1); metrics are means with 95% "
                              "t-intervals over them (>= 2 seeds for an interval).", lower_bound=1)
_CONFIG = config_cli.define_rl_flags()


def main(argv):
  del argv
  config_cli.setup_logging()
  lags = [None if int(x) < 0 else int(x) for x in _LAGS.value]
  with config_cli.user_errors():
    table = sweep.run_sweep(config_cli.run_config(_CONFIG.value), lags, _OBJS.value, _OUT.value,
                            seeds=tuple(range(_SEEDS.value)))
  plots = sweep.plot_sweep(table, _OUT.value)
  table = to_jsonable(table, strict=True)  # an interval of one seed is null, not NaN
  (pathlib.Path(_OUT.value) / "table.json").write_text(json.dumps(table, indent=2,
                                                                  allow_nan=False))
  print(json.dumps({"table": table, "plots": plots}, allow_nan=False))


if __name__ == "__main__":
  app.run(main)
