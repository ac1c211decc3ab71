"""`PagedKVCache`: the paged implementation of the model's KV-cache interface.

`rlax_pipe.model.transformer.forward` carries the cache through its layer loop and calls
`cache.update_attend(layer, q, k, v, positions, valid)`; this cache scatters the new tokens' K/V
into their pages of that layer (in place: the pool is a loop carry) and attends causally by
position over each row's pages, with the jnp reference or a Pallas kernel (`kernels`).
"""

from __future__ import annotations

import jax
from absl import logging
from flax import struct
from jax.sharding import Mesh

from rlax_pipe.sampler import kernels
from rlax_pipe.sampler import paged_attention as pa
from rlax_pipe.sampler.page_pool import PoolLayout


@struct.dataclass
class PagedKVCache:
  """Paged KV cache pytree.

  Attributes:
    pools: tuple of pool arrays (`PoolLayout.shapes`; all layers folded into the page axis).
    block_tables: int32 [B, W] pages of each row (in [0, P)), in sequence order; entries past a
      row's pages may name any page (never read into an output).
    layout: the pool layout (static).
    impl: "reference" or a kernel of `kernels.KERNEL_IMPLS` (static). Decode-only kernels serve
      T == 1; longer rows (prefill) use the reference.
    chunk_pages: pages per iteration of the reference's loop over live pages (static).
    mesh: the replica's sampler mesh, for `shard_map` around kernels (static; None = one device).
    interpret: run Pallas kernels in interpret mode (static; CPU tests).
  """

  pools: tuple[jax.Array, ...]
  block_tables: jax.Array
  layout: PoolLayout = struct.field(pytree_node=False)
  impl: str = struct.field(pytree_node=False, default="reference")
  chunk_pages: int = struct.field(pytree_node=False, default=16)
  mesh: Mesh | None = struct.field(pytree_node=False, default=None)
  interpret: bool = struct.field(pytree_node=False, default=False)

  def update_attend(self, layer, q_BTHD, k_BTKD, v_BTKD, positions_BT, valid_BT, *,
                    window=None, sinks=None):
    """Writes K/V of valid tokens into their pages of `layer`, then attends over each row's pages.

    Sliding windows and sinks run on the reference path (`paged_attention_reference`): the
    kernels JAX ships take no sink logits, and the engine resolves `impl` to "reference" for
    such models (`resolve_impl(..., model_cfg)`, with a logged reason).

    Args:
      layer: int32 scalar layer index.
      q_BTHD: [B, T, H, D] queries of the new tokens.
      k_BTKD, v_BTKD: [B, T, K, D] keys (RoPE applied) and values of the new tokens.
      positions_BT: int32 [B, T] absolute positions (< W * S for valid tokens).
      valid_BT: bool [B, T]; invalid tokens write nothing (their outputs are meaningless).
      window: optional int32 scalar sliding window of this layer (tokens; 0 = full).
      sinks: optional float32 [H] sink logits of this layer.

    Returns:
      (out [B, T, H, D], updated cache); a valid query at position p sees positions 0..p.
    """
    if positions_BT.shape[0] != self.block_tables.shape[0]:
      raise ValueError(f"{positions_BT.shape[0]} rows of tokens but block tables "
                       f"{self.block_tables.shape}.")
    page, offset = pa.page_slots(self.block_tables, positions_BT, self.layout.page_size)
    pools = self.layout.write(self.pools, layer, k_BTKD, v_BTKD, page, offset, valid_BT)
    t = q_BTHD.shape[1]
    if window is not None or sinks is not None:
      out = pa.paged_attention_reference(q_BTHD, pools, self.layout, layer, self.block_tables,
                                         positions_BT, valid_BT, chunk_pages=self.chunk_pages,
                                         window=window, sinks_H=sinks)
    elif self.impl == "pallas_tpu_ragged" or (self.impl in kernels.DECODE_ONLY and t == 1):
      out = kernels.attend(self.impl, q_BTHD, pools, self.layout, layer, self.block_tables,
                           positions_BT, valid_BT, mesh=self.mesh, interpret=self.interpret)
    else:
      out = pa.paged_attention_reference(q_BTHD, pools, self.layout, layer, self.block_tables,
                                         positions_BT, valid_BT, chunk_pages=self.chunk_pages)
    return out, self.replace(pools=pools)


def reference_only_reason(model) -> str | None:
  """Why `model` must use the reference paged attention, or None: attention sinks or
  sliding-window layers (read from a built-in model's `cfg`), which the Pallas kernels JAX ships
  do not take (no sink logits; windows only in the ragged TPU kernel, as a static argument)."""
  cfg = getattr(model, "cfg", None)
  features = [name for name, on in (
      ("attention sinks", getattr(cfg, "attention_sinks", False)),
      ("sliding-window layers", getattr(cfg, "layer_windows", None) is not None)) if on]
  if not features:
    return None
  return (f"the model has {' and '.join(features)}, which JAX's Pallas paged-attention kernels "
          "do not support")


def resolve_impl(attention_impl: str, mesh: Mesh, head_dim: int | None = None, *,
                 reference_reason: str | None = None) -> str:
  """Picks the attention implementation for `mesh` ("auto": by the mesh's platform; on TPU the
  Pallas kernels need head_dim % 128 == 0, so other head dims get the reference).

  With a `reference_reason` (`reference_only_reason(model)`), a kernel choice (explicit or
  "auto") falls back to "reference" and the reason is logged.

  Compiled for TPU (issue #28, v5e, `rlax_pipe.aot`): with head_dim 64 (Llama-3.2-1B) the
  paged-attention kernel fails to lower (a block's last dim must divide by 128) and the ragged
  kernel asserts; at head_dim 128 both lower, and `pallas_tpu` has the fewer kernels per step.

  Raises:
    ValueError: for a kernel requested on a platform that cannot run it natively (use
      "reference", or the kernel functions with interpret=True in tests).
  """
  if reference_reason is not None:
    wanted = resolve_impl(attention_impl, mesh, head_dim) if attention_impl == "auto" else (
        attention_impl)
    if wanted != "reference":
      logging.warning("sampler attention_impl=%r (%s) -> 'reference': %s.", attention_impl,
                      wanted, reference_reason)
    return "reference"
  platform = mesh.devices.flat[0].platform
  if attention_impl == "auto":
    if platform == "tpu" and head_dim is not None and head_dim % 128:
      return "reference"
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform, "reference")
  needs = {"pallas_gpu": "gpu", "pallas_tpu": "tpu", "pallas_tpu_ragged": "tpu"}.get(
      attention_impl)
  if needs is not None and platform != needs:
    raise ValueError(f"attention_impl={attention_impl!r} needs a {needs.upper()} sampler mesh; "
                     f"this mesh has {mesh.size} {platform} device(s). Use 'reference' or 'auto'.")
  return attention_impl


def uses_combined_layout(impl: str) -> bool:
  """Whether `impl` stores the pool K/V-combined ([L*P, S, 2K, D])."""
  return impl == "pallas_tpu_ragged"
