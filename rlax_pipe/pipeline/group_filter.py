"""Dynamic sampling: prompt groups without learning signal are dropped at the queue and replaced.

DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv 2503.14476, Sec. 3.2 "Dynamic Sampling", Eq. 10's constraint 0 < |{o_i : is_equivalent(a,
o_i)}| < G) over-samples and filters out the prompts whose G samples are all right or all wrong,
and keeps sampling until the batch is full of prompts with accuracy strictly between 0 and 1. With
a group-relative advantage (`rlax_pipe.advantages`: every estimator gives exactly 0.0 to a group
whose valid rewards are equal) such a group contributes no policy-gradient term, yet it takes its
share of the learner's fixed-size batch.

Here (`PipelineConfig.filter_groups`): under ``zero_variance`` the queue discards a complete group
without signal (`has_signal`) when it becomes complete (the moment its rewards are known), as
waste reason ``filtered``. The discard releases its admission (`staleness.AdmissionLedger` does
not count discarded groups), so the sampler admits a replacement prompt by the same staleness
rule, stamped with its own admission version (round-based drivers: `rules.reopen_filtered`). The
learner's batch keeps its size. Under ``off`` every complete, scored group is trained.

The bound: a run in which (almost) every group is zero-variance must not sample forever. The queue
drops at most `max_dropped_per_step` groups between two batches handed to the learner; a
zero-variance group that completes once that many were dropped since the last batch is kept and
trained (zero advantage, the `off` behaviour) and counted (`QueueStats.filter_kept_groups`). So
each learner step costs at most groups_per_step + max_dropped_per_step groups of sampling.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

FILTER_MODES: tuple[str, ...] = ("off", "zero_variance")


@dataclasses.dataclass(frozen=True)
class GroupFilterConfig:
  """Which complete groups the queue drops instead of training (dynamic sampling).

  Attributes:
    mode: one of `FILTER_MODES` ("off": none; "zero_variance": groups whose valid rewards are
      all equal, see `has_signal`).
    max_dropped_per_step: most groups dropped between two learner batches (>= 1); past it,
      zero-variance groups are kept and trained, and counted (see the module docstring).
  """

  mode: str = "off"
  max_dropped_per_step: int = 32

  def __post_init__(self):
    if self.mode not in FILTER_MODES:
      raise ValueError(f"--config.pipeline.filter_groups={self.mode!r} "
                       f"(GroupFilterConfig.mode): choose one of {FILTER_MODES}.")
    if self.max_dropped_per_step < 1:
      raise ValueError(
          f"--config.pipeline.filter_max_dropped_per_step={self.max_dropped_per_step} "
          "(GroupFilterConfig.max_dropped_per_step) must be >= 1; use filter_groups='off' to "
          "drop nothing.")

  @property
  def active(self) -> bool:
    """Whether any group can be dropped."""
    return self.mode != "off"


def has_signal(rewards: Sequence[float] | np.ndarray) -> bool:
  """Whether a group's rewards give a group-relative advantage that is not identically zero.

  True iff at least 2 rewards are valid (not NaN) and they are not all equal: the complement of
  DAPO's filtered set (Sec. 3.2: accuracy 0 or 1), generalised to any reward values and to
  missing rewards (`rlax_pipe.advantages`: a sample without a reward is left out of its group's
  baseline, and a group with fewer than 2 valid rewards gets all zeros).

  Args:
    rewards: float[S] the group's rewards (NaN = missing).

  Raises:
    ValueError: if `rewards` is not 1-D.
  """
  r = np.asarray(rewards, np.float64)
  if r.ndim != 1:
    raise ValueError(f"has_signal: rewards must be float[S] (one group); got shape {r.shape}.")
  valid = r[~np.isnan(r)]
  return valid.size >= 2 and bool(valid.max() > valid.min())


def should_drop(config: GroupFilterConfig, rewards: Sequence[float] | np.ndarray,
                dropped_since_batch: int) -> bool:
  """Whether the queue drops a complete group (reason "filtered") instead of training it.

  Args:
    config: the filter.
    rewards: float[S] the group's rewards (NaN = missing).
    dropped_since_batch: groups this filter dropped since the learner's last batch.
  """
  return dropped_since_batch < config.max_dropped_per_step and matches(config, rewards)


def matches(config: GroupFilterConfig, rewards: Sequence[float] | np.ndarray) -> bool:
  """Whether the filter's mode selects the group, bound aside (zero-variance, `has_signal`
  False, under "zero_variance"; never under "off").

  Args:
    config: the filter.
    rewards: float[S] the group's rewards (NaN = missing).
  """
  return config.mode == "zero_variance" and not has_signal(rewards)
