"""Paper-ablation reproductions: `--ablation=A1 ... A14` (see rlax_pipe.ablations).

  python3 experiments/ablations.py --ablation=A1 --out_dir=runs/ablations
  python3 experiments/ablations.py --ablation=A2 --config.pipeline.num_steps=30
  python3 experiments/ablations.py --ablation=A1 --tiny          # seconds
  python3 experiments/ablations.py --ablation=A10 --tiny         # seconds per cell
  python3 experiments/ablations.py --ablation=A11 --config=experiments/configs/stress.py --seeds=3

Writes <out_dir>/<ABLATION>.png (learning ablations: means with 95% intervals over --seeds),
<out_dir>/<ABLATION>.json (the rows; the claims A11-A14 also their verdicts), <ABLATION>.md (the
same as a Markdown table with "mean +- 95% half-width" per metric) and prints the rows
as one JSON line. Runs live in <out_dir>/cells/<config hash>; a finished one is reused. Learning ablations
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
from lib import claims
from lib import config_cli
from rlax_pipe import config_dict
from rlax_pipe.run_dir import to_jsonable

_NAME = flags.DEFINE_enum("ablation", "A1", list(ablations.ABLATIONS), "Which ablation.")
_OUT = flags.DEFINE_string("out_dir", "runs/ablations", "Output directory.")
_TINY = flags.DEFINE_bool("tiny", False, "Tiny variant (seconds).")
_SEEDS = flags.DEFINE_integer("seeds", 1, "Seeds per cell of a learning ablation (0..N-1); every "
                              "metric is the mean over seeds with a 95% t-interval (>= 2 seeds "
                              "for an interval).", lower_bound=1)
# The base run's default preset follows --tiny (read before flags are parsed: it is the default
# of --config); an explicit --config=<file>:<preset> still wins.
_TINY_ARGV = any(a in ("--tiny", "--tiny=true", "--tiny=True") for a in sys.argv[1:])
_CELLS = flags.DEFINE_list("cells", [], "Claims A11-A14 only: labels of the cells to run (default "
                           "all), e.g. more --seeds for one comparison.")
_CONFIG = config_cli.define_rl_flags(preset="tiny" if _TINY_ARGV else "default")


def main(argv):
  del argv
  config_cli.setup_logging()
  pathlib.Path(_OUT.value).mkdir(parents=True, exist_ok=True)
  with config_cli.user_errors():
    kw = {} if _NAME.value in ablations.SIMULATED else {
        "base": config_cli.run_config(_CONFIG.value), "seeds": tuple(range(_SEEDS.value))}
    if _CELLS.value:
      if _NAME.value not in claims.CLAIMS:
        raise config_dict.ConfigError(f"--cells is for the claims {claims.CLAIMS}, not "
                                      f"--ablation={_NAME.value}.")
      kw["only"] = tuple(_CELLS.value)
    rows = ablations.get_ablation(_NAME.value)(_OUT.value, tiny=_TINY.value, **kw)
  out = to_jsonable({"ablation": _NAME.value, "rows": rows}, strict=True)  # null, not NaN
  stem = _NAME.value + (f"_{len(_CELLS.value)}cells_{_SEEDS.value}seeds" if _CELLS.value else "")
  (pathlib.Path(_OUT.value) / f"{stem}.json").write_text(json.dumps(out, indent=1, allow_nan=False))
  if _NAME.value not in ablations.SIMULATED:
    (pathlib.Path(_OUT.value) / f"{stem}.md").write_text(claims.markdown(rows))
  print(json.dumps(out, allow_nan=False))


if __name__ == "__main__":
  app.run(main)
