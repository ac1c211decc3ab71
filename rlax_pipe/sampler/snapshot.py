"""Exact snapshot / restore of a `SamplerEngine` (for resuming reproducible runs bit for bit).

A snapshot is split into a JSON-able dict (sequences, page ownership, shared prompt entries,
counters) and a dict of numpy arrays (KV pools, PRNG key data of every replica, running and
pending weights), so it can be written without pickle (`np.savez` + `json`). The device slot
state (block tables, positions, active flags) is not stored: it is a function of the host state
and is re-sent in full at the next dispatch. Restoring into an engine built with the same model,
sampler config and mesh reproduces its future exactly: same tokens, log-probs, versions, timings.
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
from rlax_pipe.sampler.page_allocator import _key_from_json, _key_to_json
from rlax_pipe.sampler.prompt_sharing import PromptEntry
from rlax_pipe.sampler.scheduler import SequenceState
from rlax_pipe.types import Rollout

# pylint: disable=protected-access


def _num(x: float) -> float | None:
  return None if math.isnan(x) else float(x)


def _seq_to_dict(s: SequenceState) -> dict:
  r = s.request
  return {
      "uid": s.uid, "max_new": s.max_new, "budget": s.budget, "tokens": list(map(int, s.tokens)),
      "prompt": s.prompt.tolist(), "logprobs": [float(x) for x in s.logprobs],
      "versions": list(map(int, s.versions)), "t_submit": _num(s.t_submit),
      "t_admit": _num(s.t_admit), "t_first_token": _num(s.t_first_token),
      "num_preemptions": s.num_preemptions, "slot": s.slot, "num_cached": s.num_cached,
      "admit_order": s.admit_order, "share_key": _key_to_json(s.share_key),
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
      max_new=d["max_new"], budget=d["budget"], tokens=list(d["tokens"]),
      logprobs=list(d["logprobs"]), versions=list(d["versions"]), t_submit=nan(d["t_submit"]),
      t_admit=nan(d["t_admit"]), t_first_token=nan(d["t_first_token"]),
      num_preemptions=d["num_preemptions"], slot=d["slot"], num_cached=d["num_cached"],
      admit_order=d["admit_order"], share_key=_key_from_json(d["share_key"]))


def _rollout_to_dict(r: Rollout) -> dict:
  d = dataclasses.asdict(r)
  return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in d.items()}


def _rollout_from_dict(d: dict) -> Rollout:
  d = dict(d)
  for k, dtype in (("prompt_tokens", np.int32), ("completion_tokens", np.int32),
                   ("behavior_logprobs", np.float32), ("policy_versions", np.int32)):
    d[k] = np.asarray(d[k], dtype)
  return Rollout(**d)


def _flat(tree: Any, prefix: str) -> dict[str, np.ndarray]:
  leaves = jax.tree.leaves(jax.device_get(tree))
  return {f"{prefix}{i}": np.asarray(x) for i, x in enumerate(leaves)}


def _unflat(like: Any, arrays: dict[str, np.ndarray], prefix: str) -> Any:
  leaves, treedef = jax.tree.flatten(like)
  new = [jax.device_put(arrays[f"{prefix}{i}"], x.sharding) for i, x in enumerate(leaves)]
  return jax.tree.unflatten(treedef, new)


def _replica_state(r) -> tuple[dict, dict[str, np.ndarray]]:
  sched, sharing = r.sched, r.sharing
  state = {
      "slots": [None if s is None else _seq_to_dict(s) for s in sched.slots],
      "waiting": [_seq_to_dict(s) for s in sched.waiting],
      "admit_counter": sched._admit_counter,
      "alloc": r.alloc.state_dict(),
      "entries": [[_key_to_json(k), _key_to_json(e.holder), e.num_tokens, list(e.full_pages),
                   e.partial_page, e.version] for k, e in sharing.entries.items()],
      "members": [[_key_to_json(k), n] for k, n in sharing.members.items()],
      "counts": dict(r.counts), "version": r.version, "steps_total": r.steps_total,
  }
  arrays = {f"pool{i}": np.asarray(jax.device_get(p)) for i, p in enumerate(r.pools)}
  arrays["rng"] = np.asarray(jax.random.key_data(r.state.rng))
  return state, arrays


def snapshot(engine: SamplerEngine) -> tuple[dict, dict[str, np.ndarray]]:
  """Host copy of the engine's whole state.

  Returns:
    (state, arrays): a JSON-able dict and a dict of numpy arrays (per replica i: pools
    "r<i>/pool<j>" and PRNG key data "r<i>/rng"; running weights "params<k>", pending weights
    "pending<k>" if any; with pending weights "params<k>" holds them too, since the running ones
    will not be used again).
  """
  e = engine
  e.settle()  # dispatches in flight are read back; their finished rollouts stay buffered
  with e._lock:
    pending = e._pending
  next_uid = next(e._uids)
  e._uids = itertools.count(next_uid)
  state = {"version": e._version, "pending_version": None if pending is None else int(pending[1]),
           "next_uid": next_uid, "sums": dict(e._sums), "counts": dict(e._counts),
           "host_s": e._host_s,
           "groups": [[_key_to_json(k), v[0], v[1]] for k, v in e._group_replica.items()],
           "queue": [_seq_to_dict(s) for s in e._queue],
           "buffer": [_rollout_to_dict(r) for r in e._buffer],
           "replicas": []}
  arrays: dict[str, np.ndarray] = {}
  for i, r in enumerate(e.replicas):
    rs, ra = _replica_state(r)
    state["replicas"].append(rs)
    arrays.update({f"r{i}/{k}": v for k, v in ra.items()})
  if pending is None:
    arrays.update(_flat(e._params, "params"))
  else:
    # The running weights are never used again (the swap comes before the next dispatch), and
    # their buffers may already be released by the weight channel: store the pending ones.
    arrays.update(_flat(pending[0], "pending"))
    arrays.update(_flat(pending[0], "params"))
  return state, arrays


def _restore_replica(r, state: dict, arrays: dict[str, np.ndarray], prefix: str) -> None:
  r.pools = tuple(jax.device_put(arrays[f"{prefix}pool{j}"], p.sharding)
                  for j, p in enumerate(r.pools))
  rng = jax.device_put(jax.random.wrap_key_data(arrays[f"{prefix}rng"]), r.replicated)
  r.state = r.state.replace(rng=rng)
  sched, sharing = r.sched, r.sharing
  sched.slots = [None if d is None else _seq_from_dict(d) for d in state["slots"]]
  sched.waiting.clear()
  sched.waiting.extend(_seq_from_dict(d) for d in state["waiting"])
  sched._admit_counter = int(state["admit_counter"])
  r.alloc.load_state_dict(state["alloc"])
  r.alloc.take_fresh()
  sharing.entries = {_key_from_json(k): PromptEntry(_key_from_json(h), n, tuple(f), p, v)
                     for k, h, n, f, p, v in state["entries"]}
  sharing.members.clear()
  sharing.members.update({_key_from_json(k): n for k, n in state["members"]})
  sharing.pending_copies = []
  r.counts = {k: int(v) for k, v in state["counts"].items()}
  r.version, r.steps_total = int(state["version"]), int(state["steps_total"])
  r.inflight = None
  r.mark_all_dirty()


def restore(engine: SamplerEngine, state: dict, arrays: dict[str, np.ndarray]) -> None:
  """Loads a `snapshot` into `engine` (same model, sampler config and mesh).

  Raises:
    ValueError: if the replica count, pool shapes or slot count differ from the snapshot's.
  """
  e = engine
  if len(state["replicas"]) != len(e.replicas):
    raise ValueError(f"sampler snapshot has {len(state['replicas'])} replicas, this engine "
                     f"{len(e.replicas)}.")
  for i, (r, rs) in enumerate(zip(e.replicas, state["replicas"])):
    if (arrays[f"r{i}/pool0"].shape != r.pools[0].shape
        or len(rs["slots"]) != len(r.sched.slots)):
      raise ValueError(f"sampler snapshot does not fit this engine: pool "
                       f"{arrays[f'r{i}/pool0'].shape} vs {r.pools[0].shape}, slots "
                       f"{len(rs['slots'])} vs {len(r.sched.slots)}.")
  running = e._params
  e._params, e._version = _unflat(running, arrays, "params"), int(state["version"])
  e._views = e._replica_params(e._params)
  e._pending = (None if state["pending_version"] is None else
                (_unflat(running, arrays, "pending"), int(state["pending_version"])))
  for i, (r, rs) in enumerate(zip(e.replicas, state["replicas"])):
    _restore_replica(r, rs, arrays, f"r{i}/")
  e._uids = itertools.count(int(state["next_uid"]))
  e._sums = {k: float(v) for k, v in state["sums"].items()}
  e._counts = {k: int(v) for k, v in state["counts"].items()}
  e._host_s = float(state["host_s"])
  e._group_replica = {_key_from_json(k): [int(a), int(b)] for k, a, b in state["groups"]}
  e._queue.clear()
  e._queue.extend(_seq_from_dict(d) for d in state["queue"])
  e._buffer = [_rollout_from_dict(d) for d in state["buffer"]]
  e._launches = 0
