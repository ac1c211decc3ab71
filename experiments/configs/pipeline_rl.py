"""Configs of the RL job family: pipeline_rl.py, bench_pipeline.py, sweep_staleness.py and the
base run of ablations.py.

  --config=experiments/configs/pipeline_rl.py           the default run (README command 1)
  --config=experiments/configs/pipeline_rl.py:tiny      a smoke run of seconds on 6 CPU devices
  --config.pipeline.num_steps=60 --config.learner.optimizer.learning_rate=1e-4   overrides

The defaults are those of `rlax_pipe.pipeline.config.RunConfig` (the one source); a preset only
names what it changes. Every field with its unit: `python3 experiments/pipeline_rl.py --helpfull`.
"""

import dataclasses

from rlax_pipe import config_dict
from rlax_pipe.pipeline.config import PipelineConfig, RunConfig
from rlax_pipe.pipeline.staleness import StalenessConfig
from rlax_pipe.tokenizer import default_tokenizer

PRESETS = ("default", "tiny")


def _tiny(cfg: RunConfig) -> RunConfig:
  """3 learner steps of 2 groups x 2 samples, 48-token sequences, 4 + 2 devices."""
  seq = 48
  sampler = dataclasses.replace(cfg.sampler, num_slots=4, page_size=8, num_pages=32,
                                max_seq_len=seq, max_new_tokens=seq)
  pipeline = PipelineConfig(
      num_steps=3, group_size=2, seq_len=seq, eval_every=100, eval_problems=4,
      checkpoint_every=1,
      staleness=StalenessConfig(policy="learner-wait", max_lag=1, groups_per_step=2))
  return dataclasses.replace(cfg, run_dir="runs/pipeline_rl_tiny", sampler_mesh_axes=(("tp", 2),),
                             sampler=sampler, pipeline=pipeline, eval_slots=4,
                             task_config={"max_terms": 4})


def get_config(preset: str = "default"):
  """The ConfigDict of `preset` (one of PRESETS).

  Raises:
    ValueError: on an unknown preset (the message lists them).
  """
  preset = preset or "default"
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} of configs/pipeline_rl.py; choose one of "
                     f"{PRESETS}.")
  cfg = RunConfig()
  # The stop token is the tokenizer's (not a dataclass default: it depends on the tokenizer).
  cfg = dataclasses.replace(cfg, sampler=dataclasses.replace(
      cfg.sampler, eos_id=default_tokenizer().eos_id))
  if preset == "tiny":
    cfg = _tiny(cfg)
  return config_dict.to_config_dict(cfg)
