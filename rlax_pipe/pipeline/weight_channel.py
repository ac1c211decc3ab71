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

Congruence (step 1 -> 2) is checked in code for every leaf when its plan is built (`plan_leaf`).

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

from rlax_pipe import param_checksum
from rlax_pipe import sharding as sharding_lib
from rlax_pipe.types import WeightUpdate

_REPLICA_AXIS = "_rlax_pipe_replica"


class ManifestError(ValueError):
  """A pushed params tree does not match the channel's manifest (names, shapes, dtypes)."""


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """One manifest entry.

  Attributes:
    name: flattened leaf path, as `jax.tree_util.keystr` writes it (e.g. "['layers']['wq']").
    shape: array shape.
    dtype: dtype name, e.g. "float32".
  """

  name: str
  shape: tuple[int, ...]
  dtype: str


def params_manifest(tree: Any) -> tuple[LeafSpec, ...]:
  """Flattened names, shapes and dtypes of a params pytree (arrays or `jax.ShapeDtypeStruct`)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return tuple(
      LeafSpec(jax.tree_util.keystr(path), tuple(int(d) for d in leaf.shape),
               np.dtype(leaf.dtype).name) for path, leaf in leaves)


def check_manifest(expected: tuple[LeafSpec, ...], tree: Any, what: str = "params") -> None:
  """Checks a params tree against a manifest.

  Args:
    expected: manifest from `params_manifest`.
    tree: the pytree to check.
    what: how to name the tree in error messages.

  Raises:
    ManifestError: naming every missing or unexpected leaf, or the first leaf whose shape or
      dtype differs.
  """
  got = params_manifest(tree)
  if got == expected:
    return
  exp_by_name = {s.name: s for s in expected}
  got_by_name = {s.name: s for s in got}
  missing = [n for n in exp_by_name if n not in got_by_name]
  extra = [n for n in got_by_name if n not in exp_by_name]
  if missing or extra:
    raise ManifestError(
        f"{what} tree does not match the weight-channel manifest: missing leaves {missing}, "
        f"unexpected leaves {extra}.")
  for name, e in exp_by_name.items():
    g = got_by_name[name]
    if g != e:
      raise ManifestError(
          f"{what} leaf {name} has shape {g.shape} dtype {g.dtype}; the manifest expects "
          f"shape {e.shape} dtype {e.dtype}.")
  raise ManifestError(f"{what} leaves are in a different order than the manifest.")


def _index_key(index: tuple[slice, ...]) -> tuple[tuple[Any, Any, Any], ...]:
  return tuple((s.start, s.stop, s.step) for s in index)


def _mesh_devices(sharding: Any) -> tuple[Any, ...]:
  if isinstance(sharding, NamedSharding):
    return tuple(sharding.mesh.devices.flat)
  return tuple(sorted(sharding.device_set, key=lambda d: d.id))


def assert_congruent(src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...],
                     name: str = "leaf") -> None:
  """Checks that `device_put(x with src, dst)` is a pure per-shard device copy.

  With equal device counts the layouts must be congruent (same mesh shape, axis names and
  `PartitionSpec`); always, each destination slice must be a source shard's (module docstring).

  Raises:
    RuntimeError: naming the leaf, both layouts and the first uncovered slice.
  """
  if src.num_devices == dst.num_devices and (
      src.mesh.devices.shape != dst.mesh.devices.shape
      or src.mesh.axis_names != dst.mesh.axis_names or src.spec != dst.spec):
    raise RuntimeError(
        f"weight channel: {name} intermediate layout {dict(src.mesh.shape)} {src.spec} is not "
        f"congruent with the sampler layout {dict(dst.mesh.shape)} {dst.spec}.")
  have = {_index_key(i) for i in src.devices_indices_map(shape).values()}
  for index in dst.devices_indices_map(shape).values():
    if _index_key(index) not in have:
      raise RuntimeError(
          f"weight channel: {name} sampler shard {index} of shape {shape} has no identical "
          f"source shard in {dict(src.mesh.shape)} {src.spec}; device_put would go through "
          "the host.")


def _coarsen(spec: PartitionSpec, mesh: Mesh, num_devices: int
             ) -> tuple[PartitionSpec, list[str], list[int]]:
  """Keeps, per spec entry, the longest prefix of mesh axes whose running size product divides
  `num_devices`. Returns the coarse spec and its mesh axes / sizes in spec order."""
  entries, names, sizes, product = [], [], [], 1
  for entry in spec:
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    kept = []
    for a in axes:
      if num_devices % (product * mesh.shape[a]):
        break
      kept.append(a)
      product *= mesh.shape[a]
    names += kept
    sizes += [mesh.shape[a] for a in kept]
    entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*entries), names, sizes


def _auto_mesh(devices: tuple[Any, ...], shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
  return sharding_lib.make_mesh(devices, dict(zip(names, shape)), keep_device_order=True)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """How one leaf travels from the learner to the sampler (see the module docstring)."""

  learner_layout: NamedSharding | None  # None: leaf is pushed as is (already in place / host)
  landing: NamedSharding                # layout on the sampler devices after device_put
  refine: bool                          # landing != target: a jit on the sampler mesh follows


def plan_leaf(src: Any, target: NamedSharding, shape: tuple[int, ...], name: str) -> LeafPlan:
  """Chooses the intermediate layouts for one leaf (see module docstring)."""
  if src is None:  # a host array: uploaded straight into the target layout
    return LeafPlan(None, target, False)
  src_devices = _mesh_devices(src)
  mesh_b, n_a = target.mesh, len(src_devices)
  if n_a == mesh_b.size:
    layout = NamedSharding(
        _auto_mesh(src_devices, mesh_b.devices.shape, mesh_b.axis_names), target.spec)
    landing, refine = target, False
  else:
    coarse, names, sizes = _coarsen(target.spec, mesh_b, n_a)
    g = int(np.prod(sizes, dtype=np.int64))
    names_t = tuple(names) + (_REPLICA_AXIS,)
    layout = NamedSharding(_auto_mesh(src_devices, tuple(sizes) + (n_a // g,), names_t), coarse)
    refine = coarse != target.spec
    landing = NamedSharding(
        _auto_mesh(_mesh_devices(target), tuple(sizes) + (mesh_b.size // g,), names_t),
        coarse) if refine else target
  assert_congruent(layout, landing, shape, name)
  if src.is_equivalent_to(layout, len(shape)):
    layout = None
  return LeafPlan(layout, landing, refine)


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
  leaves: list[jax.Array]          # on the sampler shardings (the channel's tree structure)
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
    self.manifest = params_manifest(target)  # every pushed params tree must have it
    self._bytes = int(sum(np.prod(s.shape, dtype=np.int64) * np.dtype(s.dtype).itemsize
                          for s in self.manifest))
    self._verify, self._debug = verify, debug
    # learner shardings -> (leaf plans, hop 1's leaf indices and program, the same of hop 3)
    self._plans: dict[tuple[Any, ...], tuple[list[LeafPlan], list[int], Callable | None,
                                             list[int], Callable | None]] = {}
    self._cond = threading.Condition()
    self._taken_version = -1
    self._pending: _InTransit | None = None
    self._last_pushed = -1
    self._pushes = self._takes = self._superseded = 0

  def _plan(self, leaves: list[Any]):
    key = tuple(getattr(x, "sharding", None) for x in leaves)
    if key not in self._plans:
      plans = [plan_leaf(src, tgt, spec.shape, spec.name)
               for src, tgt, spec in zip(key, self._targets, self.manifest)]
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
    check_manifest(self.manifest, params, what="abstract params")
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
    check_manifest(self.manifest, params, what=f"pushed params (version {version})")
    with self._cond:
      if version <= self._taken_version or version < self._last_pushed:
        raise ValueError(
            f"WeightChannel.push: version {version} is not newer than the version the sampler "
            f"took ({self._taken_version}) or the last pushed version ({self._last_pushed}).")
    leaves = jax.tree_util.tree_leaves(params)
    expected = param_checksum.checksum(leaves)
    landed, intermediates = self._transfer(leaves)
    record = _InTransit(version, landed, intermediates, expected)
    if self._debug and self._verify is not None:
      jax.block_until_ready(landed)
      delete_all(record.intermediates)
      try:
        self._verify(jax.tree_util.tree_unflatten(self._treedef, landed), version)
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
    params = jax.tree_util.tree_unflatten(self._treedef, record.leaves)
    return WeightUpdate(record.version, params, donated=True, checksum=record.checksum)

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
