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

Prompts become ids with `tok.encode_prompt` (raw or chat template); those ids and the sampled
completion ids go to the learner unchanged (no re-tokenisation). Over-long prompts, completions cut
by the length limit and failed verifiers follow `PipelineConfig.grading` (`rlax_pipe.grading`);
verifiers run in worker processes with a hard time limit (`tasks.VerifierPool`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe import grading
from rlax_pipe.pipeline.config import PipelineConfig
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.sampler import Request, SamplerEngine
from rlax_pipe.tasks import base as task_base
from rlax_pipe.tasks.safe_reward import OUTCOMES, RewardStats
from rlax_pipe.tasks.verifier_pool import VerifierPool
from rlax_pipe.types import Rollout, WeightUpdate

# Consecutive over-long prompts after which the task is declared unusable with these settings.
_MAX_FILTERED_IN_A_ROW = 1000


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
    self._round_open = 0  # groups still to start in the current round
    g = cfg.grading
    if engine.cfg.max_seq_len - g.min_completion_tokens < 1:
      raise ValueError(f"SamplerConfig.max_seq_len={engine.cfg.max_seq_len} leaves no prompt "
                       f"token once GradingConfig.min_completion_tokens={g.min_completion_tokens} "
                       "are reserved; raise max_seq_len or lower min_completion_tokens.")
    self.verifier = VerifierPool(task, timeout_s=cfg.reward_timeout_s,
                                 num_workers=g.verifier_workers,
                                 start_method=g.verifier_start_method)
    self._monitor = grading.FailureMonitor(g.max_failure_fraction, g.failure_window)
    self._truncated: set[int] = set()  # sample ids whose prompt was truncated
    self._lock = threading.Lock()      # per-step counters are read from the learner's thread
    self._step_counts = self._zero_counts()

  @property
  def reward_stats(self) -> RewardStats:
    """Outcomes of every verifier call of this worker ("ok", "error", "timeout", "invalid")."""
    return self.verifier.stats

  def close(self) -> None:
    """Ends the verifier processes."""
    self.verifier.close()

  @staticmethod
  def _zero_counts() -> dict[str, int]:
    return dict.fromkeys(("filtered_overlong", "prompts_truncated")
                         + tuple(f"reward_{o}" for o in OUTCOMES), 0)

  def _count(self, key: str, n: int = 1) -> None:
    with self._lock:
      self._step_counts[key] += n

  def pop_metrics(self) -> dict[str, float | int]:
    """Counts since the previous call: `filtered_overlong` (prompts skipped as over-long),
    `prompts_truncated`, `reward_<outcome>` for each verifier outcome, and `reward_failed_frac`
    (failed share of those calls; NaN without any call)."""
    with self._lock:
      counts, self._step_counts = self._step_counts, self._zero_counts()
    calls = sum(counts[f"reward_{o}"] for o in OUTCOMES)
    failed = calls - counts["reward_ok"]
    return {**counts, "reward_failed_frac": failed / calls if calls else float("nan")}

  @property
  def weights_version(self) -> int:
    """Newest version handed to the engine (the engine owns the number)."""
    return self.engine.latest_version

  def install(self, update: WeightUpdate) -> None:
    """Hands newer weights (and their ownership) to the engine; it swaps them in at its next
    step boundary, before any token of a group started from now on is generated."""
    self.engine.update_weights(update)

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

  def _next_prompt(self) -> grading.PreparedPrompt:
    """The next prompt that fits (over-long ones are skipped and counted, or truncated)."""
    c, max_seq_len = self.counters, self.engine.cfg.max_seq_len
    for _ in range(_MAX_FILTERED_IN_A_ROW):
      problem = self.task.problem(c.next_prompt, "train")
      prepared = grading.prepare_prompt(self.tok, problem.prompt, max_seq_len, self.cfg.grading)
      if prepared.ids is not None:
        return prepared
      self._count("filtered_overlong")
      c.next_prompt += 1
    raise ValueError(
        f"{_MAX_FILTERED_IN_A_ROW} prompts in a row of task {getattr(self.task, 'name', '?')!r} "
        f"are longer than max_seq_len={max_seq_len} - min_completion_tokens="
        f"{self.cfg.grading.min_completion_tokens} tokens (the last had "
        f"{prepared.original_length}); raise SamplerConfig.max_seq_len, or set "
        "GradingConfig.prompt_policy='truncate'.")

  def _submit_group(self) -> None:
    c = self.counters
    prepared = self._next_prompt()
    if prepared.truncated:
      self._count("prompts_truncated")
    for _ in range(self.cfg.group_size):
      if prepared.truncated:
        self._truncated.add(c.next_sample)
      self.engine.submit(Request(prompt_tokens=prepared.ids, sample_id=c.next_sample,
                                 group_id=c.next_group, prompt_index=c.next_prompt))
      c.next_sample += 1
    c.next_group += 1
    c.next_prompt += 1

  # ---- work ---------------------------------------------------------------------------------
  def _completion_budget(self, rollout: Rollout) -> int:
    e = self.engine.cfg
    return min(e.max_new_tokens, e.max_seq_len - int(rollout.prompt_tokens.shape[0]))

  def grade_batch(self, rollouts: Sequence[Rollout]) -> list[Rollout]:
    """The rollouts with their rewards: the verifier's (NaN when it failed), then the overlong
    policy; aborted samples are returned ungraded.

    Raises:
      grading.RewardFailureError: when too many recent verifier calls failed.
    """
    live = [r for r in rollouts if r.finish_reason != "aborted"]
    for r in rollouts:
      if r.finish_reason == "aborted":
        self._truncated.discard(r.sample_id)
    items = [(self.task.problem(r.prompt_index, "train"), self.tok.decode(r.completion_tokens))
             for r in live]
    verdicts = self.verifier.grade(items, [r.sample_id for r in live])
    graded = {}
    for r, v in zip(live, verdicts):
      self._count(f"reward_{v.outcome}")
      reward = grading.apply_overlong_policy(v.reward, r, self.cfg.grading,
                                             self._completion_budget(r))
      truncated = r.sample_id in self._truncated
      self._truncated.discard(r.sample_id)
      graded[r.sample_id] = dataclasses.replace(r, reward=float(reward),
                                                prompt_truncated=truncated)
    for r, v in zip(live, verdicts):
      self._monitor.record(v, r.sample_id, self.verifier.task_name)
    return [graded.get(r.sample_id, r) for r in rollouts]

  def grade(self, rollout: Rollout) -> Rollout:
    """`grade_batch` of one rollout."""
    return self.grade_batch([rollout])[0]

  def step(self) -> list[Rollout]:
    """One engine step (admit/prefill as needed + one decode step); returns graded rollouts."""
    return self.grade_batch(self.engine.step())

  def state_dict(self) -> dict:
    """Task-iterator counters, the open round and the in-flight samples whose prompt was
    truncated (JSON-able; the engine saves its own state)."""
    return {"counters": dataclasses.asdict(self.counters), "round_open": self._round_open,
            "truncated": sorted(self._truncated)}

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict`."""
    self.counters = WorkerCounters(**state["counters"])
    self._round_open = int(state["round_open"])
    self._truncated = {int(s) for s in state.get("truncated", ())}
