"""Learner mesh and shardings, all derived from abstract shapes before anything is allocated.

Params follow the model's logical axes through `meshes.LEARNER_RULES` (FSDP on embed, tensor
parallel on heads / mlp / vocab); optimizer moments inherit their parameter's sharding; scalars
are replicated; batch rows are split over the (data, fsdp) axes.

Compute follows `COMPUTE_RULES` (`compute_constraint`): inside the forward pass each layer's
weights are constrained to their layout *without* the fsdp split (an all-gather of that layer's
shards, one layer at a time inside the layer scan; its transpose in the backward pass is the
gradient's reduce-scatter), while activations stay split over the batch axes (data, fsdp) and,
Megatron-style, over tp on heads / mlp / vocab. This is FSDP (ZeRO-3) + data parallelism + tensor
parallelism: no activation ever needs a collective over fsdp.
"""

from __future__ import annotations

from typing import Any, Sequence

import types

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import optax

from rlax_pipe.config import ModelConfig
from rlax_pipe.learner.config import LearnerConfig
from rlax_pipe.model import transformer
from rlax_pipe.pipeline import meshes

BATCH_AXES: tuple[str, str] = ("batch", "length")

# How the forward pass computes: weights gathered over fsdp (the embed dim unsplit), tensor
# parallel on heads / mlp / vocab, activations split over the batch axes.
COMPUTE_RULES: meshes.Rules = types.MappingProxyType({
    **meshes.LEARNER_RULES, "embed": (), "batch": ("data", "fsdp")})


def compute_constraint(mesh: Mesh, rules: meshes.Rules = COMPUTE_RULES,
                       stored_rules: meshes.Rules = meshes.LEARNER_RULES):
  """`constrain(x, logical_axes, weight=False)` for `transformer.hidden_states` on `mesh`.

  Activations are constrained to `rules` (split over the batch axes, tp on heads / mlp /
  vocab). A weight (`weight=True`) is gathered to its `rules` layout in the forward pass, and
  its cotangent is constrained to the weight's *stored* layout (`stored_rules`, fsdp-split) in
  the backward pass (a custom VJP): the partial per-device gradient then goes straight to a
  reduce-scatter into the shard each device stores, instead of an all-reduce of the whole
  gradient first. A dimension whose size the rule's mesh axes do not divide stays whole (as in
  `meshes.logical_to_spec`).
  """
  def sharding(x, axes, table):
    return NamedSharding(mesh, meshes.logical_to_spec(axes, x.shape, mesh, table))

  def gather(x, axes):
    @jax.custom_vjp
    def f(w):
      return jax.lax.with_sharding_constraint(w, sharding(w, axes, rules))

    def fwd(w):
      return f(w), None

    def bwd(_, ct):
      return (jax.lax.with_sharding_constraint(ct, sharding(ct, axes, stored_rules)),)

    f.defvjp(fwd, bwd)
    return f(x)

  def constrain(x: jax.Array, logical_axes: tuple[str | None, ...], weight: bool = False):
    if weight:
      return gather(x, tuple(logical_axes))
    return jax.lax.with_sharding_constraint(x, sharding(x, logical_axes, rules))
  return constrain


def learner_mesh(devices: Sequence[Any], cfg: LearnerConfig) -> Mesh:
  """Builds the learner mesh (``AxisType.Auto``) over `devices` with `cfg.mesh_axes`.

  Raises:
    ValueError: if the device count differs from the product of the axis sizes, or an axis
      name is not one of the learner rules' mesh axes (data, fsdp, tp).
  """
  return meshes.make_learner_mesh(devices, cfg.mesh_shape)


def replicated(mesh: Mesh) -> NamedSharding:
  """Sharding of a value kept whole on every device of `mesh`."""
  return NamedSharding(mesh, PartitionSpec())


def param_shardings(model_cfg: ModelConfig, mesh: Mesh,
                    rules: meshes.Rules = meshes.LEARNER_RULES) -> Any:
  """NamedSharding per parameter, from `transformer.param_axes` and the abstract shapes."""
  return meshes.logical_to_sharding(transformer.param_axes(model_cfg), mesh, rules,
                                    shapes=transformer.abstract_params(model_cfg))


def opt_state_shardings(tx: optax.GradientTransformation, abstract_opt_state: Any,
                        params_shardings: Any, mesh: Mesh) -> Any:
  """Shardings of an optax state: per-parameter leaves (moments) copy their parameter's.

  Args:
    tx: the optimizer whose state this is.
    abstract_opt_state: `jax.eval_shape(tx.init, abstract_params)`.
    params_shardings: NamedSharding tree with the params' structure.
    mesh: learner mesh (non-parameter leaves such as counts are replicated on it).

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


def batch_sharding(mesh: Mesh, shape: tuple[int, int],
                   rules: meshes.Rules = meshes.LEARNER_RULES) -> NamedSharding:
  """Sharding of one [B, L] batch array: rows over (data, fsdp) when they divide B."""
  return NamedSharding(mesh, meshes.logical_to_spec(BATCH_AXES, shape, mesh, rules))


def describe(shardings: Any) -> dict[str, str]:
  """{leaf path: PartitionSpec string}, for logs and tests."""
  flat, _ = jax.tree_util.tree_flatten_with_path(shardings)
  return {jax.tree_util.keystr(p): str(s.spec) for p, s in flat}
