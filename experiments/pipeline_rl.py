r"""Pipeline RL main job: sampler and learner on separate meshes, in-flight weight updates.

  python3 experiments/pipeline_rl.py        # the default run: arithmetic task, shipped SFT
                                            # warm start, 8 CPU devices split 4 + 4, pipeline
                                            # driver, max_lag=4, tis_pg
  python3 experiments/pipeline_rl.py --config=experiments/configs/pipeline_rl.py:tiny
  python3 experiments/pipeline_rl.py --config.pipeline.driver=sync --config.run_dir=runs/sync
  python3 experiments/pipeline_rl.py --config.resume --config.run_dir=runs/pipeline_rl
  python3 experiments/pipeline_rl.py --config.resume --config.run_dir=runs/pipeline_rl \
      --config.pipeline.num_steps=60 --config.change_on_resume=pipeline.num_steps
  python3 experiments/pipeline_rl.py --config.init=/path/to/hf_model \
      --config=experiments/configs/pipeline_rl.py:dataset_file \
      --config.task_config.path=train.jsonl --config.task_config.eval_path=test.jsonl \
      --config.prompt_format.kind=chat     # an HF model directory on a dataset file
  python3 experiments/pipeline_rl.py --helpfull    # every config field, with units and defaults
  python3 launch/local_multiprocess.py --num_processes=4 --num_learner_processes=2 -- \
      --config.pipeline.mode=threaded    # one jax.distributed job: 2 learner processes, 2 replicas

Devices: by default the sampler and learner meshes are chosen from the devices present (one
device is shared by both roles); --config.sampler_mesh_axes / --config.learner.mesh_axes set them.
A user's mistake ends with one line naming the --config field to fix.

Prints the run summary as one JSON object on its last line.
"""

import json

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app

from lib import cluster_cli
from lib import config_cli
from rlax_pipe.pipeline import run as run_lib

_CONFIG = config_cli.define_rl_flags()


def main(argv):
  del argv
  config_cli.setup_logging()
  with config_cli.user_errors():
    cfg = cluster_cli.with_flags(config_cli.run_config(_CONFIG.value))
    cluster_cli.join_if_multiprocess(cfg)  # multi-process mode: before any other JAX work
    summary = run_lib.run(cfg)
  print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
