"""Sampler side of a run: feeds prompt groups to the engine, grades finished samples, queues them.

The worker owns the task iterator (prompt, group and sample counters, restorable from a
checkpoint) and applies the driver's rules for when new groups may start and when new weights may
be installed: the pure functions of `rules.py` (shared with the simulator) and the staleness
admission of the queue. It keeps every sample it handed to the engine until the queue has it, so
that one lost in the engine or on its way to the queue (grading, a transport between processes)
is named and handled (`check_lost`; issue #14 item 9, issue #27 item 2: under `drop` and
`queue-drop` nothing else would ever wait for it). Under policy `drop` it aborts groups in flight
that are already too stale (`abort_too_stale`).

Prompts become ids with `tok.encode_prompt` (raw or chat template); those ids and the sampled
completion ids go to the learner unchanged (no re-tokenisation). Over-long prompts, reasoning
blocks (the verifier sees the text after them), completions cut by the length limit and failed
verifiers follow `PipelineConfig.grading` (`rlax_pipe.grading`);
verifiers run in worker processes with a hard time limit (`tasks.VerifierPool`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Sequence

from absl import logging
import numpy as np

from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe import grading
from rlax_pipe.pipeline import rules
from rlax_pipe.pipeline import staleness
from rlax_pipe.pipeline.config import PipelineConfig
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.sampler import Request, SamplerEngine
from rlax_pipe.tasks import base as task_base
from rlax_pipe.tasks.safe_reward import OUTCOMES
from rlax_pipe.tasks.verifier_pool import VerifierPool
from rlax_pipe.types import Rollout

# Consecutive over-long prompts after which the task is declared unusable with these settings.
_MAX_FILTERED_IN_A_ROW = 1000
# The counts `pop_metrics` returns (see there).
_COUNTS = ("filtered_overlong", "prompts_truncated", "samples_lost", "samples_redispatched",
           "groups_lost", "groups_aborted_stale") + tuple(f"reward_{o}" for o in OUTCOMES)


@dataclasses.dataclass
class WorkerCounters:
  """Task-iterator state (checkpointed): the next prompt index, group id and sample id, the
  number of generation rounds started (round-based drivers) and the number of groups dropped by
  the queue's dynamic-sampling filter that the worker has re-opened (`rules.reopen_filtered`)."""

  next_prompt: int = 0
  next_group: int = 0
  next_sample: int = 0
  rounds_started: int = 0
  filtered_reopened: int = 0


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
    g.prompt_budget(engine.cfg.max_seq_len)  # raises on settings that leave no prompt budget
    self._reasoning_markers = grading.resolve_reasoning_markers(tok, g)
    self.verifier = VerifierPool(task, timeout_s=cfg.reward_timeout_s,
                                 num_workers=g.verifier_workers)
    self._monitor = grading.FailureMonitor(g.max_failure_fraction, g.failure_window)
    self._truncated: set[int] = set()  # sample ids whose prompt was truncated
    self._lock = threading.Lock()      # counters (learner thread), _truncated (grader thread)
    self._step_counts = dict.fromkeys(_COUNTS, 0)
    # Requests handed to the engine and not returned: sample id -> (group id, prompt index,
    # prompt ids); checked against the engine for lost samples.
    self._outstanding: dict[int, tuple[int, int, Any]] = {}
    self._detached: set[int] = set()  # given-up samples the engine may still be running
    # Samples the engine handed back, not yet seen in the queue: sample id -> (group id, prompt
    # index, prompt ids, time handed back), oldest first (checked once, at delivery_limit_s).
    self._in_transit: collections.OrderedDict[int, tuple[int, int, Any, float]] = (
        collections.OrderedDict())
    self._stale_checked_version = -1

  def close(self) -> None:
    """Ends the verifier processes."""
    self.verifier.close()

  def _count(self, key: str, n: int = 1) -> None:
    with self._lock:
      self._step_counts[key] += n

  def pop_metrics(self) -> dict[str, float | int]:
    """Counts since the previous call: `filtered_overlong` (prompts skipped as over-long),
    `prompts_truncated`, `reward_<outcome>` for each verifier outcome, `reward_failed_frac`
    (failed share of those calls; NaN without any call), `samples_lost` (requests the engine no
    longer held that never came back), `samples_redispatched`, `groups_lost` (discarded for a
    lost sample) and `groups_aborted_stale` (policy drop, in flight)."""
    with self._lock:
      counts, self._step_counts = self._step_counts, dict.fromkeys(_COUNTS, 0)
    calls = sum(counts[f"reward_{o}"] for o in OUTCOMES)
    failed = calls - counts["reward_ok"]
    return {**counts, "reward_failed_frac": failed / calls if calls else float("nan")}

  # ---- rules --------------------------------------------------------------------------------
  def may_update_weights(self) -> bool:
    """Whether the engine may receive new weights now (`rules.may_update_weights`)."""
    return rules.may_update_weights(self.cfg.driver, self.engine.has_work)

  def top_up(self) -> int:
    """Starts as many new prompt groups as the driver's rule (`rules.begin_top_up`,
    `rules.may_start_group`) and the admission policy allow; round-based drivers first re-open
    the groups the queue's filter dropped since the last call (`rules.reopen_filtered`).

    Returns:
      Number of groups started.
    """
    cfg, c, e = self.cfg, self.counters, self.engine
    state = rules.RoundState(c.rounds_started, self._round_open)
    filtered = self.queue.filtered_groups()
    state = rules.reopen_filtered(cfg.driver, state, filtered - c.filtered_reopened)
    c.filtered_reopened = filtered
    state, ok = rules.begin_top_up(cfg.driver, state, has_work=e.has_work,
                                   weights_version=e.latest_version,
                                   groups_per_step=cfg.groups_per_step)
    started = 0
    while ok and rules.may_start_group(cfg.driver, state,
                                       e.num_slots - e.num_active - e.num_waiting):
      ids = range(c.next_sample, c.next_sample + cfg.group_size)
      if not self.queue.try_admit(c.next_group, e.latest_version, sample_ids=ids):
        break
      self._submit_group()
      state = rules.group_started(cfg.driver, state)
      started += 1
    c.rounds_started, self._round_open = state.rounds_started, state.round_open
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
    g = self.cfg.grading
    raise ValueError(
        f"{_MAX_FILTERED_IN_A_ROW} prompts in a row of task {getattr(self.task, 'name', '?')!r} "
        f"are longer than the prompt budget of {g.prompt_budget(max_seq_len)} tokens "
        f"(max_seq_len={max_seq_len} - min_completion_tokens={g.min_completion_tokens}, "
        f"GradingConfig.max_prefill_len={g.max_prefill_len}; the last had "
        f"{prepared.original_length}); raise SamplerConfig.max_seq_len or max_prefill_len, or "
        "set GradingConfig.prompt_policy='truncate'.")

  def _submit_group(self) -> None:
    c = self.counters
    prepared = self._next_prompt()
    if prepared.truncated:
      self._count("prompts_truncated")
      with self._lock:
        self._truncated.update(range(c.next_sample, c.next_sample + self.cfg.group_size))
    for _ in range(self.cfg.group_size):
      self._submit(c.next_sample, c.next_group, c.next_prompt, prepared.ids)
      c.next_sample += 1
    c.next_group += 1
    c.next_prompt += 1

  def _submit(self, sample_id: int, group_id: int, prompt_index: int, ids) -> None:
    self.engine.submit(Request(prompt_tokens=ids, sample_id=sample_id, group_id=group_id,
                               prompt_index=prompt_index))
    self._outstanding[sample_id] = (group_id, prompt_index, ids)

  # ---- lost and too-stale samples -----------------------------------------------------------
  def check_lost(self, now: float | None = None,
                 delivery_limit_s: float | None = None) -> list[int]:
    """Finds lost samples and handles them by `PipelineConfig.lost_sample_policy`
    (re-dispatch: same sample id and prompt; discard: the group is waste of reason "lost").

    Two kinds, under every staleness policy: requests the engine no longer holds that it never
    handed back (O(1) unless some are missing), and samples it handed back that are still not
    in the queue `delivery_limit_s` after (lost between the engine and the queue; each sample
    is looked at once, when it reaches that age).

    Args:
      now: the current time on the clock `engine_step` was given (seconds; None =
        `time.monotonic()`).
      delivery_limit_s: seconds a handed-back sample may take to reach the queue (grading
        included) before it counts as lost (> 0); None = no delivery check.

    Returns:
      The lost sample ids (sorted), re-dispatched or discarded with their group.

    Raises:
      ValueError: if `delivery_limit_s` is not > 0.
    """
    lost = self._lost_in_engine()
    if delivery_limit_s is not None:
      if not delivery_limit_s > 0:
        raise ValueError(f"RolloutWorker.check_lost: delivery_limit_s={delivery_limit_s} must "
                         "be > 0.")
      lost.update(self._lost_in_transit(time.monotonic() if now is None else now,
                                        delivery_limit_s))
    if not lost:
      return []
    self._count("samples_lost", len(lost))
    groups = {}
    for sid in sorted(lost):
      groups.setdefault(lost[sid][0], []).append(sid)
    named = "; ".join(f"group {gid}: samples {sids} ({lost[sids[0]][3]})"
                      for gid, sids in groups.items())
    logging.warning("rollout worker: lost samples, %s (%s).", named,
                    self.cfg.lost_sample_policy)
    for gid, sids in groups.items():
      if self.cfg.lost_sample_policy == "redispatch":
        for sid in sids:
          _, prompt_index, ids, _ = lost[sid]
          self._submit(sid, gid, prompt_index, ids)
        self._count("samples_redispatched", len(sids))
      else:
        self._abandon_group(gid, "lost")
        self._count("groups_lost")
    return sorted(lost)

  def _lost_in_engine(self) -> dict[int, tuple]:
    """Requests the engine no longer holds and never handed back: sample id -> (group id,
    prompt index, prompt ids, where lost)."""
    e = self.engine
    if e.num_active + e.num_waiting - len(self._detached) >= len(self._outstanding):
      return {}
    held = e.unfinished()
    self._detached &= held.keys()
    return {sid: (*self._outstanding.pop(sid), "never came back from the engine")
            for sid in [s for s in self._outstanding if s not in held]}

  def next_delivery_deadline(self, delivery_limit_s: float) -> float | None:
    """When `check_lost` will name the oldest handed-back sample the queue still waits for
    (time it left the engine + `delivery_limit_s`), or None when the queue waits for none of
    them; for a driver that would otherwise stop (reproducible mode, where time only moves when
    something is due) and for `check_lost`. Amortised O(1): delivered samples are forgotten."""
    while self._in_transit:
      sid, (gid, _, _, t) = next(iter(self._in_transit.items()))
      if sid in (self.queue.missing_samples(gid) or ()):
        return t + delivery_limit_s
      del self._in_transit[sid]  # delivered (or its group is no longer waited for)
    return None

  def _lost_in_transit(self, now: float, limit_s: float) -> dict[int, tuple]:
    """Samples handed back by the engine that the queue still waits for at their
    `next_delivery_deadline` (`limit_s` after) and `now` is past it: sample id -> (group id,
    prompt index, prompt ids, where lost)."""
    lost = {}
    while (deadline := self.next_delivery_deadline(limit_s)) is not None and now >= deadline:
      sid, (gid, prompt_index, ids, t) = self._in_transit.popitem(last=False)
      lost[sid] = (gid, prompt_index, ids, f"left the engine {now - t:.3g} s ago, not in the "
                   f"queue after {limit_s:.3g} s")
    return lost

  def abort_too_stale(self) -> int:
    """Policy `drop`: aborts groups in flight whose oldest token is already too stale for the
    learner's next batch (they could never be trained). Checked once per learner version.

    Returns:
      Number of groups aborted.
    """
    st = self.queue.config
    if st.policy != "drop" or st.max_lag is None:
      return 0
    version = self.queue.next_train_version()
    if version == self._stale_checked_version:
      return 0
    self._stale_checked_version = version
    doomed = {self._outstanding[sid][0] for sid, oldest in self.engine.unfinished().items()
              if oldest is not None and sid in self._outstanding
              and staleness.is_too_stale(oldest, version, st.max_lag)}
    for gid in sorted(doomed):
      self._abandon_group(gid, "stale")
      self._count("groups_aborted_stale")
    return len(doomed)

  def _abandon_group(self, gid: int, reason: str) -> None:
    """Gives up a group: the queue counts it (and its late samples) as waste of `reason`; its
    requests still in the engine are aborted when the engine can abort one request, else they
    run on detached (no longer outstanding; counted by the queue when they finish)."""
    self.queue.discard_group(gid, reason)
    abort = getattr(self.engine, "abort", None)
    for sid in [s for s, (g, _, _) in self._outstanding.items() if g == gid]:
      del self._outstanding[sid]
      if abort is None:
        self._detached.add(sid)
        continue
      rollout = abort(sid)
      if rollout is not None:
        self.queue.put(rollout)

  # ---- work ---------------------------------------------------------------------------------
  def _completion_budget(self, rollout: Rollout) -> int:
    e = self.engine.cfg
    return min(e.max_new_tokens, e.max_seq_len - int(rollout.prompt_tokens.shape[0]))

  def grade_batch(self, rollouts: Sequence[Rollout]) -> list[Rollout]:
    """The rollouts with their rewards: the verifier's (NaN when it failed), then the overlong
    policy; aborted samples are returned ungraded. Thread-safe with respect to the sampler
    thread (the threaded driver grades on a grader thread).

    Raises:
      grading.RewardFailureError: when too many recent verifier calls failed.
    """
    live = [r for r in rollouts if r.finish_reason != "aborted"]
    with self._lock:  # an aborted sample is returned ungraded: forget its prompt's truncation
      self._truncated.difference_update(r.sample_id for r in rollouts
                                        if r.finish_reason == "aborted")
    items = [(self.task.problem(r.prompt_index, "train"),
              grading.completion_for_grading(self.tok, r.prompt_tokens, r.last_turn_tokens,
                                             self._reasoning_markers))  # episode: last turn
             for r in live]
    verdicts = self.verifier.grade(items, [r.sample_id for r in live])
    graded = {}
    for r, v in zip(live, verdicts):
      self._count(f"reward_{v.outcome}")
      reward = grading.apply_overlong_policy(v.reward, r, self.cfg.grading,
                                             self._completion_budget(r))
      with self._lock:
        truncated = r.sample_id in self._truncated
        self._truncated.discard(r.sample_id)
      graded[r.sample_id] = dataclasses.replace(r, reward=float(reward),
                                                prompt_truncated=truncated)
    for r, v in zip(live, verdicts):
      self._monitor.record(v, r.sample_id, self.verifier.task_name)
    return [graded.get(r.sample_id, r) for r in rollouts]

  def engine_step(self, now: float | None = None) -> list[Rollout]:
    """One engine step (admit / prefill as needed + decoding); returns the ungraded rollouts
    that finished (the threaded driver grades them off the sampler's serial path).

    Args:
      now: the time they left the engine (seconds, the clock `check_lost` is given; None =
        `time.monotonic()`), from which their delivery to the queue is timed.
    """
    finished = self.engine.step()
    self.returned(finished, now)
    return finished

  def returned(self, rollouts: Sequence[Rollout], now: float | None = None) -> None:
    """Books rollouts the engine handed back (`engine_step` does; a multi-process lead, whose
    engine is the remote replicas, calls it on their messages): no longer outstanding, and in
    transit to the queue from `now` (seconds, the clock `check_lost` is given; None =
    `time.monotonic()`)."""
    now = time.monotonic() if now is None else now
    for r in rollouts:
      entry = self._outstanding.pop(r.sample_id, None)
      self._detached.discard(r.sample_id)
      if entry is not None:
        self._in_transit.pop(r.sample_id, None)
        self._in_transit[r.sample_id] = (*entry, now)

  def step(self, now: float | None = None) -> list[Rollout]:
    """`engine_step`, then `grade_batch` of what finished."""
    return self.grade_batch(self.engine_step(now))

  def state_dict(self) -> dict:
    """Task-iterator counters, the open round, the in-flight samples whose prompt was truncated
    and the requests in the engine (JSON-able; the engine saves its own state)."""
    with self._lock:
      truncated = sorted(self._truncated)
    return {"counters": dataclasses.asdict(self.counters), "round_open": self._round_open,
            "truncated": truncated,
            "outstanding": [[sid, g, p, [int(t) for t in ids]]
                            for sid, (g, p, ids) in list(self._outstanding.items())],
            "detached": sorted(self._detached),
            "in_transit": [[sid, g, p, [int(x) for x in ids], t]
                           for sid, (g, p, ids, t) in list(self._in_transit.items())]}

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict`."""
    self.counters = WorkerCounters(**state["counters"])
    self._round_open = int(state["round_open"])
    self._truncated = {int(s) for s in state.get("truncated", ())}
    self._outstanding = {int(sid): (int(g), int(p), np.asarray(ids, np.int32))
                         for sid, g, p, ids in state.get("outstanding", ())}
    self._detached = {int(s) for s in state.get("detached", ())}
    self._in_transit = collections.OrderedDict(
        (int(sid), (int(g), int(p), np.asarray(ids, np.int32), float(t)))
        for sid, g, p, ids, t in state.get("in_transit", ()))
