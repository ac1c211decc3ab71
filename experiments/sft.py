"""SFT warm start on the built-in arithmetic task (or a JSONL task).

  python3 experiments/sft.py                 # the shipped warm start's recipe: runs/sft_warm_start/
  python3 experiments/sft.py --config.sft.steps=200 --config.out_dir=/tmp/sft
  python3 experiments/sft.py --config=experiments/configs/sft.py:tiny
  python3 experiments/sft.py --helpfull      # every config field, with units and defaults

Prints one JSON object (the summary, incl. greedy and T=1 held-out accuracy) as its last line.
"""

import json

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app

from lib import config_cli
from rlax_pipe import config_dict
from rlax_pipe import sft
from rlax_pipe import tasks
from rlax_pipe import tokenizer

_FIELDS = [
    "config.out_dir: checkpoint directory (created; must not hold a checkpoint).",
    "config.task: task to imitate, one of " + ", ".join(sorted(tasks.TASKS)) + ".",
    "config.jsonl_path: problems file (JSONL) of --config.task=jsonl.",
    "config.sft: the recipe (rlax_pipe.sft.SFTConfig):",
] + config_dict.describe_fields(sft.SFTConfig(), "config.sft.")
_CONFIG = config_cli.define_config("sft", "The SFT warm start (ml_collections config file).",
                                   _FIELDS)
config_cli.define_removed_flags(config_cli.SFT_RENAMED)


def main(argv):
  del argv
  c = _CONFIG.value
  task = tasks.make_task(c.task, tasks.JsonlConfig(path=c.jsonl_path) if c.task == "jsonl"
                         else None)
  cfg = config_dict.from_config_dict(sft.SFTConfig, c.sft)
  summary = sft.run_sft(task, tokenizer.default_tokenizer(), cfg, c.out_dir)
  print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
