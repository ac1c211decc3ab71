"""The sampler replicas of other processes, seen by the lead's `RolloutWorker` as its engine.

The lead runs the one `RolloutWorker` of the job (task iterator, prompt preparation, grading,
the drivers' rules) and the one `RolloutQueue` (staleness admission and policies), unchanged: so
admission sees the in-flight groups of every replica, group and sample ids come from one counter
(no duplicates), and a checkpoint holds the whole pipeline state. The worker's engine is a
`RemoteEngines`: before each top-up the lead points it at one replica (`target`), so the worker's
slot and version rules read that replica's numbers (its slots, the requests it holds, the newest
weights version it reported) and its `submit`s go to that replica (sent by `flush`). A group's
samples all go to the same replica (they share prompt pages there).

What the lead knows about a replica lags by one message: its version is a lower bound (versions
only grow, so admitting a group at it is conservative), its outstanding requests an upper bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import numpy as np

from rlax_pipe.cluster import Hub, Topology
from rlax_pipe.sampler import Request, SamplerConfig
from rlax_pipe.types import Rollout, WeightUpdate
from rlax_pipe.pipeline.multihost import messages


@dataclasses.dataclass
class ReplicaState:
  """The lead's view of one replica.

  Attributes:
    process_id: its process.
    slots: its decode slots (all its data replicas).
    version: newest weights version it reported (handed to its engine).
    outstanding: sample id -> group id of requests sent and not returned.
    to_send: requests submitted since the last `flush`.
    rng: its sampling keys as last reported (uint32 key data per data replica), for checkpoints.
  """

  process_id: int
  slots: int
  version: int = -1
  outstanding: dict[int, int] = dataclasses.field(default_factory=dict)
  to_send: list[Request] = dataclasses.field(default_factory=list)
  rng: list | None = None


class RemoteEngines:
  """Engine interface over the replicas (see the module docstring); used on the lead's sampler
  thread, except `rng_state` and the read-only properties (any thread).

  Args:
    hub: the lead's links.
    topology: the job.
    cfg: the sampler config every replica runs (per data replica `num_slots`).
    slots: replica index -> its decode slots.
    version: the learner's version at start (a lower bound: each replica's first is newer).
    saved_rng: a checkpoint's "sampler_rng" (the replicas' keys; None: fresh), for `initial_rng`.
  """

  def __init__(self, hub: Hub, topology: Topology, cfg: SamplerConfig, slots: dict[int, int],
               version: int = -1, saved_rng: Any = None):
    self._hub, self.topology, self._cfg = hub, topology, cfg
    self.replicas = {r: ReplicaState(topology.replica_process(r), int(slots[r]), version)
                     for r in range(topology.num_replicas)}
    self._saved_rng = saved_rng
    self._target: int | None = None
    self.holder: dict[int, int] = {}  # sample id -> replica (until trained or discarded)
    self._finished: list[Rollout] = []  # returned, not yet handed out by `step`

  # ---- what the worker reads -------------------------------------------------------------------
  @contextlib.contextmanager
  def target(self, replica: int) -> Iterator[None]:
    """Within the block the engine interface means replica `replica`."""
    self._target = replica
    try:
      yield
    finally:
      self._target = None

  def _scope(self) -> list[ReplicaState]:
    return list(self.replicas.values()) if self._target is None else [
        self.replicas[self._target]]

  @property
  def cfg(self) -> SamplerConfig:
    """The sampler config, with `num_slots` = the slots in scope."""
    return dataclasses.replace(self._cfg, num_slots=self.num_slots)

  @property
  def num_slots(self) -> int:
    return sum(s.slots for s in self._scope())

  @property
  def num_active(self) -> int:
    """Requests sent to (and not returned by) the replicas in scope."""
    return sum(len(s.outstanding) + len(s.to_send) for s in self._scope())

  @property
  def num_waiting(self) -> int:
    return 0

  @property
  def has_work(self) -> bool:
    return self.num_active > 0

  @property
  def latest_version(self) -> int:
    """Newest weights version reported by the replica in scope (all: the oldest of them)."""
    return min(s.version for s in self._scope())

  def submit(self, request: Request) -> None:
    """Queues `request` for the targeted replica (sent by `flush`); outside a `target` block,
    a sample that was sent before (a re-dispatch of a lost sample) goes to the replica that
    had it, where its group's prompt pages are."""
    replica = self.holder.get(int(request.sample_id)) if self._target is None else self._target
    if replica is None:
      raise RuntimeError("RemoteEngines.submit outside a target(replica) block.")
    state = self.replicas[replica]
    state.to_send.append(request)
    state.outstanding[int(request.sample_id)] = int(request.group_id)
    self.holder[int(request.sample_id)] = replica

  def abort(self, sample_id: int) -> Rollout | None:
    """Asks the replica holding `sample_id` to abort it; its aborted Rollout comes back with the
    replica's next rollouts (so this returns None)."""
    replica = self.holder.get(int(sample_id))
    if replica is not None:
      self._hub.send(self.replicas[replica].process_id,
                     *messages.wire(messages.Abort((int(sample_id),))))
    return None

  def step(self) -> list[Rollout]:
    """The rollouts the replicas sent back since the last call (booked by `returned`; the
    replicas step themselves, on their own processes)."""
    out, self._finished = self._finished, []
    return out

  def update_weights(self, update: WeightUpdate) -> None:
    """Refused: the lead holds no replica weights (each replica fetches its versions from the
    learner's `LearnerSender` through the `WeightCoordinator`).

    Raises:
      TypeError: always, naming the route to use instead.
    """
    raise TypeError(f"RemoteEngines.update_weights(version {update.version}): replicas of a "
                    "multi-process job take new versions from the learner's LearnerSender "
                    "(push the update there); the lead's proxy holds no weights.")

  def unfinished(self) -> dict[int, int | None]:
    """Sample ids sent and not returned (their oldest token version is not known here)."""
    return {sid: None for s in self.replicas.values() for sid in s.outstanding}

  # ---- the lead's bookkeeping ------------------------------------------------------------------
  def flush(self, replica: int) -> None:
    """Sends the queued requests of `replica`."""
    state = self.replicas[replica]
    batch, state.to_send = state.to_send, []
    if batch:
      self._hub.send(state.process_id, *messages.wire(messages.Submit(tuple(batch))))

  def returned(self, replica: int, rollouts: list[Rollout], status: dict) -> None:
    """Books finished (or aborted) rollouts (handed out by the next `step`) and the replica's
    status message (its version, and its rng keys when sent)."""
    state = self.replicas[replica]
    for r in rollouts:
      state.outstanding.pop(int(r.sample_id), None)
    self._finished.extend(rollouts)
    if "version" in status:
      state.version = max(state.version, int(status["version"]))
    if status.get("rng") is not None:
      state.rng = status["rng"]

  def forget(self, sample_ids) -> dict[int, int]:
    """Drops trained samples from `holder`; returns sample id -> replica for them."""
    return {int(s): self.holder.pop(int(s), -1) for s in sample_ids}

  # ---- checkpointed state ----------------------------------------------------------------------
  def rng_state(self) -> dict:
    """{"replicas": [keys of replica 0, ...]} as last reported (None for a replica that has not
    reported yet), for the checkpoint."""
    return {"replicas": [None if s.rng is None else [np.asarray(k, np.uint32).tolist()
                                                     for k in s.rng]
                         for _, s in sorted(self.replicas.items())]}

  def initial_rng(self, replica: int) -> list | None:
    """The keys replica `replica` starts from on a resume: its own saved ones when the earlier
    run had that replica, else {"derive_from": the first saved keys} (`replica.replica_keys`
    derives its keys from them and its index, never from the seed); None without saved keys."""
    state = self._saved_rng
    if not state:
      return None
    saved = state.get("replicas", []) if isinstance(state, dict) else [state]
    if replica < len(saved) and saved[replica] is not None:
      return saved[replica]
    base = next((k for k in saved if k is not None), None)
    return None if base is None else {"derive_from": base, "replica": replica}
