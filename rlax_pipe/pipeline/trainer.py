"""Learner side of a run: takes the oldest ready groups, builds a TrainBatch, steps, pushes weights."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from absl import logging
import numpy as np

from rlax_pipe import advantages as advantages_lib
from rlax_pipe.learner import Learner
from rlax_pipe.pipeline import batching
from rlax_pipe import grading
from rlax_pipe.pipeline.config import PipelineConfig
from rlax_pipe.pipeline.rollout_queue import Group, RolloutQueue
from rlax_pipe.pipeline.weight_channel import WeightChannel
from rlax_pipe.types import Rollout


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What one learner step consumed and produced (host numbers).

  Attributes:
    version: learner version after the step (= the version pushed).
    metrics: the learner's metrics of this step (numpy scalars / arrays).
    rollouts: the samples of the groups consumed (those without a reward, NaN, are not trained).
    completion_tokens: completion tokens trained on (real tokens, no padding).
    reward_mean: mean reward of the samples that have one.
    sample_metrics: `grading.batch_metrics` of `rollouts` (length-cut share, unrewarded samples,
      truncated-prompt share).
  """

  version: int
  metrics: dict
  rollouts: tuple[Rollout, ...]
  completion_tokens: int
  reward_mean: float
  sample_metrics: dict = dataclasses.field(default_factory=dict)


def _rows_bucket(needed: int) -> int:
  """Row count rounded up to a power of two, so batch shapes (and compiles) stay few."""
  return 1 << max(0, int(needed - 1).bit_length())


def build_batch(groups: Sequence[Group], cfg: PipelineConfig):
  """Advantages per group, then sequence packing into [rows, seq_len] with rows a power of two.

  Samples without a reward (NaN: failed verifier, or masked by the overlong policy) are left out
  of their group's baseline (`advantages`) and out of the batch, so none of their tokens is in
  the loss or its normaliser.

  Returns:
    (TrainBatch, flat list of the rollouts packed, in batch order).
  """
  rollouts = [r for g in groups for r in g]
  rewards = np.asarray([r.reward for r in rollouts], np.float32)
  group_ids = np.asarray([r.group_id for r in rollouts], np.int64)
  adv = advantages_lib.get_advantage_fn(cfg.advantage)(rewards, group_ids)
  keep = [i for i, r in enumerate(rollouts) if not np.isnan(r.reward)]
  rollouts, adv = [rollouts[i] for i in keep], np.asarray(adv, np.float32)[keep]
  lengths = [r.prompt_tokens.shape[0] + r.num_completion_tokens for r in rollouts]
  rows = _rows_bucket(len(batching.packing_plan(lengths, cfg.seq_len)))
  return batching.pack_rollouts(rollouts, adv, cfg.seq_len, num_rows=rows), rollouts


class Trainer:
  """Thin shell: queue -> batch -> `Learner.train_step` -> `WeightChannel.push`.

  Args:
    learner: the sharded learner.
    queue: the rollout queue.
    channel: weight channel to the sampler.
    cfg: pipeline configuration.
  """

  def __init__(self, learner: Learner, queue: RolloutQueue, channel: WeightChannel,
               cfg: PipelineConfig):
    self.learner, self.queue, self.channel, self.cfg = learner, queue, channel, cfg

  def train_on(self, groups: Sequence[Group]) -> StepResult:
    """One optimizer step on `groups`, then pushes the new version to the sampler."""
    batch, trained = build_batch(groups, self.cfg)
    rollouts = [r for g in groups for r in g]
    self.learner.train_step(batch)
    metrics = self.learner.flush()
    version = self.learner.version
    self.queue.set_learner_version(version)
    self.channel.push(self.learner.params, version)
    sample_metrics = grading.batch_metrics(rollouts)
    sample_metrics.update(lag0_alarm(metrics, self.cfg.lag0_logp_alarm, version))
    return StepResult(
        version=version, metrics={k: np.asarray(v) for k, v in metrics.items()},
        rollouts=tuple(rollouts),
        completion_tokens=int(sum(r.num_completion_tokens for r in trained)),
        reward_mean=float(np.mean([r.reward for r in trained])) if trained else float("nan"),
        sample_metrics=sample_metrics)


def lag0_alarm(metrics: dict, threshold: float | None, version: int) -> dict[str, int]:
  """{"lag0_logp_alarm": 0 or 1}: 1 (and a warning) when the mean log-prob mismatch of lag-0
  tokens exceeds `threshold` nats (see `PipelineConfig.lag0_logp_alarm`); {} when off or when
  the step had no lag-0 token."""
  if threshold is None or "logp_mismatch_mean" not in metrics:
    return {}
  mismatch = float(np.asarray(metrics["logp_mismatch_mean"]))
  if mismatch > threshold:
    logging.warning(
        "step to version %d: lag-0 tokens' mean |log pi - log mu| = %.3g nats > alarm %.3g: the "
        "sampler may not decode with the weights its tokens are tagged with (or decodes at "
        "another precision).", version, mismatch, threshold)
    return {"lag0_logp_alarm": 1}
  return {"lag0_logp_alarm": 0}
