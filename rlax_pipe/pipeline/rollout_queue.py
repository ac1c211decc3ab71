"""In-memory rollout queue: groups finished samples and applies the staleness policy.

The sampler `put`s every finished `Rollout` (aborted ones too, with finish_reason "aborted"); a
group is ready once all `group_size` samples arrived. The learner `get_batch`es the oldest ready
groups. Under policy `block` the sampler asks `try_admit` before starting a group. The staleness
decisions are the pure functions of `staleness.py`; this class only adds storage, a lock and a
condition variable. Use it threaded (`get_batch` with a timeout) or from one thread in a
deterministic interleaving (`try_get_batch`).

"Oldest" means smallest oldest-token policy version, ties broken by the order in which groups
became ready (FIFO).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any

import numpy as np

from rlax_pipe.pipeline import staleness
from rlax_pipe.types import Rollout

Group = tuple[Rollout, ...]


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


@dataclasses.dataclass(frozen=True)
class _Ready:
  seq: int
  oldest_version: int
  rollouts: Group

  @property
  def key(self) -> tuple[int, int]:
    return (self.oldest_version, self.seq)


def _tokens(rollouts) -> int:
  return int(sum(r.num_completion_tokens for r in rollouts))


def _oldest(rollouts) -> int:
  return min(r.oldest_version() for r in rollouts)


def rollout_to_dict(r: Rollout) -> dict[str, Any]:
  """Plain dict of a Rollout (numpy arrays copied), for queue state and resume."""
  return {f.name: (np.array(getattr(r, f.name)) if isinstance(getattr(r, f.name), np.ndarray)
                   else getattr(r, f.name)) for f in dataclasses.fields(Rollout)}


def rollout_from_dict(d: dict[str, Any]) -> Rollout:
  """Inverse of `rollout_to_dict`; token arrays are restored as int32 / float32."""
  kw = dict(d)
  for name, dtype in (("prompt_tokens", np.int32), ("completion_tokens", np.int32),
                      ("behavior_logprobs", np.float32), ("policy_versions", np.int32)):
    kw[name] = np.asarray(kw[name], dtype=dtype)
  return Rollout(**kw)


def _check_format(state: dict[str, Any]) -> None:
  if state.get("format") != 1:
    raise ValueError(f"RolloutQueue state: unknown format {state.get('format')!r} (expected 1).")


class RolloutQueue:
  """Thread-safe queue of finished rollout groups with a staleness policy.

  Example (deterministic, one thread):
    q = RolloutQueue(StalenessConfig("block", max_lag=1, groups_per_step=2), group_size=4)
    if q.try_admit(group_id=0, sampler_version=0): ...start 4 samples of group 0...
    q.put(rollout)                                  # for each finished sample
    batch = q.try_get_batch(2, learner_version=0)   # None until 2 fresh groups are ready
  """

  def __init__(self, config: staleness.StalenessConfig, group_size: int):
    """Creates an empty queue.

    Args:
      config: staleness policy and bound.
      group_size: samples per prompt group (>= 1).

    Raises:
      ValueError: if group_size < 1.
    """
    if group_size < 1:
      raise ValueError(f"RolloutQueue: group_size={group_size} must be >= 1.")
    self._config, self._group_size = config, group_size
    self._cond = threading.Condition()
    self._partial: dict[int, list[Rollout]] = {}
    self._ready: list[_Ready] = []
    self._abandoned: dict[int, int] = {}  # group id -> samples still expected
    self._seq = 0
    self._learner_version = 0
    self._last_batch_version = -1  # version the newest handed-out batch is trained at
    self._admission = staleness.admission_init()
    self._waste = staleness.WasteCounters()
    self._trained = [0, 0, 0]  # groups, samples, tokens
    self._closed = False

  @property
  def config(self) -> staleness.StalenessConfig:
    """The staleness config."""
    return self._config

  # ------------------------------------------------------------------ sampler side

  def try_admit(self, group_id: int, sampler_version: int) -> bool:
    """Asks to start prompt group `group_id` with the sampler's current weights version.

    Under `block` and `learner-wait` this applies `staleness.can_admit`; other policies always
    admit. Admitted
    groups are tracked so that the bound holds and waits can report what is in flight.

    Returns:
      True if the group was admitted (start it now), False if it must wait.

    Raises:
      ValueError: if `group_id` is already live.
    """
    with self._cond:
      nxt = self._next_train_version_locked()
      if not staleness.can_admit(self._admission, sampler_version, self._config, nxt):
        return False
      self._admission = staleness.admission_admit(
          self._admission, group_id, sampler_version, self._config, nxt)
      return True

  def admission_headroom(self, sampler_version: int) -> int | None:
    """How many more groups may be admitted now (None = unlimited)."""
    with self._cond:
      return staleness.admission_headroom(self._admission, sampler_version, self._config,
                                          self._next_train_version_locked())

  def put(self, rollout: Rollout, learner_version: int | None = None) -> None:
    """Adds one finished sample; completes, drops or holds its group.

    A complete group is discarded if any sample was aborted (reason "aborted"), if no sample has a
    reward (all NaN: failed verifiers or masked samples; reason "unscored"), or if its oldest
    token is already too stale for the newest known learner version (reason "stale"; that can
    only get worse). Under queue-drop, the oldest ready groups beyond capacity are then dropped
    (reason "overflow").

    Args:
      rollout: a finished sample.
      learner_version: the learner's current version if the caller knows it (else the newest
        version seen by `get_batch` / `set_learner_version` is used).

    Raises:
      ValueError: if the group already holds a sample with the same sample_id.
    """
    with self._cond:
      if learner_version is not None:
        self._learner_version = max(self._learner_version, learner_version)
      gid = rollout.group_id
      if gid in self._abandoned:
        self._waste = staleness.count_waste(self._waste, "aborted", 0, 1,
                                            rollout.num_completion_tokens)
        self._abandoned[gid] -= 1
        if self._abandoned[gid] <= 0:
          del self._abandoned[gid]
        return
      members = self._partial.setdefault(gid, [])
      if any(r.sample_id == rollout.sample_id for r in members):
        raise ValueError(f"RolloutQueue.put: sample {rollout.sample_id} of group {gid} was "
                         "already put.")
      members.append(rollout)
      if len(members) < self._group_size:
        return
      group = tuple(sorted(self._partial.pop(gid), key=lambda r: r.sample_id))
      if any(r.finish_reason == "aborted" for r in group):
        self._discard([group], "aborted")
      elif all(math.isnan(r.reward) for r in group):
        self._discard([group], "unscored")  # no baseline and nothing to train
      elif staleness.is_too_stale(_oldest(group), self._learner_version, self._config.max_lag):
        self._discard([group], "stale")
      else:
        self._ready.append(_Ready(self._seq, _oldest(group), group))
        self._seq += 1
        overflow = staleness.queue_overflow(len(self._ready), self._config.queue_capacity_groups)
        if overflow:
          self._ready.sort(key=lambda g: g.key)
          victims, self._ready = self._ready[:overflow], self._ready[overflow:]
          self._discard([g.rollouts for g in victims], "overflow")
      self._cond.notify_all()

  def discard_group(self, group_id: int) -> None:
    """Abandons a group (e.g. its samples were aborted and will not all be put).

    Samples already received are counted as aborted waste; samples of it put later are counted
    and ignored. Admission is released.
    """
    with self._cond:
      members = self._partial.pop(group_id, [])
      for i, g in enumerate(self._ready):
        if g.rollouts[0].group_id == group_id:
          members = list(self._ready.pop(i).rollouts)
          break
      self._waste = staleness.count_waste(self._waste, "aborted", 1, len(members),
                                          _tokens(members))
      remaining = self._group_size - len(members)
      if remaining > 0:
        self._abandoned[group_id] = remaining
      self._retire([group_id], trained=False)
      self._cond.notify_all()

  # ------------------------------------------------------------------ learner side

  def set_learner_version(self, learner_version: int) -> None:
    """Tells the queue the learner's version (used by put-time drops)."""
    with self._cond:
      self._learner_version = max(self._learner_version, learner_version)

  def try_get_batch(self, num_groups: int, learner_version: int) -> list[Group] | None:
    """Non-blocking `get_batch`: the batch, or None if not enough fresh groups are ready."""
    self._check_num_groups(num_groups)
    with self._cond:
      return self._try_get_locked(num_groups, learner_version)

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
      `learner-wait` it waits while a due group (`staleness.due_groups`) is still in flight,
      puts due groups first, and returns more than `num_groups` groups when more are due.

    Raises:
      QueueTimeout: after `timeout`; the message gives groups wanted / ready / partially
        finished / in flight.
      QueueClosed: if the queue is closed.
      ValueError: if a token's version is newer than `learner_version`, or num_groups is
        invalid.
    """
    self._check_num_groups(num_groups)
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      while True:
        batch = self._try_get_locked(num_groups, learner_version)
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
              f"(policy {self._config.policy}, max_lag {self._config.max_lag}).")
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
          learner_version=self._learner_version, waste=self._waste)

  # ------------------------------------------------------------------ resume

  def state_dict(self) -> dict[str, Any]:
    """Plain-dict state (config, counters, admission, pending rollouts as numpy) for resume."""
    with self._cond:
      return {
          "format": 1,
          "config": dataclasses.asdict(self._config),
          "group_size": self._group_size,
          "seq": self._seq,
          "learner_version": self._learner_version,
          "last_batch_version": self._last_batch_version,
          "trained": list(self._trained),
          "waste": dataclasses.asdict(self._waste),
          "admission": staleness.admission_to_dict(self._admission),
          "ready": [{"seq": g.seq, "rollouts": [rollout_to_dict(r) for r in g.rollouts]}
                    for g in self._ready],
          "partial": [[rollout_to_dict(r) for r in m] for m in self._partial.values()],
          "abandoned": [[g, n] for g, n in self._abandoned.items()],
      }

  @classmethod
  def from_state_dict(cls, state: dict[str, Any],
                      config: staleness.StalenessConfig | None = None) -> RolloutQueue:
    """A new queue holding `state_dict()` output.

    Args:
      state: the dict.
      config: overrides the stored staleness config (e.g. a changed max_lag on resume).

    Raises:
      ValueError: on an unknown state format.
    """
    _check_format(state)
    q = cls(config or staleness.StalenessConfig(**state["config"]), int(state["group_size"]))
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
      self._load_locked(state)

  def _load_locked(self, state: dict[str, Any]) -> None:
    self._ready, self._partial = [], {}
    self._seq = int(state["seq"])
    self._learner_version = int(state["learner_version"])
    self._last_batch_version = int(state.get("last_batch_version", -1))
    self._trained = [int(x) for x in state["trained"]]
    self._waste = staleness.WasteCounters(**{k: int(v) for k, v in state["waste"].items()})
    self._admission = staleness.admission_from_dict(state["admission"])
    for g in state["ready"]:
      rollouts = tuple(rollout_from_dict(d) for d in g["rollouts"])
      self._ready.append(_Ready(int(g["seq"]), _oldest(rollouts), rollouts))
    for members in state["partial"]:
      rs = [rollout_from_dict(d) for d in members]
      self._partial[rs[0].group_id] = rs
    self._abandoned = {int(g): int(n) for g, n in state["abandoned"]}

  # ------------------------------------------------------------------ internals

  def _check_num_groups(self, num_groups: int):
    cap = self._config.queue_capacity_groups
    if num_groups < 1 or (cap is not None and num_groups > cap):
      raise ValueError(
          f"RolloutQueue: num_groups={num_groups} must be >= 1"
          + (f" and <= queue_capacity_groups={cap}." if cap is not None else "."))

  def _next_train_version_locked(self) -> int:
    """Smallest version the learner's next batch can be trained at."""
    return max(self._learner_version, self._last_batch_version + 1)

  def _in_flight_locked(self) -> int:
    ready_ids = {g.rollouts[0].group_id for g in self._ready}
    return sum(1 for gid, _ in self._admission.live if gid not in ready_ids)

  def _retire(self, group_ids, trained: bool):
    live = {g for g, _ in self._admission.live}
    ids = [g for g in group_ids if g in live]
    if ids:
      self._admission = staleness.admission_retire(self._admission, ids, trained)

  def _discard(self, groups: list[Group], reason: str):
    for group in groups:
      self._waste = staleness.count_waste(self._waste, reason, 1, len(group), _tokens(group))
    self._retire([g[0].group_id for g in groups], trained=False)

  def _try_get_locked(self, num_groups: int, learner_version: int) -> list[Group] | None:
    self._learner_version = max(self._learner_version, learner_version)
    self._ready.sort(key=lambda g: g.key)
    fresh, stale = staleness.partition_by_staleness(
        [g.oldest_version for g in self._ready], learner_version, self._config.max_lag)
    if stale:
      self._discard([self._ready[i].rollouts for i in stale], "stale")
      self._ready = [self._ready[i] for i in fresh]
      self._cond.notify_all()
    due = staleness.due_groups(self._admission, learner_version, self._config)
    if due:  # learner-wait: every due group must be ready and in this batch, else wait
      ready_ids = {g.rollouts[0].group_id for g in self._ready}
      if any(gid not in ready_ids for gid in due):
        return None
      first = set(due)
      self._ready.sort(key=lambda g: (g.rollouts[0].group_id not in first, g.key))
      num_groups = max(num_groups, len(due))
    if len(self._ready) < num_groups:
      return None
    groups = [g.rollouts for g in self._ready[:num_groups]]
    for group in groups:
      for r in group:
        if r.policy_versions.size and int(r.policy_versions.max()) > learner_version:
          raise ValueError(
              f"RolloutQueue.get_batch: sample {r.sample_id} has a token of version "
              f"{int(r.policy_versions.max())} > learner_version {learner_version}; pass the "
              "version the batch will be trained at.")
    self._ready = self._ready[num_groups:]
    self._last_batch_version = max(self._last_batch_version, learner_version)
    self._retire([g[0].group_id for g in groups], trained=True)
    self._trained[0] += len(groups)
    self._trained[1] += sum(len(g) for g in groups)
    self._trained[2] += sum(_tokens(g) for g in groups)
    return groups
