"""Configs of the SFT warm start (experiments/sft.py).

  --config=experiments/configs/sft.py            the shipped warm start's recipe
  --config=experiments/configs/sft.py:tiny       seconds
  --config=experiments/configs/sft.py:reasoning_gym --config.task_config.dataset=chain_sum
  --config=experiments/configs/sft.py:dataset_file --config.init=/path/to/hf_model \
      --config.task_config.path=train.jsonl --config.prompt_format.kind=chat
  --config.sft.steps=200 --config.out_dir=/tmp/sft

Fields: out_dir (the output, an HF model directory with the tokenizer, created); init (an HF
model directory to fine-tune, or None for a new tiny random model); tokenizer_path (None = the
init directory's tokenizer, else the shipped one); prompt_format (`tokenizer.PromptFormat`: raw
or chat); task, task_config (the task's config; presets per task as in pipeline_rl.py) and
jsonl_path (task "jsonl"); sft (`rlax_pipe.sft.SFTConfig`, the one source of defaults).
Presets combine with a comma: "tiny,reasoning_gym".
"""

import dataclasses

import ml_collections
from ml_collections import config_dict as config_dict_lib

from rlax_pipe import config_dict
from rlax_pipe import sft
from rlax_pipe import tasks
from rlax_pipe.tokenizer import PromptFormat

SIZE_PRESETS = ("default", "tiny")
TASK_PRESETS = ("jsonl", "dataset_file", "reasoning_gym")
PRESETS = SIZE_PRESETS + TASK_PRESETS


def get_config(preset: str = "default"):
  """The ConfigDict of `preset`: one of PRESETS, or a size and a task preset joined by a comma.

  Raises:
    ValueError: on an unknown preset.
  """
  names = [p.strip() for p in (preset or "default").split(",") if p.strip()] or ["default"]
  unknown = [p for p in names if p not in PRESETS]
  if unknown or sum(p in TASK_PRESETS for p in names) > 1:
    raise ValueError(f"unknown preset(s) {unknown or names} of configs/sft.py; choose one of "
                     f"{SIZE_PRESETS}, optionally with one of {TASK_PRESETS}.")
  cfg = sft.SFTConfig()
  tiny = "tiny" in names
  if tiny:
    cfg = dataclasses.replace(cfg, steps=3, eval_problems=4, eval_slots=4, log_every=1)
  task = next((p for p in names if p in TASK_PRESETS), "arithmetic")
  out = ml_collections.ConfigDict()
  out.out_dir = "runs/sft_tiny" if tiny else (
      "runs/sft_warm_start" if task == "arithmetic" else f"runs/sft_{task}")
  out.init = config_dict_lib.placeholder(str)
  out.tokenizer_path = config_dict_lib.placeholder(str)
  out.prompt_format = config_dict.to_config_dict(PromptFormat())
  out.task = task
  out.jsonl_path = config_dict_lib.placeholder(str)
  if task == "arithmetic":
    out.task_config = config_dict_lib.placeholder(object)
  else:
    config_cls = tasks.TASKS[task][1]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    out.task_config = config_dict.to_config_dict(
        config_cls(path="") if "path" in fields else config_cls())
    if "path" in fields:
      out.task_config.path = config_dict_lib.placeholder(str)
  out.sft = config_dict.to_config_dict(cfg)
  return out
