"""What one simulation takes and returns: `SimConfig` (the driver, staleness policy, sampler
and learner shapes, costs and length distributions of a simulated run), `SimResult` (what the
run measured over its window) and `SimDeadlock`. The simulation itself: `simulator.simulate`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlax_pipe.costs import CostModel
from rlax_pipe.pipeline import staleness as staleness_lib
from rlax_pipe.pipeline.group_filter import GroupFilterConfig
from rlax_pipe.pipeline.rules import DRIVERS
from rlax_pipe.sim import distributions


class SimDeadlock(RuntimeError):
  """Neither simulated side can make progress (a configuration that can never fill a batch)."""


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """One simulated run.

  Attributes:
    driver: "sync", "async-batch" or "pipeline" (see `rlax_pipe.pipeline.config.PipelineConfig`).
    staleness: the staleness policy (its groups_per_step is the learner batch in groups).
    group_size: samples per prompt group S (>= 1).
    num_steps: learner steps to simulate (>= 1).
    slots_per_engine: decode slots of one sampler engine (>= 1).
    num_engines: sampler engines (>= 1); concurrency C = num_engines * slots_per_engine.
    lengths: completion-length distribution (tokens).
    costs: modelled durations.
    warmup_steps: learner steps excluded from the reported rates, idle fractions and lags
      (0 <= warmup_steps < num_steps); the window starts when step warmup_steps ends.
    seed: seed of the length draws.
    prompt_lengths: prompt-length distribution (tokens, one draw per group).
    prefill_rows: rows of one prefill call (`SamplerConfig.prefill_rows`).
    seq_len: learner row length (tokens); with it a step's cost is charged on the packed rows
      (`rules.batch_rows`), without it on the batch's tokens.
    micro_batch_rows, num_minibatches: the learner's batch split (`LearnerConfig`).
    push_bytes: bytes of one weight push.
    max_seq_len: sequence capacity; completions are capped at max_seq_len - prompt length.
    decode_steps_per_dispatch: K of the engine (`SamplerConfig.decode_steps_per_dispatch`;
      1 here by default, the closed-form tests' setting; runs pass their own).
    share_prompt_pages: a group's samples admitted under the same weights prefill the prompt
      once (`SamplerConfig.share_prompt_pages`).
    record_schedule: keep every learner step's (end time, samples, per-token versions).
    group_filter: dynamic sampling (`PipelineConfig.filter_groups` / `filter_max_dropped_per_step`):
      the queue drops groups without learning signal and the sampler admits replacements.
    rewards: reward model of the samples (`rewards.SolveRate`, `rewards.RewardReplay`; drawn a
      group at a time from its own random stream, so the length draws do not change), or None =
      every reward 0.0 (needed only by an active `group_filter`).
  """

  driver: str
  staleness: staleness_lib.StalenessConfig
  group_size: int
  num_steps: int
  slots_per_engine: int
  lengths: Any
  costs: CostModel
  num_engines: int = 1
  warmup_steps: int = 0
  seed: int = 0
  prompt_lengths: Any = distributions.Constant(16)
  prefill_rows: int = 4
  seq_len: int | None = None
  micro_batch_rows: int | None = None
  num_minibatches: int = 1
  push_bytes: int = 0
  max_seq_len: int | None = None
  decode_steps_per_dispatch: int = 1
  share_prompt_pages: bool = False
  record_schedule: bool = False
  group_filter: GroupFilterConfig = GroupFilterConfig()
  rewards: Any = None

  def __post_init__(self):
    if self.driver not in DRIVERS:
      raise ValueError(f"SimConfig.driver={self.driver!r}; choose one of {DRIVERS}.")
    for name in ("group_size", "num_steps", "slots_per_engine", "num_engines", "prefill_rows",
                 "decode_steps_per_dispatch"):
      if getattr(self, name) < 1:
        raise ValueError(f"SimConfig.{name}={getattr(self, name)} must be >= 1.")
    if not 0 <= self.warmup_steps < self.num_steps:
      raise ValueError(f"SimConfig.warmup_steps={self.warmup_steps} must be in [0, num_steps).")
    if self.group_filter.active and self.rewards is None:
      raise ValueError("SimConfig.group_filter is active but rewards is None (every group would "
                       "be zero-variance); pass a reward model, e.g. rewards.SolveRate(2, 2).")
    if self.driver == "pipeline" and self.concurrency < self.group_size:
      raise ValueError(f"SimConfig: pipeline needs slots ({self.concurrency}) >= group_size "
                       f"({self.group_size}) to ever start a group.")

  @property
  def groups_per_step(self) -> int:
    """Learner batch in groups."""
    return self.staleness.groups_per_step

  @property
  def batch_samples(self) -> int:
    """Learner batch in samples, B = groups_per_step * group_size."""
    return self.groups_per_step * self.group_size

  @property
  def concurrency(self) -> int:
    """C = num_engines * slots_per_engine."""
    return self.num_engines * self.slots_per_engine


@dataclasses.dataclass(frozen=True)
class SimResult:
  """What a simulated run measured over its window (see `SimConfig.warmup_steps`).

  Attributes:
    steps: learner steps simulated.
    end_time_s: virtual time at which the last step's push ended.
    window_s: (t0, t1) of the measurement window, seconds.
    samples_per_s, tokens_per_s: trained samples / completion tokens per second in the window.
    step_period_s: mean seconds between learner step ends in the window.
    idle_sampler, idle_learner: 1 - busy fraction over the window (sampler: prefill + decode;
      learner: train steps; pushes are the channel's).
    slot_occupancy: time-weighted active slots / C over decode time in the window.
    slot_idle: 1 - (active slot-seconds) / (C * window): unused slot time, waits included (the
      hardware idleness of a memory-bound sampler, whose step costs about the same at any batch).
    lag_hist: per-token lag histogram of trained tokens (index = lag in steps).
    token_lag_mean, token_lag_max: per-token lag mean / max of trained tokens.
    sample_lag_mean, sample_lag_max: per-sample staleness, the lag of each trained sample's
      oldest token (Applied Compute's, `formulas.applied_compute_staleness`): mean / max.
    mean_active_slots: time-weighted mean active slots over decode time.
    sync_t99_s, sync_t100_s: round-based drivers: mean seconds from a round's start until 99% /
      100% of its samples finished (None for pipeline).
    waste: discarded work by reason (from the queue), whole run; dynamic sampling's drops are
      reason "filtered".
    generated_samples_per_step: samples that finished (or were aborted) per learner step,
      whole run: trained plus discarded; with dynamic sampling, the over-sampling.
    filter_kept_groups: zero-variance groups trained at the filter's bound (whole run).
    wasted_token_fraction: wasted / (wasted + trained) completion tokens, whole run.
    schedule: with `record_schedule`, per learner step (end time, ((sample id, group id,
      policy versions), ...) in batch order); else None.
  """

  steps: int
  end_time_s: float
  window_s: tuple[float, float]
  samples_per_s: float
  tokens_per_s: float
  step_period_s: float
  idle_sampler: float
  idle_learner: float
  slot_occupancy: float
  slot_idle: float
  lag_hist: tuple[int, ...]
  token_lag_mean: float
  token_lag_max: int
  sample_lag_mean: float
  sample_lag_max: int
  mean_active_slots: float
  sync_t99_s: float | None
  sync_t100_s: float | None
  waste: staleness_lib.WasteCounters
  wasted_token_fraction: float
  schedule: tuple | None = None
  generated_samples_per_step: float = float("nan")
  filter_kept_groups: int = 0

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready dict (without the schedule)."""
    d = dataclasses.asdict(self)
    d.pop("schedule")
    d["lag_hist"] = list(self.lag_hist)
    d["window_s"] = list(self.window_s)
    return d
