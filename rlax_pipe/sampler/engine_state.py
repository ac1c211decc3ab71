"""`SamplerEngine.state_dict` / `load_state_dict`: the engine's whole state for an exact resume.

The state is a nested dict of JSON-able values and numpy arrays (`rlax_pipe.run_dir.split_arrays`
writes it as JSON + npz): weights (running and pending, host copies in leaf order), the
engine-level queue, counters and rollouts read back but not yet returned, and per data replica its
scheduler, page allocator, shared prompt entries, KV pools and PRNG key. Dispatches in flight are
read back first (`SamplerEngine.settle`). The device slot state (block tables, positions, active
flags) is not stored: it is a function of the host state and is re-sent in full at the next
dispatch. Restoring into an engine built with the same model, sampler config and mesh reproduces
its future exactly: same tokens, log-probs, versions and timings.

The engine-level host state (queue, counters, group placement, buffered rollouts) is an
`EngineBook` with public fields and its own `state_dict` / `load_state_dict`; the replicas'
parts are read through the scheduler's, allocator's and prompt sharing's `state_dict` methods.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from rlax_pipe.sampler.page_allocator import key_from_json, key_to_json
from rlax_pipe.sampler.scheduler import SequenceState
from rlax_pipe.types import Rollout, WeightUpdate, rollout_from_dict, rollout_to_dict


def _zero_counts() -> dict[str, int]:
  return dict(decode_steps=0, dispatches=0, host_syncs=0, generated_tokens=0,
              live_token_steps=0, finished=0, aborted=0, weight_updates=0)


@dataclasses.dataclass
class EngineBook:
  """`SamplerEngine`'s host bookkeeping above its replicas (mutated by the engine's thread).

  Attributes:
    queue: sequences submitted but not yet handed to a replica (FIFO).
    buffer: rollouts finished by `settle`, returned by the next `step`.
    group_replica: share key (group id, prompt hash) -> [replica index, live members].
    counts: engine-level counters of `SamplerStats` (decode_steps, dispatches, host_syncs,
      generated_tokens, live_token_steps, finished, aborted, weight_updates).
    sums: per-decode-step sums of kv_utilization and kv_page_fill (divided by decode steps in
      `SamplerStats`).
    host_s: seconds of host work in `step` (see `SamplerStats.host_s`).
    launches: dispatches launched (orders the read-backs; not part of the snapshot).
    next_uid: uid of the next submitted sequence.
  """

  queue: collections.deque = dataclasses.field(default_factory=collections.deque)
  buffer: list[Rollout] = dataclasses.field(default_factory=list)
  group_replica: dict[Any, list[int]] = dataclasses.field(default_factory=dict)
  counts: dict[str, int] = dataclasses.field(default_factory=_zero_counts)
  sums: dict[str, float] = dataclasses.field(
      default_factory=lambda: dict(kv_utilization=0.0, kv_page_fill=0.0))
  host_s: float = 0.0
  launches: int = 0
  next_uid: int = 0

  def new_uid(self) -> int:
    """The next sequence uid (0, 1, 2, ...)."""
    uid, self.next_uid = self.next_uid, self.next_uid + 1
    return uid

  def state_dict(self) -> dict:
    """JSON-able snapshot (`launches` excluded: a restored engine starts its ordering anew)."""
    return {"next_uid": self.next_uid, "sums": dict(self.sums), "counts": dict(self.counts),
            "host_s": self.host_s,
            "groups": [[key_to_json(k), v[0], v[1]] for k, v in self.group_replica.items()],
            "queue": [s.to_dict() for s in self.queue],
            "buffer": [rollout_to_dict(r) for r in self.buffer]}

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict` (counters absent from it keep their values)."""
    self.next_uid = int(state["next_uid"])
    self.sums = {k: float(v) for k, v in state["sums"].items()}
    self.counts.update({k: int(v) for k, v in state["counts"].items()})
    self.host_s = float(state["host_s"])
    self.group_replica = {key_from_json(k): [int(a), int(b)] for k, a, b in state["groups"]}
    self.queue.clear()
    self.queue.extend(SequenceState.from_dict(d) for d in state["queue"])
    self.buffer = [rollout_from_dict(d) for d in state["buffer"]]
    self.launches = 0


def _host_leaves(tree: Any) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _place_like(like: Any, leaves: list[np.ndarray]) -> Any:
  flat, treedef = jax.tree.flatten(like)
  if len(leaves) != len(flat):
    raise ValueError(f"sampler state holds {len(leaves)} parameter arrays, the running params "
                     f"{len(flat)}.")
  return jax.tree.unflatten(treedef, [jax.device_put(np.asarray(a), x.sharding)
                                      for a, x in zip(leaves, flat)])


