"""Paper-ablation reproductions: `--ablation=A1 ... A10` (see rlax_pipe.ablations).

  python3 experiments/ablations.py --ablation=A1 --out_dir=runs/ablations
  python3 experiments/ablations.py --ablation=A2 --config.pipeline.num_steps=30
  python3 experiments/ablations.py --ablation=A1 --tiny          # seconds
  python3 experiments/ablations.py --ablation=A10 --tiny         # seconds per cell

Writes <out_dir>/<ABLATION>.png and prints the result rows as one JSON line. Learning ablations
take their base run from --config (experiments/configs/pipeline_rl.py and overrides); with
--tiny its default is the `tiny` preset (a few learner steps of a few samples per cell), so a
tiny learning ablation takes seconds per cell, not a full 30-step run.
"""

import json
import pathlib
import sys

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

from lib import ablations
from lib import config_cli

_NAME = flags.DEFINE_enum("ablation", "A1", list(ablations.ABLATIONS), "Which ablation.")
_OUT = flags.DEFINE_string("out_dir", "runs/ablations", "Output directory.")
_TINY = flags.DEFINE_bool("tiny", False, "Tiny variant (seconds).")
# The base run's default preset follows --tiny (read before flags are parsed: it is the default
# of --config); an explicit --config=<file>:<preset> still wins.
_TINY_ARGV = any(a in ("--tiny", "--tiny=true", "--tiny=True") for a in sys.argv[1:])
_CONFIG = config_cli.define_rl_flags(preset="tiny" if _TINY_ARGV else "default")


def main(argv):
  del argv
  config_cli.setup_logging()
  pathlib.Path(_OUT.value).mkdir(parents=True, exist_ok=True)
  with config_cli.user_errors():
    kw = {} if _NAME.value in ablations.SIMULATED else {
        "base": config_cli.run_config(_CONFIG.value)}
    rows = ablations.get_ablation(_NAME.value)(_OUT.value, tiny=_TINY.value, **kw)
  print(json.dumps({"ablation": _NAME.value, "rows": rows}))


if __name__ == "__main__":
  app.run(main)
