"""Configuration of an RL run's pipeline: driver, batch shape, staleness, evaluation, timing model."""

from __future__ import annotations

import dataclasses

from rlax_pipe.grading import GradingConfig
from rlax_pipe.pipeline.staleness import StalenessConfig

DRIVERS: tuple[str, ...] = ("sync", "async-batch", "pipeline")
MODES: tuple[str, ...] = ("reproducible", "threaded")


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Virtual-clock durations (seconds) of the reproducible mode, per device-mesh operation.

  The reproducible mode runs sampler and learner on one host thread and advances each mesh's
  clock by these modelled durations, so the timeline shows what separate hardware would do and
  the same seed gives the same run. `experiments/calibrate_sim.py`-style fits from a threaded
  run's timeline give realistic values; the defaults are shaped like an accelerator (a decode
  step costs little more with more active slots, i.e. memory-bound decoding).

  Attributes:
    decode_base_s: one decode step with no active slot (>= 0).
    decode_per_slot_s: added per active slot (>= 0).
    prefill_per_token_s: per prefilled token (>= 0).
    train_base_s: one learner step, fixed part (>= 0).
    train_per_token_s: per trained token (real, not padding) (>= 0).
    push_s: one weight push, learner to sampler (>= 0).
  """

  decode_base_s: float = 0.010
  decode_per_slot_s: float = 0.0002
  prefill_per_token_s: float = 0.00002
  train_base_s: float = 0.05
  train_per_token_s: float = 0.0001
  push_s: float = 0.005

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if getattr(self, f.name) < 0:
        raise ValueError(f"CostModel.{f.name}={getattr(self, f.name)} must be >= 0.")

  def decode(self, active_slots: int) -> float:
    return self.decode_base_s + self.decode_per_slot_s * active_slots

  def train(self, tokens: int) -> float:
    return self.train_base_s + self.train_per_token_s * tokens


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """How sampling and learning are interleaved.

  Attributes:
    driver: "sync" (sample a whole batch with version v, wait for its last sample, train, push:
      lag 0), "async-batch" (conventional asynchronous RL: the sampler generates round r+1 while
      the learner trains on round r; weights change only between rounds, so no sample mixes
      versions) or "pipeline" (samplers never stop; in-flight weight updates between two decode
      steps; per-token lag bounded by `staleness`).
    mode: "reproducible" (one thread, deterministic interleaving on a virtual clock driven by
      `cost_model`: same seed, same run) or "threaded" (sampler in its own thread, real clock).
    num_steps: learner optimizer steps to run (>= 1).
    groups_per_step: prompt groups per learner batch (>= 1).
    group_size: samples per prompt (>= 1; GRPO needs >= 2 for a baseline).
    seq_len: tokens per packed learner row (>= the sampler's max_seq_len).
    advantage: advantage estimator name (see `rlax_pipe.advantages`).
    staleness: enforcement of max_lag (policy, bound, queue capacity). Its groups_per_step must
      equal this config's.
    eval_every: learner steps between held-out evaluations (>= 1); also at step 0 and the end.
    eval_problems: held-out problems per evaluation (>= 1).
    checkpoint_every: learner steps between checkpoints (>= 1).
    wait_timeout_s: limit of every blocking wait (seconds, > 0); the error says what was awaited.
    debug_verify_push: after each push, check that sampler and learner log-probs agree on a
      probe sequence (slow; catches a push that silently did not apply).
    reward_timeout_s: limit of one reward-function call (seconds, > 0); a call still running then
      is killed with its verifier process and the sample gets no reward.
    grading: over-long prompts, completions cut by the length limit, failed rewards
      (`rlax_pipe.grading`).
    cost_model: virtual-clock durations for the reproducible mode.
    seed: seed of prompt order and sampling.
  """

  driver: str = "pipeline"
  mode: str = "reproducible"
  num_steps: int = 40
  groups_per_step: int = 8
  group_size: int = 8
  seq_len: int = 384
  advantage: str = "grpo"
  staleness: StalenessConfig = StalenessConfig(policy="learner-wait", max_lag=4,
                                               groups_per_step=8)
  eval_every: int = 10
  eval_problems: int = 128
  checkpoint_every: int = 10
  wait_timeout_s: float = 600.0
  debug_verify_push: bool = False
  reward_timeout_s: float = 5.0
  grading: GradingConfig = GradingConfig()
  cost_model: CostModel = CostModel()
  seed: int = 0

  def __post_init__(self):
    if self.driver not in DRIVERS:
      raise ValueError(f"PipelineConfig.driver={self.driver!r}; choose one of {DRIVERS}.")
    if self.mode not in MODES:
      raise ValueError(f"PipelineConfig.mode={self.mode!r}; choose one of {MODES}.")
    for name in ("num_steps", "groups_per_step", "group_size", "seq_len", "eval_every",
                 "eval_problems", "checkpoint_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"PipelineConfig.{name}={getattr(self, name)} must be >= 1.")
    if self.staleness.groups_per_step != self.groups_per_step:
      raise ValueError(
          f"PipelineConfig.staleness.groups_per_step={self.staleness.groups_per_step} must equal "
          f"groups_per_step={self.groups_per_step}.")
    if not self.wait_timeout_s > 0 or not self.reward_timeout_s > 0:
      raise ValueError("PipelineConfig.wait_timeout_s and reward_timeout_s must be > 0.")
