"""`SamplerEngine.state_dict` / `load_state_dict`: the engine's whole state for an exact resume.

The state is a nested dict of JSON-able values and numpy arrays (`rlax_pipe.run_dir.split_arrays`
writes it as JSON + npz): weights (running and pending, host copies in leaf order), the
engine-level queue, counters and rollouts read back but not yet returned, and per data replica its
scheduler, page allocator, shared prompt entries, KV pools and PRNG key. Dispatches in flight are
read back first (`SamplerEngine.settle`). The device slot state (block tables, positions, active
flags) is not stored: it is a function of the host state and is re-sent in full at the next
dispatch. Restoring into an engine built with the same model, sampler config and mesh reproduces
its future exactly: same tokens, log-probs, versions and timings.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import numpy as np

from rlax_pipe.sampler.page_allocator import key_from_json, key_to_json
from rlax_pipe.sampler.scheduler import SequenceState
from rlax_pipe.types import WeightUpdate, rollout_from_dict, rollout_to_dict

# pylint: disable=protected-access  (the engine's own state, kept out of engine.py for size)


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
  e, w = engine, engine.weights
  with w.lock:
    running, pending = w.running, w.pending
  next_uid = next(e._uids)
  e._uids = itertools.count(next_uid)
  return {
      "version": running.version, "params": _host_leaves(running.params),
      "pending": None if pending is None else {
          "version": pending.version, "params": _host_leaves(pending.params)},
      "next_uid": next_uid, "sums": dict(e._sums), "counts": dict(e._counts),
      "host_s": e._host_s,
      "groups": [[key_to_json(k), v[0], v[1]] for k, v in e._group_replica.items()],
      "queue": [s.to_dict() for s in e._queue],
      "buffer": [rollout_to_dict(r) for r in e._buffer],
      "replicas": [_replica_state(r) for r in e.replicas],
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
  e._uids = itertools.count(int(state["next_uid"]))
  e._sums = {k: float(v) for k, v in state["sums"].items()}
  e._counts.update({k: int(v) for k, v in state["counts"].items()})
  e._host_s = float(state["host_s"])
  e._group_replica = {key_from_json(k): [int(a), int(b)] for k, a, b in state["groups"]}
  e._queue.clear()
  e._queue.extend(SequenceState.from_dict(d) for d in state["queue"])
  e._buffer = [rollout_from_dict(d) for d in state["buffer"]]
  e._launches = 0
