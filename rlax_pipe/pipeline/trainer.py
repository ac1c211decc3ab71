"""Learner side of a run: takes the oldest ready groups, builds a TrainBatch, steps, pushes weights."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from absl import logging
import jax
import numpy as np

from rlax_pipe import advantages as advantages_lib
from rlax_pipe.learner import Learner
from rlax_pipe.pipeline import batching
from rlax_pipe.pipeline import rules
from rlax_pipe import grading
from rlax_pipe.pipeline.config import PipelineConfig
from rlax_pipe.pipeline.rollout_queue import Group, RolloutQueue
from rlax_pipe.pipeline.weight_channel import WeightChannel
from rlax_pipe.types import Rollout, WeightUpdate


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What one learner step consumed and produced (host numbers).

  Attributes:
    trained_at: the policy version the batch was trained at (the params before the step; the
      lag of a token is trained_at - its version).
    produced: the version after the step (= the version pushed): trained_at + 1 when the update
      was applied, trained_at when it was not (a skipped non-finite step, a step without a
      token in the loss).
    metrics: the learner's metrics of this step (numpy scalars / arrays).
    rollouts: the samples of the groups consumed (those without a reward, NaN, are not trained).
    completion_tokens: completion tokens trained on (real tokens, no padding): the model's
      tokens only; an episode's environment tokens (loss mask 0) are in `env_tokens`.
    reward_mean: mean reward of the samples that have one.
    sample_metrics: `grading.batch_metrics` of `rollouts` (length-cut share, unrewarded samples,
      truncated-prompt share).
    micro_batches: micro-batches of the step (`Learner.last_plan`).
    processed_rows: rows the step computes, padding of the last micro-batches included
      (processed tokens = processed_rows x seq_len: the learner's cost feature).
    push_bytes: bytes of the pushed weights.
    build_s, train_s, push_s: wall-clock seconds of building the batch (advantages, packing),
      of the train step (dispatch to metrics read back) and of the push.
  """

  trained_at: int
  produced: int
  metrics: dict
  rollouts: tuple[Rollout, ...]
  completion_tokens: int
  reward_mean: float
  sample_metrics: dict = dataclasses.field(default_factory=dict)
  micro_batches: int = 1
  processed_rows: int = 0
  push_bytes: int = 0
  build_s: float = 0.0
  train_s: float = 0.0
  push_s: float = 0.0
  env_tokens: int = 0  # environment tokens (tool results) of the episodes trained on


def build_batch(groups: Sequence[Group], cfg: PipelineConfig):
  """Advantages per group, then sequence packing into [rows, seq_len] with rows a power of two.

  Samples without a reward (NaN: failed verifier, or masked by the overlong policy) are left out
  of their group's baseline (`advantages`) and out of the batch, so none of their tokens is in
  the loss or its normaliser.

  Returns:
    (TrainBatch, the rollouts packed, in the batch's segment order): the k-th rollout is the
    k-th segment in row-major, segment-id order, i.e. `batching.unpack_batch(batch)[k]`, so the
    two can be paired by position. First-fit-decreasing packing puts longer samples first, so
    this is in general not the order of `groups`.
  """
  rollouts = [r for g in groups for r in g]
  rewards = np.asarray([r.reward for r in rollouts], np.float32)
  group_ids = np.asarray([r.group_id for r in rollouts], np.int64)
  adv = advantages_lib.get_advantage_fn(cfg.advantage)(rewards, group_ids)
  keep = [i for i, r in enumerate(rollouts) if not np.isnan(r.reward)]
  rollouts, adv = [rollouts[i] for i in keep], np.asarray(adv, np.float32)[keep]
  lengths = [r.prompt_tokens.shape[0] + r.num_completion_tokens for r in rollouts]
  rows = rules.batch_rows(lengths, cfg.seq_len)
  batch = batching.pack_rollouts(rollouts, adv, cfg.seq_len, num_rows=rows)
  return batch, [rollouts[i] for i in rules.packed_order(lengths, cfg.seq_len)]


