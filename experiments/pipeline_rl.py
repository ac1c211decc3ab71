"""Pipeline RL main job: sampler and learner on separate meshes, in-flight weight updates.

  python experiments/pipeline_rl.py                     # defaults: arithmetic task, shipped SFT
                                                        # warm start, 8 CPU devices split 4 + 4,
                                                        # pipeline driver, max_lag=4, tis_pg
  python experiments/pipeline_rl.py --driver=sync --run_dir=runs/sync
  python experiments/pipeline_rl.py --resume --run_dir=runs/pipeline_rl
  python experiments/pipeline_rl.py --helpfull          # every flag, with units

Prints the run summary as one JSON object on its last line.
"""

import json

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app

import rl_flags
from rlax_pipe.pipeline import run as run_lib


def main(argv):
  del argv
  print(json.dumps(run_lib.run(rl_flags.run_config_from_flags())))


if __name__ == "__main__":
  app.run(main)
