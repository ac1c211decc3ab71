"""`PagedKVCache`: the paged implementation of the model's KV-cache interface.

`rlax_pipe.model.transformer.forward` scans over layers and calls
`cache.update_attend(layer_k, layer_v, q, k, v, positions, valid)` with one layer of the pool;
this cache writes the new tokens' K/V into their pages (through the block tables) and attends
causally by position over each row's pages.
"""

from __future__ import annotations

import jax
from flax import struct
from jax.sharding import Mesh

from rlax_pipe.sampler import paged_attention as pa


@struct.dataclass
class PagedKVCache:
  """Paged KV cache pytree.

  Attributes:
    k: [layers, K, P, S, D] key pages (the whole pool).
    v: [layers, K, P, S, D] value pages.
    block_tables: int32 [B, W] pages of each row, in sequence order (padding entries may name
      any page: positions past a row's query are masked).
    impl: "reference" or "pallas_gpu" (static). The Pallas kernel serves decode (T == 1) only;
      prefill always uses the reference.
    interpret: run the Pallas kernel in interpret mode (static; CPU tests).
  """

  k: jax.Array
  v: jax.Array
  block_tables: jax.Array
  impl: str = struct.field(pytree_node=False, default="reference")
  interpret: bool = struct.field(pytree_node=False, default=False)

  def update_attend(self, layer_k, layer_v, q_BTHD, k_BTKD, v_BTKD, positions_BT, valid_BT):
    """Writes K/V of valid tokens into their pages, then attends over each row's pages.

    Args:
      layer_k, layer_v: [K, P, S, D] this layer's pool.
      q_BTHD: [B, T, H, D] queries of the new tokens.
      k_BTKD, v_BTKD: [B, T, K, D] keys (RoPE applied) and values of the new tokens.
      positions_BT: int32 [B, T] absolute positions (< W * S).
      valid_BT: bool [B, T]; invalid tokens write nothing (their outputs are meaningless).

    Returns:
      (out [B, T, H, D], layer_k, layer_v); a query at position p sees positions 0..p.
    """
    if positions_BT.shape[0] != self.block_tables.shape[0]:
      raise ValueError(f"{positions_BT.shape[0]} rows of tokens but block tables "
                       f"{self.block_tables.shape}.")
    layer_k = pa.write_pages(layer_k, k_BTKD, self.block_tables, positions_BT, valid_BT)
    layer_v = pa.write_pages(layer_v, v_BTKD, self.block_tables, positions_BT, valid_BT)
    if self.impl == "pallas_gpu" and q_BTHD.shape[1] == 1:
      out = pa.paged_decode_pallas_gpu(q_BTHD, layer_k, layer_v, self.block_tables,
                                       positions_BT, interpret=self.interpret)
    else:
      out = pa.paged_attention_reference(q_BTHD, layer_k, layer_v, self.block_tables,
                                         positions_BT)
    return out, layer_k, layer_v


def resolve_impl(attention_impl: str, mesh: Mesh) -> str:
  """Picks the attention implementation for `mesh`.

  "auto" selects the Pallas GPU kernel only when the sampler mesh is a single GPU device (the
  kernel is a custom call that XLA cannot partition across devices); otherwise the reference.

  Raises:
    ValueError: for "pallas_gpu" requested on a mesh that is not a single GPU device.
  """
  devices = mesh.devices.flatten()
  single_gpu = len(devices) == 1 and devices[0].platform == "gpu"
  if attention_impl == "auto":
    return "pallas_gpu" if single_gpu else "reference"
  if attention_impl == "pallas_gpu" and not single_gpu:
    raise ValueError(f"attention_impl='pallas_gpu' needs a one-device GPU sampler mesh; this mesh "
                     f"has {len(devices)} {devices[0].platform} device(s). Use 'reference' or "
                     "'auto'.")
  return attention_impl
