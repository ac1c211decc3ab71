"""In-memory rollout queue: groups finished samples and applies the staleness policy.

The sampler asks `try_admit` before starting a group and `put`s every finished `Rollout`
(aborted ones too); a group is ready once all `group_size` samples arrived, and the learner
`get_batch`es the oldest ready groups. The staleness decisions are the pure functions of
`staleness.py`; this class only adds storage, a lock and a condition variable. Use it threaded
(`get_batch` with a timeout) or from one thread in a deterministic interleaving (`try_get_batch`).
Lost and duplicated samples (issue #14 item 9) and dynamic sampling: see `put`, `missing_samples`
and `discard_group`.

"Oldest" means smallest oldest-token policy version, ties broken by the order in which groups
became ready (FIFO). Ready groups sit in a heap keyed by (oldest version, arrival), so an event
costs O(log n) in the number of ready groups, plus the admission's (`staleness.AdmissionLedger`).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import threading
import time
from typing import Any, Iterable

from rlax_pipe.pipeline import group_filter as group_filter_lib
from rlax_pipe.pipeline import staleness
from rlax_pipe.types import Rollout, rollout_from_dict, rollout_to_dict

Group = tuple[Rollout, ...]


_COMPLETE_KEPT = 1 << 14


class QueueTimeout(TimeoutError):
  """`get_batch` ran out of time; the message says what was awaited."""


class QueueClosed(RuntimeError):
  """The queue was closed while (or before) waiting."""


@dataclasses.dataclass(frozen=True)
class QueueStats:
  """A snapshot of the queue.

  Attributes:
    ready_groups: complete groups waiting for the learner.
    partial_groups: groups with some but not all samples finished.
    in_flight_groups: admitted (via `try_admit`) groups not yet complete.
    admitted_groups: groups admitted via `try_admit`, ever.
    trained_groups, trained_samples, trained_tokens: handed to the learner (completion tokens).
    learner_version: newest learner version the queue has been told about.
    waste: discarded work, by reason.
    rejected_samples: samples `put` rejected (not stored).
    filter_kept_groups: zero-variance groups kept and trained at the filter's bound
      (`group_filter`); 0 with the filter off.

  Every count is cumulative since the run started (kept across a resume), not per learner step.
  """

  ready_groups: int
  partial_groups: int
  in_flight_groups: int
  admitted_groups: int
  trained_groups: int
  trained_samples: int
  trained_tokens: int
  learner_version: int
  waste: staleness.WasteCounters
  rejected_samples: int = 0
  filter_kept_groups: int = 0


@dataclasses.dataclass(frozen=True, order=True)
class _Ready:
  """A complete group waiting for the learner, ordered oldest first (then by arrival)."""

  oldest_version: int
  seq: int
  rollouts: Group = dataclasses.field(compare=False)


def _tokens(rollouts) -> int:
  return int(sum(r.num_completion_tokens for r in rollouts))


def _oldest(rollouts) -> int:
  return min(r.oldest_version() for r in rollouts)


def _check_format(state: dict[str, Any]) -> None:
  if state.get("format") not in (1, 2):
    raise ValueError(f"RolloutQueue state: unknown format {state.get('format')!r} (expected 2).")


class RolloutQueue:
  """Thread-safe queue of finished rollout groups with a staleness policy.

  Example (deterministic, one thread):
    q = RolloutQueue(StalenessConfig("block", max_lag=1, groups_per_step=2), group_size=4)
    if q.try_admit(group_id=0, sampler_version=0, sample_ids=range(4)): ...start the samples...
    q.put(rollout)                                  # for each finished sample
    batch = q.try_get_batch(2, learner_version=0)   # None until 2 fresh groups are ready
  """

  def __init__(self, config: staleness.StalenessConfig, group_size: int,
               group_filter: group_filter_lib.GroupFilterConfig | None = None):
    """Creates an empty queue.

    Args:
      config: staleness policy and bound.
      group_size: samples per prompt group (>= 1).
      group_filter: dynamic sampling (None = off: every complete scored group is trained).

    Raises:
      ValueError: if group_size < 1.
    """
    if group_size < 1:
      raise ValueError(f"RolloutQueue: group_size={group_size} must be >= 1.")
    self._config, self._group_size = config, group_size
    self._filter = group_filter or group_filter_lib.GroupFilterConfig()
    self._cond = threading.Condition()  # over an RLock: methods holding it call each other
    self._reset()

  def _reset(self) -> None:
    self._partial: dict[int, list[Rollout]] = {}
    self._ready: dict[int, _Ready] = {}          # group id -> ready group
    self._heap: list[_Ready] = []                # the ready groups (lazy deletion)
    self._abandoned: dict[int, tuple[int, str]] = {}  # group id -> (samples expected, reason)
    self._expected: dict[int, tuple[int, ...]] = {}  # live group id -> its sample ids
    # Groups that were ready, trained or discarded: the newest _COMPLETE_KEPT of them, so a late
    # duplicate is rejected instead of reopening its group.
    self._complete: dict[int, None] = {}
    self._seq = 0
    self._learner_version = 0
    self._last_batch_version = -1  # version the newest handed-out batch is trained at
    self._admission = staleness.AdmissionLedger()
    self._waste = staleness.WasteCounters()
    self._trained = [0, 0, 0]  # groups, samples, tokens
    self._rejected = 0
    self._filtered_since_batch = 0  # groups the filter dropped since the last batch
    self._filter_kept = 0           # zero-variance groups kept at the filter's bound
    self._closed = False

  @property
  def config(self) -> staleness.StalenessConfig:
    """The staleness config."""
    return self._config

  def filtered_groups(self) -> int:
    """Groups dropped by the filter so far (waste reason "filtered"; O(1), for the worker's
    replacement rule `rules.reopen_filtered`)."""
    with self._cond:
      return self._waste.filtered_groups

  # ------------------------------------------------------------------ sampler side

  def try_admit(self, group_id: int, sampler_version: int,
                sample_ids: Iterable[int] | None = None) -> bool:
    """Asks to start prompt group `group_id` with the sampler's current weights version.

    Under `block` and `learner-wait` this applies `staleness.admission_headroom`; other policies
    always admit. Admitted groups are tracked so that the bound holds and waits can report what
    is in flight.

    Args:
      group_id: the group.
      sampler_version: the version the sampler decodes with now.
      sample_ids: the group's sample ids (so that missing and foreign samples can be named);
        None = not tracked.

    Returns:
      True if the group was admitted (start it now), False if it must wait.

    Raises:
      ValueError: if `group_id` is already live, or `sample_ids` has not `group_size` ids.
    """
    ids = None if sample_ids is None else tuple(int(i) for i in sample_ids)
    if ids is not None and len(ids) != self._group_size:
      raise ValueError(f"RolloutQueue.try_admit: group {group_id} has {len(ids)} sample ids, "
                       f"group_size is {self._group_size}.")
    with self._cond:
      nxt = self.next_train_version()
      if not self._admission.can_admit(sampler_version, self._config, nxt):
        return False
      self._admission.admit(group_id, sampler_version, self._config, nxt)
      if ids is not None:
        self._expected[group_id] = ids
      return True

  def next_train_version(self) -> int:
    """Smallest version the learner's next batch can be trained at."""
    with self._cond:
      return max(self._learner_version, self._last_batch_version + 1)

  def put(self, rollout: Rollout, learner_version: int | None = None) -> bool:
    """Adds one finished sample; completes, drops or holds its group.

    A complete group is discarded if any sample was aborted (reason "aborted"), if no sample has a
    reward (all NaN: failed verifiers or masked samples; reason "unscored"), or if its oldest
    token is already too stale for the newest known learner version (reason "stale"; that can
    only get worse), or if the dynamic-sampling filter drops it (reason "filtered",
    `group_filter.should_drop`, which releases its admission so the sampler admits a replacement;
    at the filter's bound a zero-variance group is kept and counted in `filter_kept_groups`).
    Under queue-drop, the oldest ready groups beyond capacity are then dropped (reason "overflow").

    Args:
      rollout: a finished sample.
      learner_version: the learner's current version if the caller knows it (else the newest
        version seen by `get_batch` / `set_learner_version` is used).

    Returns:
      False when the sample was rejected (a duplicate, a sample of a complete group, i.e. ready,
      trained or discarded, or not one of its group's admitted sample ids): counted in
      `rejected_samples`, never fatal and never reopening its group. True otherwise.
    """
    with self._cond:
      if learner_version is not None:
        self._learner_version = max(self._learner_version, learner_version)
      gid = rollout.group_id
      if gid in self._abandoned:
        left, reason = self._abandoned[gid]
        self._waste = staleness.count_waste(self._waste, reason, 0, 1,
                                            rollout.num_completion_tokens)
        if left > 1:
          self._abandoned[gid] = (left - 1, reason)
        else:
          del self._abandoned[gid]
        return True
      members = self._partial.get(gid, [])
      expected = self._expected.get(gid)
      if (gid in self._complete or any(r.sample_id == rollout.sample_id for r in members)
          or (expected is not None and rollout.sample_id not in expected)):
        self._rejected += 1
        return False
      self._partial[gid] = members
      members.append(rollout)
      if len(members) < self._group_size:
        return True
      group = tuple(sorted(self._partial.pop(gid), key=lambda r: r.sample_id))
      self._mark_complete(gid)
      if any(r.finish_reason == "aborted" for r in group):
        self._discard([group], "aborted")
      elif all(math.isnan(r.reward) for r in group):
        self._discard([group], "unscored")  # no baseline and nothing to train
      elif staleness.is_too_stale(_oldest(group), self._learner_version, self._config.max_lag):
        self._discard([group], "stale")
      elif group_filter_lib.should_drop(self._filter, [r.reward for r in group],
                                        self._filtered_since_batch):
        self._discard([group], "filtered")
        self._filtered_since_batch += 1
      else:
        if group_filter_lib.matches(self._filter, [r.reward for r in group]):
          self._filter_kept += 1  # at the bound: trained with zero advantage
        self._push_ready(_Ready(_oldest(group), self._seq, group))
        self._seq += 1
        overflow = staleness.queue_overflow(len(self._ready), self._config.queue_capacity_groups)
        if overflow:
          self._discard([self._pop_oldest().rollouts for _ in range(overflow)], "overflow")
      self._cond.notify_all()
      return True

  def missing_samples(self, group_id: int) -> list[int] | None:
    """Sample ids of a live group that have not been put (None when its ids are not known)."""
    with self._cond:
      expected = self._expected.get(group_id)
      if expected is None:
        return None
      arrived = {r.sample_id for r in self._partial.get(group_id, ())}
      return [i for i in expected if i not in arrived]

  def discard_group(self, group_id: int, reason: str = "aborted") -> None:
    """Abandons a group (its samples were aborted, are too stale, or were lost).

    Samples already received are counted as waste of `reason`; samples of it put later are
    counted the same way and ignored. Admission is released.

    Raises:
      ValueError: if `reason` is not a waste reason.
    """
    if reason not in staleness.WASTE_REASONS:
      raise ValueError(f"discard_group: reason {reason!r} not in {staleness.WASTE_REASONS}.")
    with self._cond:
      members = self._partial.pop(group_id, [])
      if group_id in self._ready:
        members = list(self._ready.pop(group_id).rollouts)
      self._waste = staleness.count_waste(self._waste, reason, 1, len(members),
                                          _tokens(members))
      remaining = self._group_size - len(members)
      if remaining > 0 and group_id not in self._complete:
        self._abandoned[group_id] = (remaining, reason)
      self._mark_complete(group_id)
      self._retire([group_id], trained=False)
      self._cond.notify_all()

  # ------------------------------------------------------------------ learner side

  def set_learner_version(self, learner_version: int) -> None:
    """Tells the queue the learner's version (used by put-time drops)."""
    with self._cond:
      self._learner_version = max(self._learner_version, learner_version)

  def try_get_batch(self, num_groups: int, learner_version: int) -> list[Group] | None:
    """Non-blocking `get_batch`: the batch, or None if not enough fresh groups are ready."""
    cap = self._config.queue_capacity_groups
    if num_groups < 1 or (cap is not None and num_groups > cap):
      raise ValueError(
          f"RolloutQueue: num_groups={num_groups} must be >= 1"
          + (f" and <= queue_capacity_groups={cap}." if cap is not None else "."))
    with self._cond:
      self._learner_version = max(self._learner_version, learner_version)
      stale = []
      while (g := self._peek_oldest()) is not None and staleness.is_too_stale(
          g.oldest_version, learner_version, self._config.max_lag):
        stale.append(self._pop_oldest().rollouts)
      if stale:
        self._discard(stale, "stale")
        self._cond.notify_all()
      due = self._admission.due(learner_version, self._config)
      if any(gid not in self._ready for gid in due):
        return None  # learner-wait: every due group must be ready and in this batch
      take = staleness.batch_size(len(self._ready), len(due), num_groups)
      if take is None:
        return None
      chosen = sorted(self._ready.pop(gid) for gid in due)
      while len(chosen) < take:
        chosen.append(self._pop_oldest())
      for g in chosen:
        for r in g.rollouts:
          if r.policy_versions.size and int(r.policy_versions.max()) > learner_version:
            for h in chosen:  # put everything back: the failed get loses nothing
              self._push_ready(h)
            raise ValueError(
                f"RolloutQueue.get_batch: sample {r.sample_id} has a token of version "
                f"{int(r.policy_versions.max())} > learner_version {learner_version}; pass the "
                "version the batch will be trained at.")
      groups = [g.rollouts for g in chosen]
      self._last_batch_version = max(self._last_batch_version, learner_version)
      self._filtered_since_batch = 0
      self._retire([g[0].group_id for g in groups], trained=True)
      self._trained[0] += len(groups)
      self._trained[1] += sum(len(g) for g in groups)
      self._trained[2] += sum(_tokens(g) for g in groups)
      return groups

  def get_batch(self, num_groups: int, learner_version: int,
                timeout: float | None = None) -> list[Group]:
    """Waits for and returns the `num_groups` oldest ready groups.

    Ready groups whose oldest token would have lag > max_lag at `learner_version` are dropped
    first (reason "stale"), so no returned token has lag > max_lag.

    Args:
      num_groups: groups wanted (>= 1).
      learner_version: the version the batch will be trained at (current version plus any
        prefetch depth).
      timeout: seconds to wait (None = until enough groups or `close`).

    Returns:
      `num_groups` groups, oldest first; each group's samples sorted by sample_id. Under
      `learner-wait` it waits while a due group (`staleness.due_bound`) is still in flight,
      puts due groups first, and returns more than `num_groups` groups when more are due.

    Raises:
      QueueTimeout: after `timeout`; the message gives groups wanted / ready / partially
        finished / in flight, and names samples that have not arrived.
      QueueClosed: if the queue is closed.
      ValueError: if a token's version is newer than `learner_version`, or num_groups is
        invalid.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      while True:
        batch = self.try_get_batch(num_groups, learner_version)
        if batch is not None:
          return batch
        if self._closed:
          raise QueueClosed("RolloutQueue.get_batch: the queue was closed.")
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          raise QueueTimeout(
              f"RolloutQueue.get_batch: waited {timeout} s for {num_groups} groups at learner "
              f"version {learner_version}: {len(self._ready)} ready, {len(self._partial)} "
              f"partially finished, {self._in_flight_locked()} admitted and not finished "
              f"(policy {self._config.policy}, max_lag {self._config.max_lag})"
              f"{self._missing_text_locked(learner_version)}.")
        self._cond.wait(left)

  def close(self) -> None:
    """Wakes every waiter with `QueueClosed`."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  # ------------------------------------------------------------------ inspection

  def stats(self) -> QueueStats:
    """A consistent snapshot of counters and sizes."""
    with self._cond:
      return QueueStats(
          ready_groups=len(self._ready), partial_groups=len(self._partial),
          in_flight_groups=self._in_flight_locked(),
          admitted_groups=self._admission.num_admitted, trained_groups=self._trained[0],
          trained_samples=self._trained[1], trained_tokens=self._trained[2],
          learner_version=self._learner_version, waste=self._waste,
          rejected_samples=self._rejected, filter_kept_groups=self._filter_kept)

  # ------------------------------------------------------------------ resume

  def state_dict(self) -> dict[str, Any]:
    """Plain-dict state (config, counters, admission, pending rollouts as numpy) for resume."""
    with self._cond:
      ready = sorted(self._ready.values())
      return {
          "format": 2,
          "config": dataclasses.asdict(self._config),
          "group_size": self._group_size,
          "seq": self._seq,
          "learner_version": self._learner_version,
          "last_batch_version": self._last_batch_version,
          "trained": list(self._trained),
          "rejected": self._rejected,
          "filtered_since_batch": self._filtered_since_batch,
          "filter_kept": self._filter_kept,
          "waste": dataclasses.asdict(self._waste),
          "admission": self._admission.to_dict(),
          "expected": [[g, list(ids)] for g, ids in self._expected.items()],
          "ready": [{"seq": g.seq, "rollouts": [rollout_to_dict(r) for r in g.rollouts]}
                    for g in ready],
          "partial": [[rollout_to_dict(r) for r in m] for m in self._partial.values()],
          "abandoned": [[g, n, reason] for g, (n, reason) in self._abandoned.items()],
          "complete": list(self._complete),
      }

  @classmethod
  def from_state_dict(cls, state: dict[str, Any],
                      config: staleness.StalenessConfig | None = None,
                      group_filter: group_filter_lib.GroupFilterConfig | None = None
                      ) -> RolloutQueue:
    """A new queue holding `state_dict()` output.

    Args:
      state: the dict.
      config: overrides the stored staleness config (e.g. a changed max_lag on resume).
      group_filter: the dynamic-sampling filter (not stored in the state; None = off).

    Raises:
      ValueError: on an unknown state format.
    """
    _check_format(state)
    q = cls(config or staleness.StalenessConfig(**state["config"]), int(state["group_size"]),
            group_filter)
    q.load_state_dict(state)
    return q

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Replaces this queue's contents and counters by `state_dict()` output (this queue keeps
    its own staleness config and group size).

    Raises:
      ValueError: on an unknown state format.
    """
    _check_format(state)
    with self._cond:
      self._reset()
      self._seq = int(state["seq"])
      self._learner_version = int(state["learner_version"])
      self._last_batch_version = int(state.get("last_batch_version", -1))
      self._trained = [int(x) for x in state["trained"]]
      self._rejected = int(state.get("rejected", 0))
      self._filtered_since_batch = int(state.get("filtered_since_batch", 0))
      self._filter_kept = int(state.get("filter_kept", 0))
      self._waste = staleness.WasteCounters(**{k: int(v) for k, v in state["waste"].items()})
      self._admission = staleness.AdmissionLedger.from_dict(state["admission"])
      self._expected = {int(g): tuple(int(i) for i in ids)
                        for g, ids in state.get("expected", [])}
      for g in state["ready"]:
        rollouts = tuple(rollout_from_dict(d) for d in g["rollouts"])
        self._push_ready(_Ready(_oldest(rollouts), int(g["seq"]), rollouts))
      for members in state["partial"]:
        rs = [rollout_from_dict(d) for d in members]
        self._partial[rs[0].group_id] = rs
      self._abandoned = {int(e[0]): (int(e[1]), e[2] if len(e) > 2 else "aborted")
                         for e in state["abandoned"]}
      self._complete = dict.fromkeys(int(g) for g in state.get("complete", ()))

  # ------------------------------------------------------------------ internals

  def _in_flight_locked(self) -> int:
    return self._admission.num_live - sum(map(self._admission.is_live, self._ready))

  def _mark_complete(self, gid: int) -> None:
    self._expected.pop(gid, None)
    self._complete[gid] = None
    if len(self._complete) > _COMPLETE_KEPT:
      del self._complete[next(iter(self._complete))]

  def _push_ready(self, g: _Ready) -> None:
    self._ready[g.rollouts[0].group_id] = g
    heapq.heappush(self._heap, g)

  def _peek_oldest(self) -> _Ready | None:
    while self._heap:
      g = self._heap[0]
      if self._ready.get(g.rollouts[0].group_id) is g:
        return g
      heapq.heappop(self._heap)
    return None

  def _pop_oldest(self) -> _Ready:
    g = self._peek_oldest()
    heapq.heappop(self._heap)
    return self._ready.pop(g.rollouts[0].group_id)

  def _retire(self, group_ids, trained: bool):
    self._admission.retire([g for g in group_ids if self._admission.is_live(g)], trained)

  def _discard(self, groups: list[Group], reason: str):
    for group in groups:
      self._waste = staleness.count_waste(self._waste, reason, 1, len(group), _tokens(group))
    self._retire([g[0].group_id for g in groups], trained=False)

  def _missing_text_locked(self, learner_version: int) -> str:
    waiting = self._admission.due(learner_version, self._config) or [
        g for g, _ in self._admission.live()[:8] if g not in self._ready]
    names = [f"group {gid}: samples {self.missing_samples(gid)}"
             for gid in waiting[:4] if gid in self._expected]
    return ("; not arrived: " + ", ".join(names)) if names else ""
