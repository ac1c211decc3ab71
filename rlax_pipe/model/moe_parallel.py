"""Expert parallelism: the experts of an MoE layer split over the mesh's "expert" axis, tokens
sent to the devices holding their experts and back by two all-to-alls (GShard, Lepikhin et al.
2020, Sec. 2.2; the "dispatch / combine" pattern of Switch Transformers and Megatron-LM's
all-to-all token dispatcher).

`expert_parallel_swiglu` computes exactly what `moe.grouped_swiglu` computes, sum_j w[t, j] *
SwiGLU_{experts[t, j]}(x_t), under `jax.shard_map` over the whole mesh:

  tokens  [T, E]            split over the batch mesh axes (data, fsdp, expert: the learner's
                            compute rules), so each device holds n = T / batch-shards tokens;
  experts [X, E, F] ...     split over "expert" (X / ep per device, the rest of each weight
                            whole: its fsdp shards are all-gathered at the shard_map boundary and
                            its gradient reduce-scattered back, as for a dense weight);
  per device:  (1) the n*k (token, expert) assignments are sorted by expert id, i.e. by
               destination device d = id // (X / ep), then by local expert;
               (2) dispatch: a send buffer [ep, n*k, E] holds, in row d, the tokens bound for
               device d (packed at the front; the rest zero) and their local expert ids, and one
               `all_to_all` over "expert" delivers to every device the [ep, n*k, E] rows sent to
               it;
               (3) its X / ep experts run as one grouped matmul (`jax.lax.ragged_dot`) over the
               received rows sorted by local expert; rows past the real ones form no group
               (ragged_dot gives them zeros);
               (4) combine: the inverse `all_to_all` returns each row to its sender, which
               gathers its assignments' outputs and sums them with the routing weights.

Dropless, with no capacity factor: a device may send all n*k of its assignments to one device,
so each buffer row has room for n*k; the buffers are ep times the n*k rows a capacity-1
exchange would move (`jax.lax.ragged_all_to_all` would move only the real rows; it is not
lowered on CPU, so the tested path pads). The grouped matmul's real rows are the same as
without expert parallelism.

Letters: T tokens, E embed, X experts, k experts per token, F expert width, ep = expert-axis
size, n = tokens per device.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from rlax_pipe import sharding as sharding_lib

# experts_fn(x_sorted [M, E], group_sizes int32 [X_local], expert_params) -> [M, E]: every
# local expert's MLP on its contiguous group of rows (rows past sum(group_sizes) give zeros).
ExpertsFn = Callable[[jax.Array, jax.Array, Mapping[str, jax.Array]], jax.Array]


def sorted_swiglu(x_ME: jax.Array, group_sizes_X: jax.Array,
                  p: Mapping[str, jax.Array]) -> jax.Array:
  """SwiGLU experts (Shazeer 2020, eq. 6) down(silu(x W_gate) * (x W_up)) on rows already
  sorted by expert: rows [off_i, off_i + group_sizes[i]) use expert i.

  Args:
    x_ME: [M, E] rows sorted by expert.
    group_sizes_X: int32 [X] rows per expert (sum <= M; later rows give zeros).
    p: {"experts_gate": [X, E, F], "experts_up": [X, E, F], "experts_down": [X, F, E]}.

  Returns:
    [M, E] in x's dtype.
  """
  gate = jax.lax.ragged_dot(x_ME, p["experts_gate"], group_sizes_X)
  up = jax.lax.ragged_dot(x_ME, p["experts_up"], group_sizes_X)
  return jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["experts_down"], group_sizes_X)


def token_spec(mesh: Mesh, num_tokens: int,
               rules: sharding_lib.Rules = sharding_lib.LEARNER_COMPUTE_RULES) -> PartitionSpec:
  """How `num_tokens` flattened tokens [T, E] are split on `mesh`: over the rules' batch mesh
  axes that divide T (`sharding.logical_to_spec`), the model dim whole."""
  return sharding_lib.logical_to_spec((sharding_lib.BATCH, None), (num_tokens, 1), mesh, rules)


def _dispatch_combine(x_nE, experts_nk, weights_nk, p, *, ep: int, axis: str,
                      experts_fn: ExpertsFn):
  """The per-device body (module docstring, steps 1-4)."""
  n, e = x_nE.shape
  k = experts_nk.shape[1]
  x_local = next(iter(p.values())).shape[0]  # experts on this device, X / ep
  a = n * k
  flat = experts_nk.reshape(a).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True)  # assignments by (destination, local expert)
  sorted_ids = flat[order]
  dest = sorted_ids // x_local  # [a], non-decreasing
  counts = jnp.bincount(dest, length=ep).astype(jnp.int32)  # assignments per destination
  starts = jnp.cumsum(counts) - counts
  slot = jnp.arange(a, dtype=jnp.int32) - starts[dest]  # row within its destination block
  send_x = jnp.zeros((ep, a, e), x_nE.dtype).at[dest, slot].set(
      jnp.take(x_nE, order // k, axis=0), unique_indices=True)
  # local expert id per row; x_local marks an empty row (sorts after every real one)
  send_id = jnp.full((ep, a), x_local, jnp.int32).at[dest, slot].set(
      sorted_ids % x_local, unique_indices=True)
  recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=True)  # [ep, a, E]: row s from s
  recv_id = jax.lax.all_to_all(send_id, axis, 0, 0, tiled=True)
  rid = recv_id.reshape(ep * a)
  rorder = jnp.argsort(rid, stable=True)
  group_sizes = jnp.bincount(rid, length=x_local + 1)[:x_local].astype(jnp.int32)
  y_sorted = experts_fn(jnp.take(recv_x.reshape(ep * a, e), rorder, axis=0), group_sizes, p)
  y = jnp.zeros_like(y_sorted).at[rorder].set(y_sorted, unique_indices=True)
  back = jax.lax.all_to_all(y.reshape(ep, a, e), axis, 0, 0, tiled=True)  # row d from d
  out_sorted = back[dest, slot]  # [a, E], assignment order `order`
  out = jnp.zeros_like(out_sorted).at[order].set(out_sorted, unique_indices=True)
  return jnp.einsum("tke,tk->te", out.reshape(n, k, e), weights_nk.astype(x_nE.dtype))


def expert_parallel_swiglu(x_TE: jax.Array, experts_Tk: jax.Array, weights_Tk: jax.Array,
                           expert_params: Mapping[str, jax.Array], mesh: Mesh, *,
                           axis: str = sharding_lib.EXPERT_AXIS,
                           experts_fn: ExpertsFn = sorted_swiglu,
                           rules: sharding_lib.Rules = sharding_lib.LEARNER_COMPUTE_RULES
                           ) -> jax.Array:
  """sum_j weights[t, j] * MLP_{experts[t, j]}(x_t) with the experts split over `axis`
  (module docstring); equal to `moe.grouped_swiglu` up to float summation order.

  Args:
    x_TE: [T, E] token hidden states (compute dtype).
    experts_Tk: int32 [T, k] expert ids in [0, X).
    weights_Tk: [T, k] routing weights.
    expert_params: every leaf stacked over experts, leading dim X (X divisible by the size of
      `axis`); with the default `experts_fn`: {"experts_gate", "experts_up": [X, E, F],
      "experts_down": [X, F, E]}.
    mesh: the mesh; must have `axis`.
    axis: the expert mesh axis.
    experts_fn: the local experts' MLP on expert-sorted rows (`sorted_swiglu`; a variant such as
      GPT-OSS's clamped SwiGLU with biases plugs in here).
    rules: the compute rules whose batch axes split the tokens.

  Returns:
    [T, E] in x's dtype, split like the tokens.

  Raises:
    ValueError: if `axis` is not in the mesh, X is not divisible by its size, or shapes
      disagree.
  """
  if axis not in mesh.shape:
    raise ValueError(f"expert_parallel_swiglu: mesh axes {dict(mesh.shape)} have no {axis!r} "
                     "axis; add one to the mesh (--config.learner.mesh_axes) or use "
                     "moe.grouped_swiglu.")
  if x_TE.ndim != 2 or experts_Tk.shape != weights_Tk.shape or experts_Tk.shape[0] != (
      x_TE.shape[0]):
    raise ValueError(f"expert_parallel_swiglu: x {x_TE.shape} must be [T, E] and experts "
                     f"{experts_Tk.shape}, weights {weights_Tk.shape} both [T, k].")
  ep = mesh.shape[axis]
  n_experts = {v.shape[0] for v in expert_params.values()}
  if len(n_experts) != 1 or next(iter(n_experts)) % ep:
    raise ValueError(f"expert_parallel_swiglu: expert weights with leading dims {n_experts} "
                     f"must share one X divisible by the {axis!r} axis size {ep}.")
  tok = token_spec(mesh, x_TE.shape[0], rules)
  w_specs = {name: PartitionSpec(axis) for name in expert_params}
  body = lambda x, ids, w, p: _dispatch_combine(x, ids, w, p, ep=ep, axis=axis,
                                                experts_fn=experts_fn)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, w_specs), out_specs=tok,
                     check_vma=False)
  return fn(x_TE, experts_Tk, weights_Tk, dict(expert_params))


def uses_expert_parallelism(mesh: Mesh | None, axis: str = sharding_lib.EXPERT_AXIS) -> bool:
  """True when `mesh` splits experts (an `axis` of size > 1)."""
  return mesh is not None and mesh.shape.get(axis, 1) > 1


def expert_params_of(layer_params: Mapping[str, Any]) -> dict[str, jax.Array]:
  """The expert-stacked leaves of one MoE layer's params (names starting with "experts_")."""
  return {k: v for k, v in layer_params.items() if k.startswith("experts_")}
