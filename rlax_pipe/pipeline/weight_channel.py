"""Versioned, device-to-device weight channel from the learner mesh to the sampler mesh.

Why the detour (jax-notes §2a, measured on jax 0.10): `jax.device_put` onto another mesh is a pure
per-shard device copy only when every destination shard has a source shard holding exactly the
same slice of the array; otherwise it silently assembles the whole array on the host
(`ArrayImpl._value`) and re-scatters it, and `jax.transfer_guard` does not notice. So a push runs:

  1. on the learner mesh, `jax.jit(identity, out_shardings=...)` into a layout whose shards are
     exactly the sampler's shards (with equal device counts: the learner devices reshaped to the
     sampler mesh's shape and axis names, same `PartitionSpec`, i.e. congruent);
  2. `jax.device_put` of those shards onto the sampler devices (per-shard device copies; never
     `donate=True`, which segfaults on CPU: the intermediate is deleted explicitly instead);
  3. only when the learner has fewer devices than the sampler has distinct shards: a `jax.jit`
     on the sampler mesh that slices the landed coarser shards into the final layout (local
     slicing, no host).

Congruence (step 1 -> 2) is checked in code for every leaf when the plan is built (the per-leaf
plan and the manifest: `transfer_plan`).

Ownership (`types.WeightUpdate`): the channel owns only the one incoming version; a take hands
it over (`donated=True`) and forgets it, and one superseded by a newer push before being taken is
deleted. So at most three copies live on the sampler mesh: the running one, one handed over and
pending in the engine until its next step boundary, and one in transit. The version rules of a
push (a failed one may be retried) are `WeightChannel.push`'s.

Checks (issue #14 item 10): every push also starts the learner-side checksums of the version
(`rlax_pipe.param_checksum`, exact and layout-independent) and the update carries them, so the
engine verifies that the weights it decodes with after the swap are that version
(`WeightMismatchError` otherwise).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding
import numpy as np

from rlax_pipe import param_checksum
from rlax_pipe.pipeline.transfer_plan import (  # pylint: disable=unused-import
    LeafSpec, ManifestError, LeafPlan, plan_leaf, assert_congruent, check_manifest,
    params_manifest)
from rlax_pipe.types import WeightUpdate


@dataclasses.dataclass(frozen=True)
class ChannelStats:
  """Counters of a `WeightChannel`.

  Attributes:
    pushes: versions pushed.
    takes: versions taken by the sampler (handed over as `WeightUpdate`s).
    superseded: versions pushed but replaced by a newer push before being taken (deleted).
    bytes_per_version: total bytes of one params version.
    current_version: version of the last take (-1 before the first take).
    pending_version: version in transit or ready to take (-1 if none).
  """

  pushes: int
  takes: int
  superseded: int
  bytes_per_version: int
  current_version: int
  pending_version: int


def _identity(tree):
  return tree


@dataclasses.dataclass
class _InTransit:
  version: int
  params: Any                      # pytree on the sampler shardings
  leaves: list[jax.Array]          # its leaves, for readiness checks and deletion
  intermediates: list[jax.Array]   # learner-side / landing copies to delete once ready
  checksum: Any = None             # the learner's param_checksum of this version


def _all_ready(arrays) -> bool:
  return all(a.is_ready() for a in arrays)


def delete_all(arrays) -> None:
  """Deletes every jax.Array among `arrays` that is not deleted yet (other items are skipped)."""
  for a in arrays:
    if isinstance(a, jax.Array) and not a.is_deleted():
      a.delete()


class WeightChannel:
  """Moves params versions from learner shardings to sampler shardings, device to device.

  Thread-safe: one learner thread calls `push` (it returns as soon as the copies are
  dispatched), the sampler thread calls `try_take` between decode steps (it never blocks on a
  transfer) or `take`, concurrently (see the module docstring for who owns which copy).

  Example:
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract_params, sampler_shardings)
    channel = WeightChannel(target)
    channel.push(WeightUpdate(3, learner_params))        # returns at once
    ...                                            # between two decode steps:
    update = channel.try_take()                    # None until the copy is complete
    if update is not None: engine.update_weights(update)   # the engine now owns the arrays
  """

  def __init__(self, target: Any, *,
               verify: Callable[[Any, int], None] | None = None, debug: bool = False):
    """Creates a channel.

    Args:
      target: pytree of `jax.ShapeDtypeStruct` whose `.sharding` is a `NamedSharding` on the
        sampler mesh (what `jax.eval_shape` gives, with shardings from `logical_to_sharding`).
        Defines the manifest every push is checked against.
      verify: optional `verify(sampler_params, version)` run on every push when `debug` is True,
        after the copy completed; it should raise on a mismatch (e.g. compare log-probs of a
        probe sequence). With debug on, `push` blocks until the copy is done.
      debug: run `verify` after each push.

    Raises:
      TypeError: if a target leaf has no `NamedSharding`.
    """
    leaves, self._treedef = jax.tree_util.tree_flatten(target)
    for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
      if not isinstance(getattr(leaf, "sharding", None), NamedSharding):
        raise TypeError(
            f"WeightChannel target leaf {jax.tree_util.keystr(path)} needs a NamedSharding on "
            f"the sampler mesh, got {getattr(leaf, 'sharding', None)!r}.")
    self._targets = [leaf.sharding for leaf in leaves]
    self._manifest = params_manifest(target)
    self._bytes = int(sum(np.prod(s.shape, dtype=np.int64) * np.dtype(s.dtype).itemsize
                          for s in self._manifest))
    self._verify, self._debug = verify, debug
    # learner shardings -> (leaf plans, hop 1's leaf indices and program, the same of hop 3)
    self._plans: dict[tuple[Any, ...], tuple[list[LeafPlan], list[int], Callable | None,
                                             list[int], Callable | None]] = {}
    self._cond = threading.Condition()
    self._taken_version = -1
    self._pending: _InTransit | None = None
    self._last_pushed = -1
    self._pushes = self._takes = self._superseded = 0

  @property
  def manifest(self) -> tuple[LeafSpec, ...]:
    """Names, shapes and dtypes every pushed params tree must have."""
    return self._manifest

  def _plan(self, leaves: list[Any]):
    key = tuple(getattr(x, "sharding", None) for x in leaves)
    if key not in self._plans:
      plans = [plan_leaf(src, tgt, spec.shape, spec.name)
               for src, tgt, spec in zip(key, self._targets, self._manifest)]
      idx1 = [i for i, p in enumerate(plans) if p.learner_layout is not None]
      idx3 = [i for i, p in enumerate(plans) if p.refine]
      hop1 = [plans[i].learner_layout for i in idx1]
      hop3 = [self._targets[i] for i in idx3]
      self._plans[key] = (plans, idx1, jax.jit(_identity, out_shardings=hop1) if idx1 else None,
                          idx3, jax.jit(_identity, out_shardings=hop3) if idx3 else None)
    return self._plans[key]

  def lower_transfer(self, params: Any) -> dict[str, Any]:
    """The push's device programs lowered from abstract learner-side params (deviceless AOT).

    The same plan and jitted programs as `push` (nothing is copied): steps 1 and 3 of the module
    docstring as lowered programs ("hops"); step 2, the per-shard `device_put`, is not an XLA
    program: its bytes are counted from the plan.

    Args:
      params: pytree of `jax.ShapeDtypeStruct` matching the manifest, each with its learner
        `NamedSharding` (e.g. on a TPU topology's devices).

    Returns:
      {"learner_hop": jax.stages.Lowered or None (no leaf needs a learner-side reshard),
       "sampler_hop": Lowered or None, "leaves_resharded": leaves through hop 1,
       "leaves_refined": leaves through hop 3, "device_put_bytes": bytes written onto the
       sampler devices by the copy (every landing shard, replicas included),
       "device_put_bytes_max_per_device": the most one sampler device receives}.

    Raises:
      ManifestError: when `params` does not match the manifest.
    """
    check_manifest(self._manifest, params, what="abstract params")
    leaves = jax.tree_util.tree_leaves(params)
    plans, idx1, hop1, idx3, hop3 = self._plan(leaves)
    abstract = lambda leaf, sh: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh)
    per_device: dict[Any, int] = {}
    for leaf, plan in zip(leaves, plans):
      itemsize = np.dtype(leaf.dtype).itemsize
      for device, index in plan.landing.devices_indices_map(tuple(leaf.shape)).items():
        size = int(np.prod([len(range(*s.indices(d))) for s, d in zip(index, leaf.shape)],
                           dtype=np.int64))
        per_device[device] = per_device.get(device, 0) + size * itemsize
    return {
        "learner_hop": hop1.lower([leaves[i] for i in idx1]) if hop1 else None,
        "sampler_hop": hop3.lower([abstract(leaves[i], plans[i].landing) for i in idx3])
                       if hop3 else None,
        "leaves_resharded": len(idx1), "leaves_refined": len(idx3),
        "device_put_bytes": sum(per_device.values()),
        "device_put_bytes_max_per_device": max(per_device.values(), default=0),
    }

  def _transfer(self, leaves: list[Any]) -> tuple[list[jax.Array], list[jax.Array]]:
    """Dispatches the copies; returns (sampler leaves, intermediates to delete later)."""
    plans, idx1, hop1, idx3, hop3 = self._plan(leaves)
    staged, intermediates = list(leaves), []
    if idx1:
      out = hop1([leaves[i] for i in idx1])
      for i, y in zip(idx1, out):
        if y is not leaves[i]:
          intermediates.append(y)
        staged[i] = y
    landed = jax.device_put(staged, [p.landing for p in plans], may_alias=False)
    if idx3:
      out = hop3([landed[i] for i in idx3])
      for i, y in zip(idx3, out):
        intermediates.append(landed[i])
        landed[i] = y
    return landed, intermediates

  def push(self, update: WeightUpdate) -> None:
    """Starts copying `update.params` (learner shardings) to the sampler as `update.version`;
    returns at once (`types.WeightSink`).

    The caller may keep using (and donate) the params afterwards: the copies and the checksums
    are ordered before any later computation that consumes them (the channel makes its own
    copy, so `update.donated` and `update.checksum` are not read: the channel computes the
    checksums of what it sends).

    Args:
      update: `params`, a pytree matching the manifest whose leaves are `jax.Array`s on the
        learner mesh (host arrays are accepted and uploaded directly); `version`, the policy
        version: newer than the version the sampler took last and not older than the last
        successful push (an equal one retries it, replacing the pending copy).

    Raises:
      ManifestError: naming the first mismatching leaf.
      ValueError: if `version` is older than allowed (see above).
      Whatever the transfer or `verify` (debug mode) raises; that copy is then discarded and
      the version may be pushed again.
    """
    params, version = update.params, update.version
    check_manifest(self._manifest, params, what=f"pushed params (version {version})")
    with self._cond:
      if version <= self._taken_version or version < self._last_pushed:
        raise ValueError(
            f"WeightChannel.push: version {version} is not newer than the version the sampler "
            f"took ({self._taken_version}) or the last pushed version ({self._last_pushed}).")
    leaves = jax.tree_util.tree_leaves(params)
    expected = param_checksum.checksum(leaves)
    landed, intermediates = self._transfer(leaves)
    record = _InTransit(version, jax.tree_util.tree_unflatten(self._treedef, landed), landed,
                        intermediates, expected)
    if self._debug and self._verify is not None:
      jax.block_until_ready(landed)
      delete_all(record.intermediates)
      try:
        self._verify(record.params, version)
      except Exception:
        delete_all(record.leaves)
        raise
    with self._cond:
      if version < self._last_pushed or version <= self._taken_version:
        delete_all(record.leaves + record.intermediates)  # overtaken meanwhile (other thread)
        raise ValueError(f"WeightChannel.push: version {version} was overtaken by version "
                         f"{max(self._last_pushed, self._taken_version)} during the copy.")
      if self._pending is not None:
        delete_all(self._pending.leaves + self._pending.intermediates)
        self._superseded += 1
      self._pending = record
      self._last_pushed = version
      self._pushes += 1
      self._cond.notify_all()

  def _take_locked(self) -> WeightUpdate:
    record, self._pending = self._pending, None
    delete_all(record.intermediates)
    self._taken_version = record.version
    self._takes += 1
    return WeightUpdate(record.version, record.params, donated=True, checksum=record.checksum)

  def try_take(self) -> WeightUpdate | None:
    """Non-blocking: the newest pushed version if its copy is complete, else None.

    The returned update is owned by the caller (`donated=True`): hand it to the engine.
    """
    with self._cond:
      if self._pending is None or not _all_ready(self._pending.leaves):
        return None
      return self._take_locked()

  def take(self, timeout: float | None = None) -> WeightUpdate:
    """Blocking: waits for a push newer than the last taken one and for its copy to finish.

    Args:
      timeout: seconds to wait for a push (None = forever).

    Raises:
      TimeoutError: if nothing was pushed within `timeout`, saying which version is held.
    """
    with self._cond:
      if not self._cond.wait_for(lambda: self._pending is not None, timeout):
        raise TimeoutError(
            f"WeightChannel.take: no new version pushed within {timeout} s (sampler holds "
            f"version {self._taken_version}, last pushed {self._last_pushed}).")
      jax.block_until_ready(self._pending.leaves)
      return self._take_locked()

  def stats(self) -> ChannelStats:
    """Counters and versions, see `ChannelStats`."""
    with self._cond:
      return ChannelStats(
          pushes=self._pushes, takes=self._takes, superseded=self._superseded,
          bytes_per_version=self._bytes,
          current_version=self._taken_version,
          pending_version=-1 if self._pending is None else self._pending.version)

  def close(self) -> None:
    """Deletes the arrays the channel still owns (the version in transit, if any)."""
    with self._cond:
      if self._pending is not None:
        delete_all(self._pending.leaves + self._pending.intermediates)
        self._pending = None
