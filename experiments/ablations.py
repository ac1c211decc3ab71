"""Paper-ablation reproductions: `--ablation=A1 ... A10` (see rlax_pipe.ablations).

  python experiments/ablations.py --ablation=A1 --out_dir=runs/ablations
  python experiments/ablations.py --ablation=A2 --steps=30 --out_dir=runs/ablations
  python experiments/ablations.py --ablation=A1 --tiny          # seconds

Writes <out_dir>/<ABLATION>.png and prints the result rows as one JSON line. Learning ablations
take every rl_flags flag for their base run.
"""

import json
import pathlib

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

import rl_flags
from rlax_pipe import ablations

_NAME = flags.DEFINE_enum("ablation", "A1", list(ablations.ABLATIONS), "Which ablation.")
_OUT = flags.DEFINE_string("out_dir", "runs/ablations", "Output directory.")
_TINY = flags.DEFINE_bool("tiny", False, "Tiny variant (seconds).")


def main(argv):
  del argv
  pathlib.Path(_OUT.value).mkdir(parents=True, exist_ok=True)
  kw = {} if _NAME.value in ablations.SIMULATED else {"base": rl_flags.run_config_from_flags()}
  rows = ablations.get_ablation(_NAME.value)(_OUT.value, tiny=_TINY.value, **kw)
  print(json.dumps({"ablation": _NAME.value, "rows": rows}))


if __name__ == "__main__":
  app.run(main)
