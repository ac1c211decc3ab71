"""KV-cache interface used by `transformer.forward`, and the dense reference cache.

A cache is a pytree with layer-stacked key/value arrays `k` and `v` (leading axis = layers) plus
whatever metadata it needs (block tables for the paged cache of `rlax_pipe.sampler`). The forward
scans over layers and, per layer, calls `cache.update_attend(...)` with that layer's slice of `k`
and `v`: the cache writes the new keys/values for the valid tokens and returns attention outputs
over everything cached so far (causal by position). The contract as a model sees it (and
`api.attend_with_cache` for models that loop over layers in Python) is in `rlax_pipe.model.api`.

Letters: B batch, T new tokens, S cache length, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct

# Masked attention logits use a large finite negative number (not -inf) so that a fully masked
# row (padding) gives a finite uniform softmax instead of NaN.
MASK_VALUE = -1e30


class KVCache(Protocol):
  """What `transformer.forward` needs from a cache."""

  k: jax.Array  # [layers, ...]
  v: jax.Array  # [layers, ...]

  def update_attend(self, layer_k, layer_v, q_BTHD, k_BTKD, v_BTKD, positions_BT, valid_BT):
    """Writes new K/V for valid tokens, then attends. Returns (out_BTHD, layer_k, layer_v)."""
    ...

  def replace(self, **kwargs) -> "KVCache":
    ...


def gqa_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                  mask_BTS: jax.Array) -> jax.Array:
  """Grouped-query softmax attention with an explicit boolean mask.

  out[b, t, h] = sum_s softmax_s(q[b,t,h] . k[b,s,h // G] / sqrt(D) | mask) v[b,s,h // G],
  with G = H / K query heads per kv head (Ainslie et al. 2023, GQA; Vaswani et al. 2017 eq. 1).

  Args:
    q_BTHD: queries [B, T, H, D].
    k_BSKD: keys [B, S, K, D]; H must be a multiple of K.
    v_BSKD: values [B, S, K, D].
    mask_BTS: bool [B, T, S]; True where query t may attend to key s.

  Returns:
    [B, T, H, D] in q's dtype. Scores and softmax are computed in float32.

  Raises:
    ValueError: on rank or head-count mismatch.
  """
  if q_BTHD.ndim != 4 or k_BSKD.ndim != 4 or v_BSKD.ndim != 4 or mask_BTS.ndim != 3:
    raise ValueError(
        f"gqa_attention expects q [B,T,H,D], k/v [B,S,K,D], mask [B,T,S]; got "
        f"{q_BTHD.shape}, {k_BSKD.shape}, {v_BSKD.shape}, {mask_BTS.shape}.")
  b, t, h, d = q_BTHD.shape
  kv = k_BSKD.shape[2]
  if h % kv:
    raise ValueError(f"query heads {h} not a multiple of kv heads {kv}.")
  g = h // kv
  q = q_BTHD.reshape(b, t, kv, g, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BSKD,
                      preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
  scores = jnp.where(mask_BTS[:, None, None, :, :], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_BSKD.dtype), v_BSKD,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, d).astype(q_BTHD.dtype)


@struct.dataclass
class DenseKVCache:
  """Dense reference cache: one contiguous [S_max] slot per batch row.

  Attributes:
    k: [layers, B, S_max, K, D] cached keys (position s of row b lives at index s).
    v: [layers, B, S_max, K, D] cached values.
  """

  k: jax.Array
  v: jax.Array

  @classmethod
  def init(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
           dtype=jnp.float32) -> "DenseKVCache":
    """Zero cache of shape [layers, batch, max_len, kv_heads, head_dim]."""
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

  def update_attend(self, layer_k, layer_v, q_BTHD, k_BTKD, v_BTKD, positions_BT, valid_BT):
    """Writes K/V of valid tokens at their positions, then attends causally by position.

    Args:
      layer_k, layer_v: [B, S_max, K, D] this layer's cache.
      q_BTHD: [B, T, H, D] queries of the new tokens.
      k_BTKD, v_BTKD: [B, T, K, D] keys/values of the new tokens (RoPE already applied to k).
      positions_BT: int32 [B, T] absolute position of each new token (< S_max).
      valid_BT: bool [B, T]; invalid tokens (padding) write nothing.

    Returns:
      (out [B, T, H, D], layer_k, layer_v). A query at position p sees cache entries 0..p.
    """
    b, t = positions_BT.shape
    s_max = layer_k.shape[1]
    write_pos = jnp.where(valid_BT, positions_BT, s_max)  # out of bounds -> dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    layer_k = layer_k.at[rows, write_pos].set(k_BTKD.astype(layer_k.dtype), mode="drop")
    layer_v = layer_v.at[rows, write_pos].set(v_BTKD.astype(layer_v.dtype), mode="drop")
    key_pos = jnp.arange(s_max)
    mask = key_pos[None, None, :] <= positions_BT[:, :, None]
    out = gqa_attention(q_BTHD, layer_k.astype(q_BTHD.dtype), layer_v.astype(q_BTHD.dtype), mask)
    return out, layer_k, layer_v