def _replica_state(r) -> dict:
  return {"scheduler": r.sched.state_dict(), "allocator": r.alloc.state_dict(),
          "sharing": r.sharing.state_dict(), "counts": dict(r.counts), "version": r.version,
          "steps_total": r.steps_total,
          "pools": [np.asarray(jax.device_get(p)) for p in r.pools],
          "rng": np.asarray(jax.device_get(r.state.rng_data))}


def state_dict(engine) -> dict:
  """See the module docstring; the engine holds its step lock and has settled."""
  w = engine.weights
  with w.lock:
    running, pending = w.running, w.pending
  return {
      "version": running.version, "params": _host_leaves(running.params),
      "pending": None if pending is None else {
          "version": pending.version, "params": _host_leaves(pending.params)},
      **engine.book.state_dict(),
      "replicas": [_replica_state(r) for r in engine.replicas],
  }


class SamplingKeys:
  """`SamplerEngine`'s sampling PRNG keys as resumable state (a mixin: the engine holds
  `_step_lock` and its data replicas)."""

  def rng_state(self) -> list[np.ndarray]:
    """The sampling PRNG key of every data replica (uint32 key data), read between steps: the
    part of the engine state a resumed threaded run restores (`load_rng_state`), so its random
    stream continues instead of restarting from the seed."""
    with self._step_lock:  # pylint: disable=no-member
      return rng_state(self)

  def load_rng_state(self, keys: list[np.ndarray]) -> None:
    """Sets the data replicas' sampling keys from `rng_state()` output (a shorter list leaves
    the other replicas' keys alone; an extra one is ignored).

    Raises:
      RuntimeError: if a dispatch is in flight.
    """
    with self._step_lock:  # pylint: disable=no-member
      load_rng_state(self, keys)


def rng_state(engine) -> list[np.ndarray]:
  """Key data of every data replica's sampling PRNG key (the engine holds its step lock)."""
  return [np.asarray(jax.device_get(r.state.rng_data)) for r in engine.replicas]


def load_rng_state(engine, keys: list[np.ndarray]) -> None:
  """Sets the first len(keys) replicas' sampling keys (the engine holds its step lock)."""
  for r, data in zip(engine.replicas, keys):
    if r.inflight is not None:
      raise RuntimeError("load_rng_state: a dispatch is in flight; call it between steps.")
    r.state = r.state.replace(rng_data=_rng_data(data, r))


def _rng_data(data, r) -> jax.Array:
  """Key data (as `rng_state` returns it) placed as replica `r`'s slot state holds it."""
  data = np.asarray(data, np.uint32)
  if data.shape != r.state.rng_data.shape:
    raise ValueError(f"sampler PRNG key data has shape {data.shape}; this engine's keys have "
                     f"{r.state.rng_data.shape} (another PRNG implementation?).")
  return jax.device_put(data, r.replicated)


def _check_fits(engine, state: dict) -> None:
  if len(state["replicas"]) != len(engine.replicas):
    raise ValueError(f"sampler state does not fit this engine: {len(state['replicas'])} "
                     f"replicas vs {len(engine.replicas)}.")
  for rs, r in zip(state["replicas"], engine.replicas):
    shapes = [tuple(np.shape(p)) for p in rs["pools"]]
    if shapes != [p.shape for p in r.pools] or len(rs["scheduler"]["slots"]) != len(
        r.sched.slots):
      raise ValueError(f"sampler state does not fit this engine: pool {shapes} vs "
                       f"{[p.shape for p in r.pools]}, slots {len(rs['scheduler']['slots'])} vs "
                       f"{len(r.sched.slots)}.")


def _load_replica(r, rs: dict) -> None:
  r.pools = tuple(jax.device_put(np.asarray(a), p.sharding) for a, p in zip(rs["pools"], r.pools))
  r.state = r.state.replace(rng_data=_rng_data(rs["rng"], r))
  r.sched.load_state_dict(rs["scheduler"])
  r.alloc.load_state_dict(rs["allocator"])
  r.alloc.take_fresh()
  r.sharing.load_state_dict(rs["sharing"])
  r.counts = {k: int(v) for k, v in rs["counts"].items()}
  r.version, r.steps_total, r.inflight = int(rs["version"]), int(rs["steps_total"]), None
  r.mark_all_dirty()


def load_state_dict(engine, state: dict) -> None:
  """See the module docstring; weights are copied onto this engine's shardings and owned by it.

  Raises:
    ValueError: if the replica count, a pool shape, the slot count or the parameter count
      differ from this engine's.
  """
  e = engine
  _check_fits(e, state)
  like = e.weights.running.params
  running = WeightUpdate(int(state["version"]), _place_like(like, state["params"]), True)
  pending = state.get("pending")
  if pending is not None:
    pending = WeightUpdate(int(pending["version"]), _place_like(like, pending["params"]), True)
  e.weights.replace_all(running, pending)
  for r, rs in zip(e.replicas, state["replicas"]):
    _load_replica(r, rs)
  e.book.load_state_dict(state)