class Trainer:
  """Thin shell: queue -> batch -> `Learner.train_step` -> `WeightChannel.push`.

  The trainer owns the learner side's policy version, a host integer (`version`): read once
  from the learner when built (0, or the restored checkpoint's), then advanced by each step from
  the step's own metrics (whether its update was applied), read in the one device-to-host
  transfer of the step. The push needs that fact (a skipped step pushes the same version), so
  the step's metrics are read right after it, not one step late.

  Args:
    learner: the sharded learner.
    queue: the rollout queue.
    channel: weight channel to the sampler.
    cfg: pipeline configuration.
  """

  def __init__(self, learner: Learner, queue: RolloutQueue, channel: WeightChannel,
               cfg: PipelineConfig):
    self.learner, self.queue, self.channel, self.cfg = learner, queue, channel, cfg
    self.version = learner.version
    # Bytes of one pushed version (weights travel in the learner's param dtype), whatever the
    # channel: the in-process WeightChannel or a multi-process job's LearnerSender.
    self.push_bytes = int(sum(x.nbytes for x in jax.tree.leaves(learner.params)))

  def train_on(self, groups: Sequence[Group]) -> StepResult:
    """One optimizer step on `groups`, then pushes the new version to the sampler."""
    t0 = time.perf_counter()
    batch, trained = build_batch(groups, self.cfg)
    rollouts = [r for g in groups for r in g]
    t1 = time.perf_counter()
    trained_at = self.version
    self.learner.train_step(batch)
    metrics = self.learner.flush()  # the step's one device-to-host transfer
    version = trained_at + int(int(metrics["updates_applied"]) > 0)
    if int(metrics["version"]) != version:
      raise RuntimeError(f"Trainer: the learner's state says version {int(metrics['version'])} "
                         f"after a step from version {trained_at}, the trainer counted "
                         f"{version} (a learner stepped outside its Trainer?).")
    self.version = version
    t2 = time.perf_counter()
    self.queue.set_learner_version(version)
    self.channel.push(WeightUpdate(version, self.learner.params))
    t3 = time.perf_counter()
    micro, processed = self.learner.last_plan  # the plan the step ran
    return StepResult(
        trained_at=trained_at, produced=version, metrics={k: np.asarray(v) for k, v in metrics.items()},
        rollouts=tuple(rollouts),
        completion_tokens=int(sum(r.completion_mask.sum() for r in trained)),  # model tokens
        env_tokens=int(sum((1.0 - r.completion_mask).sum() for r in trained)),
        reward_mean=float(np.mean([r.reward for r in trained])) if trained else float("nan"),
        sample_metrics={**grading.batch_metrics(rollouts),
                        **lag0_alarm(metrics, self.cfg.lag0_logp_alarm, version)},
        micro_batches=micro, processed_rows=processed,
        push_bytes=self.push_bytes,
        build_s=t1 - t0, train_s=t2 - t1, push_s=t3 - t2)


def lag0_alarm(metrics: dict, threshold: float | None, version: int) -> dict[str, int]:
  """The lag-0 log-prob check of one step (see `PipelineConfig.lag0_logp_alarm`).

  Returns {} when the alarm is off; else "lag0_tokens" (the lag-0 tokens compared: tokens
  sampled with exactly the weights being trained, `mismatch_tokens` of the diagnostics) and,
  when there was at least one, "lag0_logp_alarm": 1 (and a warning) when their mean
  |log pi - log mu| exceeds `threshold` nats, else 0. A step without lag-0 tokens (common under
  the pipeline driver, where every token may lag) has nothing to compare: it says so with
  "lag0_tokens": 0 and no alarm value (issue #27 item 3: it used to report the alarm as 0, or a
  NaN mismatch, as if the check had passed); the engine's weight check still covers it.
  """
  if threshold is None:
    return {}
  mismatch = float(np.asarray(metrics.get("logp_mismatch_mean", np.nan)))
  n = int(np.asarray(metrics["mismatch_tokens"])) if "mismatch_tokens" in metrics else None
  if n == 0 or not np.isfinite(mismatch):
    logging.debug("Lag-0 log-prob check: no lag-0 token in the step to version %d, so it "
                  "compared nothing (the engine's weight check still ran; the metrics row says "
                  "lag0_tokens = 0).", version)
    return {"lag0_tokens": 0}
  out = {} if n is None else {"lag0_tokens": n}
  if mismatch > threshold:
    logging.warning(
        "step to version %d: lag-0 tokens' mean |log pi - log mu| = %.3g nats > alarm %.3g: the "
        "sampler may not decode with the weights its tokens are tagged with (or decodes at "
        "another precision).", version, mismatch, threshold)
  return {**out, "lag0_logp_alarm": int(mismatch > threshold)}
