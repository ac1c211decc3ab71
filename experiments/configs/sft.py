"""Configs of the SFT warm start (experiments/sft.py).

  --config=experiments/configs/sft.py            the shipped warm start's recipe
  --config=experiments/configs/sft.py:tiny       seconds
  --config.sft.steps=200 --config.out_dir=/tmp/sft

Fields: out_dir (checkpoint directory, created), task ("arithmetic" or "jsonl"), jsonl_path
(problems file of task "jsonl"), sft (`rlax_pipe.sft.SFTConfig`, the one source of defaults).
"""

import dataclasses

import ml_collections
from ml_collections import config_dict as config_dict_lib

from rlax_pipe import config_dict
from rlax_pipe import sft

PRESETS = ("default", "tiny")


def get_config(preset: str = "default"):
  """The ConfigDict of `preset` (one of PRESETS).

  Raises:
    ValueError: on an unknown preset.
  """
  preset = preset or "default"
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} of configs/sft.py; choose one of {PRESETS}.")
  cfg = sft.SFTConfig()
  if preset == "tiny":
    cfg = dataclasses.replace(cfg, steps=3, eval_problems=4, eval_slots=4, log_every=1)
  out = ml_collections.ConfigDict()
  out.out_dir = "runs/sft_warm_start" if preset == "default" else "runs/sft_tiny"
  out.task = "arithmetic"
  out.jsonl_path = config_dict_lib.placeholder(str)
  out.sft = config_dict.to_config_dict(cfg)
  return out
