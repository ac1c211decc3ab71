"""Sweep max_lag x objective; one results table (JSON + table.json) and five plots.

  python3 experiments/sweep_staleness.py --lags=0,1,2,4,8,16,-1 \
      --objectives=tis_pg,no_correction --config.pipeline.num_steps=30 \
      --out_dir=runs/sweep_staleness

-1 = unbounded. Every cell is --config (experiments/configs/pipeline_rl.py and overrides) with
its max_lag and objective (mode reproducible by default).
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

_OUT = flags.DEFINE_string("out_dir", "runs/sweep_staleness", "Parent of the cell run dirs.")
_LAGS = flags.DEFINE_list("lags", ["0", "1", "2", "4", "8", "16", "-1"], "max_lag values; -1 = "
                          "unbounded.")
_OBJS = flags.DEFINE_list("objectives", ["tis_pg", "no_correction"], "Objectives to sweep.")
_CONFIG = config_cli.define_rl_flags()


def main(argv):
  del argv
  config_cli.setup_logging()
  lags = [None if int(x) < 0 else int(x) for x in _LAGS.value]
  with config_cli.user_errors():
    table = sweep.run_sweep(config_cli.run_config(_CONFIG.value), lags, _OBJS.value, _OUT.value)
  plots = sweep.plot_sweep(table, _OUT.value)
  (pathlib.Path(_OUT.value) / "table.json").write_text(json.dumps(table, indent=2))
  print(json.dumps({"table": table, "plots": plots}))


if __name__ == "__main__":
  app.run(main)
