"""The stress regime of the RL job: a setting in which staleness matters (issue 16).

  --config=experiments/configs/stress.py          12 steps, lr 3e-4, T=1.0, max_lag 64 (~2 min)
  --config=experiments/configs/stress.py:tiny     the same shape in seconds (tests)
  --config=experiments/configs/stress.py:noclip   the same without gradient clipping (claim (b))
  --config=experiments/configs/stress.py:longlag  1 group per step against 128 slots, 24 steps:
                                                  the same samples, 4x the batches in flight
  add --config.pipeline.cost_model_file=experiments/results/issue16_stress/cost_fit_stress.json
  for the virtual clock with this preset's costs measured on the 2-core dev CPU
  python3 experiments/ablations.py --ablation=A11 --config=experiments/configs/stress.py --seeds=3

At the default scale (lr 3e-5..1e-4, 8 x 8 samples per step, T=0.7, 64 slots; measured when
the RL job's default temperature was 0.7, before issue 25 made it 1.0) importance ratios
stay in about [0.5, 2] and ESS >= 0.99 even at lag 8, so no correction can matter. Here the
policy moves far per step and the sampler runs far ahead of the learner:

  * learning rate 3e-4 (10x the default) with a 2-step warmup: one step changes the policy's
    log-probs by O(1) on some tokens;
  * temperature 1.0 (the default since issue 25; 0.7 in the measurements of the default scale
    above): more low-probability tokens, whose ratios move most;
  * 2 groups x 8 samples per step (B = 16) against 64 decode slots (C = 64): the sampler holds
    C / B = 4 batches in flight, so tokens reach lag ~10 within 12 steps (Applied Compute's
    staleness ~ C * M_tail / B + rho);
  * max_lag 64 (the issue's largest lag; in 12 steps it is not binding: "64" is "unbounded");
  * one device per role (fastest on a 2-core CPU), 12 learner steps, held-out evaluation on
    2500 problems only at the start and the end (binomial 95% half-width <= 1.96 * sqrt(0.25 /
    2500) = 1.96 points for any accuracy), no checkpoints between, no HF export.

Measured (WORKSPACE_NOTES.md, "Issue 16, second pass"; 20 seeds, max_lag 64): without correction
ESS 0.839, ratio variance 3.06, k3 KL 0.202 per step; with TIS 0.852 / 0.50 / 0.143; against
0.986 / 0.015 / 0.0045 in the default regime at lag 8. Final held-out accuracy: TIS 0.448 +- 0.033,
no correction 0.338 +- 0.045 (claim (a), intervals separate). Every field not named here is
the default run's (`configs/pipeline_rl.py`).
"""

import dataclasses

from rlax_pipe import config_dict
from rlax_pipe import tasks
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.pipeline.config import RunConfig

PRESETS = ("default", "tiny", "noclip", "longlag")
EVAL_PROBLEMS = 2500


def stress_config(tiny: bool = False, clip: bool = True, long_lag: bool = False) -> RunConfig:
  """The stress `RunConfig` (tiny: 3 steps of 2 x 2 samples, 48-token sequences, seconds).

  clip=False turns off the global-norm gradient clip (max_grad_norm None): with the clip at 1.0
  AdamW's update stays bounded whatever the importance weights, so heavy-tailed untruncated
  weights cannot show the instability Yao et al. 2025 describe (WORKSPACE_NOTES.md, issue 16).
  long_lag=True: 1 group of 8 per learner step against 128 decode slots for 24 steps (the same
  192 samples): C / B = 16 batches in flight instead of 4, so tokens reach lags of ~20.
  """
  cfg = dataclasses.replace(RunConfig(), task_config=tasks.ArithmeticConfig())
  opt = dataclasses.replace(cfg.learner.optimizer, learning_rate=3e-4, warmup_steps=2,
                            **({} if clip else {"max_grad_norm": None}))
  learner = dataclasses.replace(cfg.learner, optimizer=opt, mesh_axes=(("fsdp", 1), ("tp", 1)))
  sampling = SamplingConfig(temperature=1.0)
  stale = dataclasses.replace(cfg.pipeline.staleness, max_lag=64, groups_per_step=2)
  pipeline = dataclasses.replace(cfg.pipeline, num_steps=12, staleness=stale, eval_every=1000,
                                 eval_problems=EVAL_PROBLEMS, checkpoint_every=1000)
  sampler = dataclasses.replace(cfg.sampler, num_slots=64, sampling=sampling)
  if long_lag:
    stale = dataclasses.replace(stale, groups_per_step=1)
    pipeline = dataclasses.replace(pipeline, num_steps=24, staleness=stale)
    sampler = dataclasses.replace(sampler, num_slots=128, num_pages=1024)
  if tiny:
    seq = 48
    sampler = dataclasses.replace(sampler, num_slots=8, page_size=8, num_pages=64,
                                  max_seq_len=seq, max_new_tokens=seq)
    pipeline = dataclasses.replace(pipeline, num_steps=3, group_size=2, seq_len=seq,
                                   eval_problems=8)
    cfg = dataclasses.replace(cfg, task_config=tasks.ArithmeticConfig(max_terms=4))
  return dataclasses.replace(cfg, run_dir="runs/stress" + ("_tiny" if tiny else "")
                             + ("" if clip else "_noclip") + ("_longlag" if long_lag else ""),
                             learner=learner, sampler=sampler, pipeline=pipeline,
                             sampler_mesh_axes=(("tp", 1),), eval_slots=8 if tiny else 256,
                             export_hf=False)


def get_config(preset: str = "default"):
  """The ConfigDict of `preset` ("default", "tiny", "noclip" or "longlag").

  Raises:
    ValueError: on an unknown preset (the message lists them).
  """
  preset = (preset or "default").strip()
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} of configs/stress.py; choose one of {PRESETS}.")
  return config_dict.to_config_dict(stress_config(tiny=preset == "tiny",
                                                  clip=preset != "noclip",
                                                  long_lag=preset == "longlag"))
