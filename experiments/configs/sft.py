"""Configs of the SFT warm start (experiments/sft.py).

  --config=experiments/configs/sft.py            the shipped warm start's recipe
  --config=experiments/configs/sft.py:tiny       seconds
  --config=experiments/configs/sft.py:reasoning_gym --config.task_config.dataset=chain_sum
  --config=experiments/configs/sft.py:dataset_file --config.init=/path/to/hf_model \
      --config.task_config.path=train.jsonl --config.prompt_format.kind=chat
  --config=experiments/configs/sft.py:calculator   tool warm start: the shipped warm start
      fine-tuned with a share of calculator-tool episodes (task "arithmetic_calculator")
  --config.sft.steps=200 --config.out_dir=/tmp/sft

Fields: out_dir (the output, an HF model directory with the tokenizer, created); init (an HF
model directory to fine-tune, or None for a new tiny random model); tokenizer_path (None = the
init directory's tokenizer, else the shipped one); prompt_format (`tokenizer.PromptFormat`: raw
or chat); task, task_config (the task's config; presets per task as in pipeline_rl.py) and
jsonl_path (task "jsonl"); sft (`rlax_pipe.sft.SFTConfig`, the one source of defaults).
Presets combine with a comma: "tiny,reasoning_gym".
"""

import dataclasses
import pathlib

import ml_collections
from ml_collections import config_dict as config_dict_lib

from rlax_pipe import config_dict
from rlax_pipe import sft
from rlax_pipe import tasks
from rlax_pipe.tokenizer import PromptFormat

SIZE_PRESETS = ("default", "tiny")
TASK_PRESETS = ("jsonl", "dataset_file", "reasoning_gym", "calculator")
_PRESET_TASK = {"calculator": "arithmetic_calculator"}  # a task preset named apart from its task
# The calculator tool warm start (WORKSPACE_NOTES.md, "Issue 23: RL with and without a tool"):
# the shipped single-turn warm start fine-tuned for 150 steps on a mixture in which 30% of the
# problems are demonstrated as calculator episodes, the rest as before (worked / direct 50/50).
# rlax_pipe/assets/sft_calculator is its output (config.json, model.safetensors,
# sft_result.json of `python3 experiments/sft.py --config=experiments/configs/sft.py:calculator
# --config.out_dir=<dir>`), the init of configs/pipeline_rl.py:calculator.
CALCULATOR_SFT = dict(steps=150, learning_rate=1e-3, warmup_steps=10, tool_fraction=0.3)

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
  preset_task = next((p for p in names if p in TASK_PRESETS), "arithmetic")
  task = _PRESET_TASK.get(preset_task, preset_task)
  if preset_task == "calculator" and not tiny:
    cfg = dataclasses.replace(cfg, **CALCULATOR_SFT)
  elif preset_task == "calculator":
    cfg = dataclasses.replace(cfg, tool_fraction=CALCULATOR_SFT["tool_fraction"])
  out = ml_collections.ConfigDict()
  out.out_dir = "runs/sft_tiny" if tiny else (
      "runs/sft_warm_start" if task == "arithmetic" else f"runs/sft_{preset_task}")
  out.init = config_dict_lib.placeholder(str)
  if preset_task == "calculator":  # fine-tunes the shipped single-turn warm start
    out.init = str(pathlib.Path(sft.__file__).resolve().parent / "assets" / "sft_arithmetic")
  out.tokenizer_path = config_dict_lib.placeholder(str)
  out.prompt_format = config_dict.to_config_dict(PromptFormat())
  out.task = task
  out.jsonl_path = config_dict_lib.placeholder(str)
  if task in ("arithmetic", "arithmetic_calculator"):
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
