"""Where a weight version lives on its way between processes, computed alike by every process.

A sampler replica holds the params on its own devices in the sampler layout: a mesh of its local
devices with `sampler_mesh_axes` and the `SAMPLER_RULES` spec of every leaf. Cross-host
`jax.device_put` moves an array between processes only when source and destination have the
same layout (same mesh shape, same spec; jax 0.10 refuses anything else, multihost-notes), so
the learner first re-lays its params out on the learner mesh into a *staging* layout: the learner
devices arranged as (K processes, *replica mesh shape) with the replica's spec on the replica
axes (replicated over the process axis), i.e. a full copy per learner process in exactly the
layout of a replica. Learner process g then sends its copy (its devices, reshaped like a replica
mesh) to the replicas it serves (replica r is served by g = r mod K): a pure per-shard copy.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from typing import Any, Mapping

import jax
from jax.sharding import Mesh, NamedSharding
import numpy as np

from rlax_pipe import sharding as sharding_lib
from rlax_pipe.cluster import Topology

PROCESS_AXIS = "_process"


class LayoutMismatchError(RuntimeError):
  """The learner sends another layout (leaves, shapes, dtypes, specs, mesh) than a replica
  expects; the message names both sides."""


class TransferLayout:
  """Replica-layout shardings of every process, the staging layout on the learner mesh, and the
  manifest (names, shapes, dtypes, specs) both sides check.

  Args:
    topology: the job.
    model: the policy's model (`rlax_pipe.model.Model`): abstract params and logical axes.
    sampler_axes: ordered {axis: size} of a replica's mesh; the product must equal the devices
      of one process.

  Raises:
    ValueError: if the replica mesh does not use exactly one process's devices.
  """

  def __init__(self, topology: Topology, model: Any, sampler_axes: Mapping[str, int]):
    self.topology = topology
    self.sampler_axes = dict(sampler_axes)
    size = int(np.prod(list(self.sampler_axes.values())))
    if size != topology.devices_per_process:
      raise ValueError(
          f"sampler_mesh_axes={tuple(self.sampler_axes.items())} needs {size} devices, but each "
          f"process has {topology.devices_per_process}: in a multi-process job a replica uses "
          "all devices of its process (set --config.sampler_mesh_axes to a product of "
          f"{topology.devices_per_process}).")
    self.abstract = abstract = model.abstract_params()
    leaves, self.treedef = jax.tree_util.tree_flatten_with_path(abstract)
    self.names = [jax.tree_util.keystr(p) for p, _ in leaves]
    self.shapes = [tuple(int(d) for d in a.shape) for _, a in leaves]
    self.dtypes = [np.dtype(a.dtype) for _, a in leaves]
    mesh = self.process_mesh(topology.replica_processes[0])
    shardings = sharding_lib.logical_to_sharding(model.param_axes(), mesh,
                                                 sharding_lib.SAMPLER_RULES, shapes=abstract)
    self.specs = [s.spec for s in self.treedef.flatten_up_to(shardings)]

  # ---- meshes and shardings (each process's computed once) -------------------------------------
  @functools.cache  # pylint: disable=method-cache-max-size-none  (one layout per job)
  def process_mesh(self, process_id: int) -> Mesh:
    """A replica-shaped mesh over one process's devices (by id, row-major)."""
    return sharding_lib.make_mesh(self.topology.process_devices(process_id), self.sampler_axes,
                                  keep_device_order=True)

  @functools.cache  # pylint: disable=method-cache-max-size-none
  def process_sharding(self, process_id: int) -> list[NamedSharding]:
    """Per leaf: the replica layout on `process_id`'s devices."""
    return [NamedSharding(self.process_mesh(process_id), spec) for spec in self.specs]

  def staging_sharding(self) -> list[NamedSharding]:
    """Per leaf: the staging layout on the learner devices (a replica-layout copy per learner
    process)."""
    devices = np.asarray(self.topology.learner_devices(), dtype=object).reshape(
        (self.topology.num_learner_processes,) + tuple(self.sampler_axes.values()))
    mesh = Mesh(devices, (PROCESS_AXIS,) + tuple(self.sampler_axes),
                axis_types=(jax.sharding.AxisType.Auto,) * devices.ndim)
    return [NamedSharding(mesh, spec) for spec in self.specs]

  def local_view(self, staged: list[jax.Array], process_id: int) -> list[jax.Array]:
    """This process's copy inside staging arrays, as arrays on its replica-shaped mesh (the same
    buffers, no copy)."""
    out = []
    for x, sharding in zip(staged, self.process_sharding(process_id)):
      by_device = {s.device: s.data for s in x.addressable_shards}
      out.append(jax.make_array_from_single_device_arrays(
          x.shape, sharding, [by_device[d] for d in sharding.mesh.devices.flat]))
    return out

  @functools.cache  # pylint: disable=method-cache-max-size-none
  def stand_ins(self, process_id: int) -> list[jax.Array]:
    """Arrays in `process_id`'s replica layout with no shard on this process (what a process
    that takes no part in a transfer passes to a cross-host `jax.device_put` all the same; why:
    `weights`, step 3)."""
    return [jax.make_array_from_single_device_arrays(s, sh, [], dtype=d)
            for s, d, sh in zip(self.shapes, self.dtypes, self.process_sharding(process_id))]

  # ---- manifest ---------------------------------------------------------------------------------
  def manifest(self) -> list[list[Any]]:
    """[name, shape, dtype, spec] per leaf, plus the replica mesh axes (JSON-able)."""
    return [[n, list(s), d.name, str(spec)] for n, s, d, spec in
            zip(self.names, self.shapes, self.dtypes, self.specs)] + [
                ["mesh", list(self.sampler_axes.items())]]

  def digest(self) -> str:
    """A short hash of `manifest()` (equal on both sides of a compatible transfer)."""
    return hashlib.sha256(json.dumps(self.manifest()).encode()).hexdigest()[:16]


def compare_manifests(sender: list, receiver: list, sender_name: str, receiver_name: str) -> None:
  """Raises `LayoutMismatchError` naming the first differing entry on both sides."""
  for i, (a, b) in enumerate(itertools.zip_longest(sender, receiver)):
    if a != b:
      raise LayoutMismatchError(
          f"weight layout mismatch between {sender_name} and {receiver_name}: entry {i} is "
          f"{a} on {sender_name} but {b} on {receiver_name} (same model, sampler_mesh_axes and "
          "param dtype on every process?).")
