"""Logical axes, sharding rules per role, the device split, the mesh builder, sharding helpers.

The one sharding module of the package. It sits below model, sampler, learner and pipeline and
imports none of them. Model and cache code name *logical* axes only (`EMBED`, `MLP`, `HEADS` ...);
one small rules table per role maps each logical axis to an ordered tuple of mesh axes
(MaxText-style logical axis rules, kept small):

  `LEARNER_RULES`   params, optimizer state and batches on the learner mesh (FSDP x tp)
  `LEARNER_COMPUTE_RULES`  how the learner's forward / backward computes (`compute_constraint`):
                    each layer's weights gathered over fsdp, activations split over the batch
  `SAMPLER_RULES`   params and slot batches on the sampler mesh (data replicas x tp)
  `CACHE_RULES`     the paged KV pool, on whichever mesh its engine runs (sampler or eval)

`logical_to_spec` / `logical_to_sharding` turn logical axes into `PartitionSpec`s /
`NamedSharding`s for a given mesh; `make_mesh` is the one mesh builder, always with explicit
``AxisType.Auto`` axis types: `jax.make_mesh` defaults to ``Explicit``, which rejects
Megatron-style matmuls that contract over a sharded dimension (jax-notes §1).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import types
from typing import Any, Mapping, Sequence

from absl import logging
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
import numpy as np
import optax

# ---- logical axis names (what model and cache code say) ----------------------------------------
BATCH = "batch"          # sequences of a batch / decode slots
LENGTH = "length"        # token positions
EMBED = "embed"          # model width d_model
MLP = "mlp"              # feed-forward hidden width
HEADS = "heads"          # query heads
KV_HEADS = "kv_heads"    # key / value heads (GQA)
HEAD_DIM = "head_dim"    # per-head width
VOCAB = "vocab"          # vocabulary
LAYERS = "layers"        # stacked layers
PAGES = "pages"          # KV pool pages
PAGE_SIZE = "page_size"  # tokens per KV page
LORA_RANK = "lora_rank"  # inner width r of LoRA adapters (always replicated: r is small)
EXPERT = "expert"        # experts of a mixture-of-experts layer (stacked expert weights)

LOGICAL_AXES: tuple[str, ...] = (
    BATCH, LENGTH, EMBED, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS, PAGES, PAGE_SIZE,
    LORA_RANK, EXPERT)

# ---- mesh axis names ----------------------------------------------------------------------------
DATA = "data"  # independent replicas (batch split, weights replicated)
FSDP = "fsdp"  # fully sharded data parallel (batch and weights split)
TP = "tp"      # tensor parallel (Megatron: heads / mlp / vocab split)
EXPERT_AXIS = "expert"  # expert parallel (MoE experts split; tokens exchanged by all-to-all)

# Logical axis name -> ordered mesh axes it may be split over (first = major). An empty tuple
# means "always replicated". Mesh axes missing from a given mesh are skipped. A logical name the
# table does not list is an error (so a cache axis cannot silently be mapped by a weight table).
Rules = Mapping[str, tuple[str, ...]]

# FSDP x tensor parallel (Megatron) x expert parallel: weights split over fsdp on the embed dim
# and over tp on the head / mlp / vocab dims; MoE expert weights split over "expert" on their
# expert dim (`model.moe_parallel`); activations split over (data, fsdp, expert) on the batch
# dim. Outside the experts the "expert" axis acts as one more FSDP axis (dense weights' embed
# dim is split over fsdp x expert; an expert weight's embed dim takes fsdp only, as "expert"
# already splits its expert dim), so a mesh without "expert" is laid out as before.
LEARNER_RULES: Rules = types.MappingProxyType({
    BATCH: (DATA, FSDP, EXPERT_AXIS),
    LENGTH: (),
    EMBED: (FSDP, EXPERT_AXIS),
    MLP: (TP,),
    HEADS: (TP,),
    KV_HEADS: (TP,),
    HEAD_DIM: (),
    VOCAB: (TP,),
    LAYERS: (),
    LORA_RANK: (),
    EXPERT: (EXPERT_AXIS,),
})

# How the learner computes (FSDP = ZeRO-3, plus data and Megatron tensor parallelism): inside the
# forward pass a weight is used with the embed dim whole (its fsdp shards all-gathered, one layer
# at a time inside the layer scan; the backward reduce-scatters its gradient back to the stored
# `LEARNER_RULES` layout) and tp splits heads / mlp / vocab; activations are split over the
# batch axes (data, fsdp, expert) only, so no activation ever needs a collective over fsdp.
# Expert weights stay split over "expert" (each device computes its own experts; tokens travel
# to them by all-to-all, `model.moe_parallel`).
LEARNER_COMPUTE_RULES: Rules = types.MappingProxyType({**LEARNER_RULES, EMBED: ()})

# Data replicas x tensor parallel x expert parallel: weights replicated over data and split over
# tp; MoE expert weights split over "expert" on their expert dim (decode tokens stay whole on
# every device of a replica); decode slots (batch) split over data. The KV pool has its own
# table, `CACHE_RULES`.
SAMPLER_RULES: Rules = types.MappingProxyType({
    BATCH: (DATA,),
    LENGTH: (),
    EMBED: (),
    MLP: (TP,),
    HEADS: (TP,),
    KV_HEADS: (TP,),
    HEAD_DIM: (),
    VOCAB: (TP,),
    LAYERS: (),
    LORA_RANK: (),
    EXPERT: (EXPERT_AXIS,),
})

# The paged KV pool (`rlax_pipe.sampler.page_pool`: layers folded into pages, [K, L*P, S, D] k
# and v, or one [L*P, S, 2K, D] for the TPU ragged kernel): only kv heads are split (over tp,
# like the k / v projections in `SAMPLER_RULES`, so attention needs no reshard; Pallas kernels
# run per tp shard under shard_map). Pages stay whole: a block table indexes pages of the whole
# pool, so splitting pages over devices would turn every gather into a cross-device gather. A
# "data" axis means independent replicas, each with its own pool on its own sub-mesh
# (`replica_meshes`), so the pool never spans data.
CACHE_RULES: Rules = types.MappingProxyType({
    LAYERS: (),
    KV_HEADS: (TP,),
    PAGES: (),
    PAGE_SIZE: (),
    HEAD_DIM: (),
})


# ---- device split and meshes -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceSplit:
  """Which devices each role uses.

  Attributes:
    learner: devices of the learner mesh, in order.
    sampler: devices of the sampler mesh, in order.
    shared: True when both roles run on the very same single device.
  """

  learner: tuple[Any, ...]
  sampler: tuple[Any, ...]
  shared: bool


def _describe_devices(devices: Sequence[Any]) -> str:
  kinds = collections.Counter(
      f"{getattr(d, 'platform', '?')}:{getattr(d, 'device_kind', '?')}" for d in devices)
  kinds_str = ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items()))
  return f"{len(devices)} device(s) found ({kinds_str or 'none'})"


def split_devices(devices: Sequence[Any], num_sampler: int, num_learner: int) -> DeviceSplit:
  """Splits a device list into disjoint learner and sampler device sets.

  The learner takes the first `num_learner` devices and the sampler the next `num_sampler`
  (so with 8 devices and 4 + 4, the learner gets devices 0-3 and the sampler 4-7). Extra devices
  are left unused (and logged). With exactly one device and `num_sampler == num_learner == 1`,
  both roles share it; a log line says so.

  Args:
    devices: available devices, e.g. `jax.devices()`.
    num_sampler: number of sampler devices (>= 1).
    num_learner: number of learner devices (>= 1).

  Returns:
    A `DeviceSplit`.

  Raises:
    ValueError: if a count is < 1, or the split needs more devices than exist; the message lists
      how many devices were found and of which kinds.
  """
  devices = tuple(devices)
  if num_sampler < 1 or num_learner < 1:
    raise ValueError(
        f"split_devices: num_sampler={num_sampler} and num_learner={num_learner} must both be "
        f">= 1; {_describe_devices(devices)}.")
  if len(devices) == 1 and num_sampler == 1 and num_learner == 1:
    logging.info(
        "split_devices: one device only (%s); learner and sampler share it.", devices[0])
    return DeviceSplit(learner=devices, sampler=devices, shared=True)
  needed = num_sampler + num_learner
  if needed > len(devices):
    hint = (" With a single device use num_sampler=1, num_learner=1 (both roles share it)."
            if len(devices) == 1 else "")
    raise ValueError(
        f"split_devices: cannot place {num_learner} learner + {num_sampler} sampler devices "
        f"({needed} in all) on {_describe_devices(devices)}.{hint} Lower the two counts, or on "
        "a CPU-only machine ask XLA for more virtual devices with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}.")
  if needed < len(devices):
    logging.info("split_devices: %d of %d devices left unused.", len(devices) - needed,
                 len(devices))
  return DeviceSplit(learner=devices[:num_learner],
                     sampler=devices[num_learner:needed], shared=False)


def make_mesh(devices: Sequence[Any], axes: Mapping[str, int], rules: Rules | None = None, *,
              keep_device_order: bool = False) -> Mesh:
  """Builds a mesh with ``AxisType.Auto`` axes over exactly `devices`.

  Args:
    devices: the devices of this mesh; their number must equal the product of the axis sizes.
    axes: ordered mapping axis name -> size, e.g. ``{"fsdp": 2, "tp": 2}`` (major axis first).
    rules: the rules table of the role this mesh serves (`LEARNER_RULES`, `SAMPLER_RULES`); when
      given, every axis name must be one that table uses. None skips the check.
    keep_device_order: True lays `devices` out row-major in the given order (needed when the
      order itself carries meaning, e.g. the weight channel's transfer layouts); False lets
      `jax.make_mesh` pick a topology-aware order on TPU / GPU.

  Returns:
    A `jax.sharding.Mesh` whose axis types are all ``AxisType.Auto``.

  Raises:
    ValueError: if `axes` is empty, a size is < 1, an axis name is unknown to `rules`, or the
      size product differs from the device count.
  """
  devices = tuple(devices)
  if not axes:
    raise ValueError("make_mesh: give at least one axis, e.g. {'tp': len(devices)}.")
  if rules is not None:
    known = sorted({a for mesh_axes in rules.values() for a in mesh_axes})
    unknown = [a for a in axes if a not in known]
    if unknown:
      raise ValueError(
          f"make_mesh: mesh axes {unknown} are not used by the rules of this role; choose "
          f"among {known}.")
  names, sizes = tuple(axes.keys()), tuple(int(s) for s in axes.values())
  if any(s < 1 for s in sizes):
    raise ValueError(f"make_mesh: axis sizes must be >= 1, got {dict(axes)}.")
  if math.prod(sizes) != len(devices):
    raise ValueError(
        f"make_mesh: mesh {dict(axes)} needs {math.prod(sizes)} devices but was given "
        f"{_describe_devices(devices)}.")
  axis_types = (AxisType.Auto,) * len(names)
  if not keep_device_order:
    try:  # topology-aware device order on TPU / GPU
      return jax.make_mesh(sizes, names, axis_types=axis_types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError) as e:
      logging.info("make_mesh: jax.make_mesh failed (%s); using the given device order.", e)
  return Mesh(np.asarray(devices, dtype=object).reshape(sizes), names, axis_types=axis_types)


def replicated(mesh: Mesh) -> NamedSharding:
  """Sharding of a value kept whole on every device of `mesh` (scalars, block tables, seeds)."""
  return NamedSharding(mesh, PartitionSpec())


def replica_meshes(mesh: Mesh) -> list[Mesh]:
  """The sampler's data replicas: one mesh per index of `mesh`'s "data" axis, over the remaining
  axes (a one-device "tp" mesh when "data" is the only axis); `[mesh]` without a data axis.

  Each replica runs its own engine slots and KV pool on its sub-mesh, so two replicas decode
  disjoint sequences.
  """
  names = list(mesh.axis_names)
  if DATA not in names:
    return [mesh]
  axis = names.index(DATA)
  rest = tuple(n for n in names if n != DATA)
  out = []
  for i in range(mesh.shape[DATA]):
    sub = np.take(np.asarray(mesh.devices), i, axis=axis)
    if rest:
      out.append(Mesh(sub, rest, axis_types=(AxisType.Auto,) * len(rest)))
    else:
      out.append(Mesh(sub.reshape(1), (TP,), axis_types=(AxisType.Auto,)))
  return out


def replica_view(x: jax.Array, sub: Mesh) -> jax.Array:
  """`x` (on a sampler mesh, replicated over "data") as an array on replica mesh `sub`, built
  from its shards on `sub`'s devices (no copy, same per-device layout). An array laid out
  otherwise (e.g. split over data, or on other devices) is copied onto `sub`, replicated."""
  sharding = x.sharding
  if isinstance(sharding, NamedSharding) and DATA not in jax.tree.leaves(tuple(sharding.spec)):
    devices = set(sub.devices.flat)
    shards = [s.data for s in x.addressable_shards if s.device in devices]
    try:
      return jax.make_array_from_single_device_arrays(
          x.shape, NamedSharding(sub, sharding.spec), shards)
    except ValueError:
      pass
  return jax.device_put(x, NamedSharding(sub, PartitionSpec()))


# ---- logical axes -> shardings -----------------------------------------------------------------
def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int] | None,
                    mesh: Mesh, rules: Rules, *, canonical: bool = False) -> PartitionSpec:
  """Maps one array's logical axes to a `PartitionSpec` on `mesh`.

  Dimension i is split over the mesh axes `rules[logical_axes[i]]` that (a) exist in `mesh`,
  (b) are not already used by an earlier dimension (a mesh axis can split only one dim), and
  (c) divide the dimension evenly: the longest prefix of the remaining rule axes whose size
  product divides `shape[i]` is used, so a dim that does not divide evenly is replicated
  (e.g. 3 kv heads on a 2-way tp mesh stay whole on every device). A logical name of None
  means replicated.

  Args:
    logical_axes: one logical name (or None) per array dimension.
    shape: the array shape, same length; None skips the divisibility check (c).
    mesh: target mesh.
    rules: logical name -> ordered mesh axes, e.g. `LEARNER_RULES`.
    canonical: drop trailing replicated dims, the form in which `jit` reports output shardings
      (so a spec compares equal to the one of an array the engine produced).

  Returns:
    A `PartitionSpec` with one entry per dimension (None, a mesh axis name, or a tuple of names),
    or fewer with `canonical=True`.

  Raises:
    ValueError: on a logical name `rules` does not list, or a rank mismatch between
      `logical_axes` and `shape`.
  """
  if shape is not None and len(shape) != len(logical_axes):
    raise ValueError(
        f"logical axes {tuple(logical_axes)} have rank {len(logical_axes)} but the array shape "
        f"{tuple(shape)} has rank {len(shape)}.")
  used: set[str] = set()
  entries = []
  for i, name in enumerate(logical_axes):
    if name is None:
      entries.append(None)
      continue
    if name not in rules:
      raise ValueError(
          f"unknown logical axis {name!r}; the rules table knows {sorted(rules)}.")
    candidates = [a for a in rules[name] if a in mesh.shape and a not in used]
    chosen: list[str] = []
    product = 1
    for a in candidates:
      if shape is not None and shape[i] % (product * mesh.shape[a]):
        break
      chosen.append(a)
      product *= mesh.shape[a]
    used.update(chosen)
    entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  while canonical and entries and entries[-1] is None:
    entries.pop()
  return PartitionSpec(*entries)


def _is_axes_leaf(x: Any) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def logical_to_sharding(axes_tree: Any, mesh: Mesh, rules: Rules, shapes: Any = None) -> Any:
  """Turns a tree of logical-axis tuples into a tree of `NamedSharding`s on `mesh`.

  Args:
    axes_tree: pytree whose leaves are tuples of logical names (or None), one per dimension,
      e.g. ``{"wq": ("layers", "embed", "heads", "head_dim")}``; ``()`` for scalars.
    mesh: the learner or sampler mesh.
    rules: the rules table of that mesh (`LEARNER_RULES`, `SAMPLER_RULES`, or your own).
    shapes: optional pytree of the same structure whose leaves have `.shape` (arrays,
      `jax.ShapeDtypeStruct` from `jax.eval_shape`) or are shape tuples. When given, a dim is
      split only if it divides evenly (see `logical_to_spec`); strongly recommended.

  Returns:
    A pytree of the same structure with a `NamedSharding` per leaf.

  Raises:
    ValueError: on an unknown logical name, a rank mismatch, or trees of different structure
      (the message names the offending leaf path).
  """
  axes_leaves, treedef = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=_is_axes_leaf)
  if shapes is None:
    shape_leaves = [None] * len(axes_leaves)
  else:
    try:
      shape_leaves = treedef.flatten_up_to(shapes)
    except (ValueError, TypeError) as e:
      raise ValueError(f"logical_to_sharding: `shapes` does not match `axes_tree`: {e}") from None
  out = []
  for (path, axes), shp in zip(axes_leaves, shape_leaves):
    if not _is_axes_leaf(axes):
      raise ValueError(
          f"leaf {jax.tree_util.keystr(path)} is {axes!r}; expected a tuple of logical axis names.")
    if shp is not None and not isinstance(shp, tuple):
      shp = tuple(shp.shape)
    try:
      spec = logical_to_spec(axes, shp, mesh, rules)
    except ValueError as e:
      raise ValueError(f"leaf {jax.tree_util.keystr(path)}: {e}") from None
    out.append(NamedSharding(mesh, spec))
  return jax.tree_util.tree_unflatten(treedef, out)


def opt_state_shardings(tx: optax.GradientTransformation, abstract_opt_state: Any,
                        params_shardings: Any, mesh: Mesh) -> Any:
  """Shardings of an optax state: per-parameter leaves (moments) copy their parameter's.

  Args:
    tx: the optimizer whose state this is.
    abstract_opt_state: `jax.eval_shape(tx.init, abstract_params)`.
    params_shardings: NamedSharding tree with the params' structure.
    mesh: the params' mesh (non-parameter leaves such as counts are replicated on it).

  Returns:
    A tree with the optimizer state's structure and a NamedSharding per leaf.
  """
  rep = replicated(mesh)
  # tree_map_params runs tx.init on placeholders, which makes a few host scalars (counts):
  # harmless, so allowed even under a stricter caller transfer guard.
  with jax.transfer_guard("allow"):
    return optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract_opt_state, params_shardings,
        transform_non_params=lambda _: rep,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def compute_constraint(mesh: Mesh, rules: Rules = LEARNER_COMPUTE_RULES,
                       stored_rules: Rules = LEARNER_RULES):
  """A sharding hook `constrain(x, logical_axes, weight=False) -> x` for a model's forward.

  Activations are constrained to `rules`. A weight (`weight=True`) is constrained to its
  `rules` layout in the forward pass (with `LEARNER_COMPUTE_RULES`: all-gathered over fsdp) and
  its cotangent to the weight's *stored* layout (`stored_rules`) in the backward pass, through a
  custom VJP: the partial per-device gradient then goes straight to a reduce-scatter into the
  shard each device stores, not through an all-reduce of the whole gradient first. A dimension
  whose size the rule's mesh axes do not divide stays whole (`logical_to_spec`).

  Args:
    mesh: the mesh the model runs on.
    rules: compute layout table.
    stored_rules: layout the parameters are stored in.

  Returns:
    constrain(x, logical_axes, weight=False), with attribute `mesh` (the mesh): an MoE layer
    reads it to run its experts split over the mesh's "expert" axis (`model.moe_parallel`).
  """
  def sharding(x, axes, table):
    return NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh, table))

  def gather(x, axes):
    @jax.custom_vjp
    def use(w):
      return jax.lax.with_sharding_constraint(w, sharding(w, axes, rules))

    def use_fwd(w):
      return use(w), None

    def use_bwd(_, ct):
      return (jax.lax.with_sharding_constraint(ct, sharding(ct, axes, stored_rules)),)

    use.defvjp(use_fwd, use_bwd)
    return use(x)

  def constrain(x: jax.Array, logical_axes: Sequence[str | None], weight: bool = False):
    if weight:
      return gather(x, tuple(logical_axes))
    return jax.lax.with_sharding_constraint(x, sharding(x, logical_axes, rules))
  constrain.mesh = mesh  # for code that must name the mesh (MoE experts under shard_map)
  return constrain
