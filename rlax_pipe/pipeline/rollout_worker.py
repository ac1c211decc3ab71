"""Sampler side of a run: feeds prompt groups to the engine, grades finished samples, queues them.

The worker owns the task iterator (prompt, group and sample counters, restorable from a
checkpoint) and applies the driver's rule for when new groups may start and when new weights may
be installed:

- "pipeline": keep every decode slot busy (new groups are submitted while no more than one
  group's worth of requests would wait for a slot, and the staleness admission allows it); install
  new weights at any decode-step boundary.
- "async-batch": generate in rounds of `groups_per_step` groups; weights are installed only
  between rounds (so no sample mixes versions).
- "sync": rounds too, and round r starts only once the weights of version r (trained on rounds
  0..r-1) are installed, so every token has lag 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.pipeline.config import PipelineConfig
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.sampler import Request, SamplerEngine
from rlax_pipe.tasks import base as task_base
from rlax_pipe.tasks.safe_reward import RewardStats, safe_reward
from rlax_pipe.types import Rollout


@dataclasses.dataclass
class WorkerCounters:
  """Task-iterator state (checkpointed): the next prompt index, group id and sample id, and the
  number of generation rounds started (round-based drivers)."""

  next_prompt: int = 0
  next_group: int = 0
  next_sample: int = 0
  rounds_started: int = 0


class RolloutWorker:
  """Feeds the sampler engine and grades its output (thin host-side shell; no device math).

  Args:
    engine: the sampler engine (on the sampler mesh).
    task: task that provides training prompts and grades completions.
    tok: tokenizer.
    queue: rollout queue (staleness admission and storage).
    cfg: pipeline configuration.
    counters: restored task-iterator state, or None to start from the beginning.
  """

  def __init__(self, engine: SamplerEngine, task: task_base.Task, tok: tokenizer_lib.Tokenizer,
               queue: RolloutQueue, cfg: PipelineConfig, counters: WorkerCounters | None = None):
    self.engine, self.task, self.tok, self.queue, self.cfg = engine, task, tok, queue, cfg
    self.counters = counters or WorkerCounters()
    self.reward_stats = RewardStats()
    self.weights_version = engine.version  # newest version handed to the engine
    self._round_open = 0  # groups still to start in the current round

  def install(self, params, version: int) -> None:
    """Hands newer weights to the engine; it swaps them in at its next decode-step boundary,
    before any token of a group started from now on is generated."""
    self.engine.update_weights(params, version)
    self.weights_version = int(version)

  # ---- rules --------------------------------------------------------------------------------
  def may_install_weights(self) -> bool:
    """Whether new weights may be installed now (pipeline: always; rounds: between rounds)."""
    return self.cfg.driver == "pipeline" or not self.engine.has_work

  def _free_slots(self) -> int:
    e = self.engine
    return e.num_slots - e.num_active - e.num_waiting

  def top_up(self) -> int:
    """Starts as many new prompt groups as the driver's rule and the admission policy allow.

    Returns:
      Number of groups started.
    """
    cfg, c = self.cfg, self.counters
    if cfg.driver != "pipeline" and self._round_open == 0:
      if self.engine.has_work:
        return 0
      if cfg.driver == "sync" and self.weights_version < c.rounds_started:
        return 0  # wait for the weights trained on the previous round
      c.rounds_started += 1
      self._round_open = cfg.groups_per_step
    started = 0
    while True:
      if cfg.driver == "pipeline" and self._free_slots() < 0:
        break  # one group may wait beyond the slots, so a freed slot refills at the next step
      if cfg.driver != "pipeline" and self._round_open == 0:
        break
      if not self.queue.try_admit(c.next_group, self.weights_version):
        break
      self._submit_group()
      started += 1
      if cfg.driver != "pipeline":
        self._round_open -= 1
    return started

  def _submit_group(self) -> None:
    c = self.counters
    problem = self.task.problem(c.next_prompt, "train")
    prompt = np.asarray(self.tok.encode(problem.prompt, add_bos=True), np.int32)
    for _ in range(self.cfg.group_size):
      self.engine.submit(Request(prompt_tokens=prompt, sample_id=c.next_sample,
                                 group_id=c.next_group, prompt_index=c.next_prompt))
      c.next_sample += 1
    c.next_group += 1
    c.next_prompt += 1

  # ---- work ---------------------------------------------------------------------------------
  def grade(self, rollout: Rollout) -> Rollout:
    """Returns the rollout with its reward (0.0 for aborted samples or failing verifiers)."""
    if rollout.finish_reason == "aborted":
      return rollout
    problem = self.task.problem(rollout.prompt_index, "train")
    text = self.tok.decode(rollout.completion_tokens)
    reward = safe_reward(self.task, problem, text, sample_id=rollout.sample_id,
                         timeout_s=self.cfg.reward_timeout_s, stats=self.reward_stats)
    return dataclasses.replace(rollout, reward=float(reward))

  def step(self) -> list[Rollout]:
    """One engine step (admit/prefill as needed + one decode step); returns graded rollouts."""
    return [self.grade(r) for r in self.engine.step()]

  def state_dict(self) -> dict:
    return dataclasses.asdict(self.counters)
