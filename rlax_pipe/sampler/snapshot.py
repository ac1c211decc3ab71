"""Exact snapshot / restore of a `SamplerEngine` (for resuming reproducible runs bit for bit).

A snapshot is split into a JSON-able dict (sequences, page ownership, counters) and a dict of
numpy arrays (KV pools, PRNG key data, running and pending weights), so it can be written without
pickle (`np.savez` + `json`). Restoring into an engine built with the same model, sampler config
and mesh reproduces its future exactly: same tokens, log-probs, versions and timings.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import numpy as np

from rlax_pipe.sampler.config import Request
from rlax_pipe.sampler.engine import SamplerEngine
from rlax_pipe.sampler.scheduler import SequenceState


def _num(x: float) -> float | None:
  return None if math.isnan(x) else float(x)


def _seq_to_dict(s: SequenceState) -> dict:
  r = s.request
  return {
      "uid": s.uid, "max_new": s.max_new, "tokens": list(map(int, s.tokens)),
      "prompt": s.prompt.tolist(), "logprobs": [float(x) for x in s.logprobs],
      "versions": list(map(int, s.versions)), "t_submit": _num(s.t_submit),
      "t_admit": _num(s.t_admit), "t_first_token": _num(s.t_first_token),
      "num_preemptions": s.num_preemptions, "slot": s.slot, "num_cached": s.num_cached,
      "admit_order": s.admit_order,
      "request": {"prompt_tokens": r.prompt_tokens.tolist(), "sample_id": r.sample_id,
                  "group_id": r.group_id, "prompt_index": r.prompt_index,
                  "max_new_tokens": r.max_new_tokens},
  }


def _seq_from_dict(d: dict) -> SequenceState:
  nan = lambda x: math.nan if x is None else x
  rq = dict(d["request"])
  rq["prompt_tokens"] = np.asarray(rq["prompt_tokens"], np.int32)
  return SequenceState(
      uid=d["uid"], request=Request(**rq), prompt=np.asarray(d["prompt"], np.int32),
      max_new=d["max_new"], tokens=list(d["tokens"]), logprobs=list(d["logprobs"]),
      versions=list(d["versions"]), t_submit=nan(d["t_submit"]), t_admit=nan(d["t_admit"]),
      t_first_token=nan(d["t_first_token"]), num_preemptions=d["num_preemptions"],
      slot=d["slot"], num_cached=d["num_cached"], admit_order=d["admit_order"])


def _flat(tree: Any, prefix: str) -> dict[str, np.ndarray]:
  leaves = jax.tree.leaves(jax.device_get(tree))
  return {f"{prefix}{i}": np.asarray(x) for i, x in enumerate(leaves)}


def _unflat(like: Any, arrays: dict[str, np.ndarray], prefix: str) -> Any:
  leaves, treedef = jax.tree.flatten(like)
  new = [jax.device_put(arrays[f"{prefix}{i}"], x.sharding) for i, x in enumerate(leaves)]
  return jax.tree.unflatten(treedef, new)


def snapshot(engine: SamplerEngine) -> tuple[dict, dict[str, np.ndarray]]:
  """Host copy of the engine's whole state.

  Returns:
    (state, arrays): a JSON-able dict and a dict of numpy arrays (KV pools "k"/"v", PRNG key data
    "rng", running weights "params<i>", pending weights "pending<i>" if any; with pending weights
    "params<i>" holds them too, since the running ones will not be used again).
  """
  with engine._lock:  # pylint: disable=protected-access
    pending = engine._pending  # pylint: disable=protected-access
  sched, alloc = engine._sched, engine._alloc  # pylint: disable=protected-access
  next_uid = next(engine._uids)  # pylint: disable=protected-access
  engine._uids = itertools.count(next_uid)  # pylint: disable=protected-access
  state = {
      "version": engine._version,  # pylint: disable=protected-access
      "pending_version": None if pending is None else int(pending[1]),
      "slots": [None if s is None else _seq_to_dict(s) for s in sched.slots],
      "waiting": [_seq_to_dict(s) for s in sched.waiting],
      "admit_counter": sched._admit_counter,  # pylint: disable=protected-access
      "alloc_free": list(alloc._free),  # pylint: disable=protected-access
      "alloc_pages": {str(k): list(v) for k, v in alloc._pages.items()},  # pylint: disable=protected-access
      "next_uid": next_uid,
      "sums": dict(engine._sums), "counts": dict(engine._counts),  # pylint: disable=protected-access
  }
  arrays = {"k": np.asarray(jax.device_get(engine._k)),  # pylint: disable=protected-access
            "v": np.asarray(jax.device_get(engine._v)),  # pylint: disable=protected-access
            "rng": np.asarray(jax.random.key_data(engine._rng))}  # pylint: disable=protected-access
  if pending is None:
    arrays.update(_flat(engine._params, "params"))  # pylint: disable=protected-access
  else:
    # The running weights are never used again (the swap comes before the next decode step),
    # and their buffers may already be released by the weight channel: store the pending ones.
    arrays.update(_flat(pending[0], "pending"))
    arrays.update(_flat(pending[0], "params"))
  return state, arrays


def restore(engine: SamplerEngine, state: dict, arrays: dict[str, np.ndarray]) -> None:
  """Loads a `snapshot` into `engine` (same model, sampler config and mesh).

  Raises:
    ValueError: if the pool shapes or the slot count differ from the snapshot's.
  """
  e = engine
  if arrays["k"].shape != e._k.shape or len(state["slots"]) != len(e._sched.slots):  # pylint: disable=protected-access
    raise ValueError(f"sampler snapshot does not fit this engine: pool {arrays['k'].shape} vs "
                     f"{e._k.shape}, slots {len(state['slots'])} vs {len(e._sched.slots)}.")  # pylint: disable=protected-access
  e._k = jax.device_put(arrays["k"], e._k.sharding)  # pylint: disable=protected-access
  e._v = jax.device_put(arrays["v"], e._v.sharding)  # pylint: disable=protected-access
  e._rng = jax.device_put(jax.random.wrap_key_data(arrays["rng"]), e._rng.sharding)  # pylint: disable=protected-access
  running = e._params  # pylint: disable=protected-access
  e._params, e._version = _unflat(running, arrays, "params"), int(state["version"])  # pylint: disable=protected-access
  e._pending = (None if state["pending_version"] is None else  # pylint: disable=protected-access
                (_unflat(running, arrays, "pending"), int(state["pending_version"])))
  sched, alloc = e._sched, e._alloc  # pylint: disable=protected-access
  sched.slots = [None if d is None else _seq_from_dict(d) for d in state["slots"]]
  sched.waiting.clear()
  sched.waiting.extend(_seq_from_dict(d) for d in state["waiting"])
  sched._admit_counter = int(state["admit_counter"])  # pylint: disable=protected-access
  alloc._free = list(state["alloc_free"])  # pylint: disable=protected-access
  alloc._pages = {int(k): list(v) for k, v in state["alloc_pages"].items()}  # pylint: disable=protected-access
  alloc._owner[:] = -1  # pylint: disable=protected-access
  for uid, pages in alloc._pages.items():  # pylint: disable=protected-access
    alloc._owner[pages] = uid  # pylint: disable=protected-access
  alloc.check()
  e._uids = itertools.count(int(state["next_uid"]))  # pylint: disable=protected-access
  e._sums = {k: float(v) for k, v in state["sums"].items()}  # pylint: disable=protected-access
  e._counts = {k: int(v) for k, v in state["counts"].items()}  # pylint: disable=protected-access
