r"""SFT warm start: the built-in arithmetic task, a JSONL / dataset file, or a reasoning-gym task,
on a new tiny model or an HF model directory.

  python3 experiments/sft.py                 # the shipped warm start's recipe: runs/sft_warm_start/
  python3 experiments/sft.py --config.sft.steps=200 --config.out_dir=/tmp/sft
  python3 experiments/sft.py --config=experiments/configs/sft.py:tiny
  python3 experiments/sft.py --config=experiments/configs/sft.py:dataset_file \
      --config.init=/path/to/hf_model --config.task_config.path=train.jsonl \
      --config.prompt_format.kind=chat      # fine-tune an HF model directory on a dataset file
  python3 experiments/sft.py --helpfull      # every config field, with units and defaults

The output directory is an HF model directory (weights, tokenizer, generation config) that
`experiments/pipeline_rl.py --config.init=<out_dir>` starts RL from. Prints one JSON object (the
summary, incl. greedy and T=1 held-out accuracy) as its last line.
"""

import json

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app

from lib import config_cli
from rlax_pipe import config_dict
from rlax_pipe import model_dir
from rlax_pipe import sft
from rlax_pipe import tasks
from rlax_pipe.config_dict import ConfigError
from rlax_pipe.model import Transformer, hf_io
from rlax_pipe.pipeline import config_checks
from rlax_pipe.tokenizer import PromptFormat

_FIELDS = [
    "config.out_dir: output directory, an HF model directory (created; must not hold one).",
    "config.init: HF model directory to fine-tune (config.json + *.safetensors, tokenizer); "
    "None = a new tiny random model.",
    "config.tokenizer_path: tokenizer file or directory; None = init's, else the shipped one.",
    "config.prompt_format: raw or chat prompts (rlax_pipe.tokenizer.PromptFormat):",
] + config_dict.describe_fields(PromptFormat(), "config.prompt_format.") + [
    "config.task: task to imitate, one of " + ", ".join(sorted(tasks.TASKS)) + ".",
    "config.task_config: the task's config (use a task preset, e.g. :dataset_file).",
    "config.jsonl_path: problems file (JSONL) of --config.task=jsonl.",
    "config.sft: the recipe (rlax_pipe.sft.SFTConfig):",
] + config_dict.describe_fields(sft.SFTConfig(), "config.sft.")
_CONFIG = config_cli.define_config("sft", "The SFT warm start (ml_collections config file).",
                                   _FIELDS)
config_cli.define_removed_flags(config_cli.SFT_RENAMED)


def _setup(c):
  """(task, tokenizer, SFTConfig, model or None, params or None) of the parsed config."""
  cfg = config_dict.from_config_dict(sft.SFTConfig, c.sft, prefix="--config.sft.")
  fmt = config_dict.from_config_dict(PromptFormat, c.prompt_format,
                                     prefix="--config.prompt_format.")
  task_cfg = config_checks.task_config_for(c.task, c.task_config, c.jsonl_path, owner="--config",
                                           preset_file="sft")
  try:
    task = tasks.make_task(c.task, task_cfg)
  except (FileNotFoundError, ValueError, ImportError) as e:
    raise ConfigError(f"--config.task={c.task!r} (task_config): {e}") from None
  try:
    tok, _ = model_dir.tokenizer_for(c.init, c.tokenizer_path, fmt)
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"--config.tokenizer_path / --config.init (tokenizer): {e}") from None
  model = params = None
  if c.init is not None:
    try:
      model_cfg, params = hf_io.load_hf_checkpoint(c.init)
    except (FileNotFoundError, ValueError) as e:
      raise ConfigError(f"--config.init={c.init!r}: {e}") from None
    model = Transformer(model_cfg)
  return task, tok, cfg, model, params


def main(argv):
  del argv
  config_cli.setup_logging()
  with config_cli.user_errors():
    task, tok, cfg, model, params = _setup(_CONFIG.value)
    try:
      summary = sft.run_sft(task, tok, cfg, _CONFIG.value.out_dir, model=model, params=params)
    except FileExistsError as e:
      raise ConfigError(f"--config.out_dir={_CONFIG.value.out_dir}: {e}") from None
    except OSError as e:
      if e.filename is None or not str(_CONFIG.value.out_dir).startswith(str(e.filename)):
        raise
      raise ConfigError(f"--config.out_dir={_CONFIG.value.out_dir!r} cannot be created "
                        f"({e.strerror or e}); choose a writable directory.") from None
  print(json.dumps(summary))


if __name__ == "__main__":
  app.run(main)
