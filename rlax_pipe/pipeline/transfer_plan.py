"""How one params version is laid out on its way from the learner mesh to the sampler mesh.

The weight channel's plan per leaf (see `weight_channel` for why): a manifest of names, shapes and
dtypes every pushed tree must match; congruence of a learner-side layout with the sampler-side
landing layout (so `jax.device_put` is a pure per-shard copy); and, when the learner has fewer
devices than the sampler has distinct shards, a coarser landing layout refined on the sampler.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

from rlax_pipe import sharding as sharding_lib

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

  With equal device counts the layouts must be congruent (same mesh shape, same axis names, same
  `PartitionSpec`). In every case each destination shard's slice must be the slice of some
  source shard, otherwise `jax.device_put` gathers the array on the host (jax-notes §2a).

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
