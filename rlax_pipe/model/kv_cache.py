"""KV-cache interface used by `transformer.forward`, and the dense reference cache.

A cache is a pytree that holds the keys and values of every layer (layer-stacked or folded into
one pool) plus whatever metadata it needs (block tables for the paged cache of
`rlax_pipe.sampler`). The forward carries the cache through its loop over layers and, per layer,
calls `cache.update_attend(layer, ...)` with the layer's index: the cache writes the new keys and
values of the valid tokens in place and returns attention outputs over everything cached so far
(causal by position) together with the updated cache. Carrying the whole cache (instead of
slicing it per layer as a scan input and rebuilding it as a scan output) lets XLA update it in
place: a step touches only what it writes and reads.

Masked positions are *selected out* (`jnp.where`), never multiplied by zero: a NaN or inf in a
position that a query may not see (a stale page, padding) cannot reach a real token, because
0 * NaN = NaN.

The contract as a model sees it (and `api.attend_with_cache` for models that loop over layers
in Python) is in `rlax_pipe.model.api`.

Letters: B batch, T new tokens, S cache length, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct

# Masked attention logits use a large finite negative number (not -inf) so that a fully masked
# row (padding) never computes inf - inf.
MASK_VALUE = -1e30


class KVCache(Protocol):
  """What `transformer.forward` needs from a cache (a pytree)."""

  def update_attend(self, layer, q_BTHD, k_BTKD, v_BTKD, positions_BT, valid_BT):
    """Writes new K/V of `layer` for valid tokens, then attends. Returns (out_BTHD, cache).

    Models with sliding-window layers or attention sinks also pass the keywords `window`
    (int32 scalar, tokens, 0 = full) and `sinks` (float32 [H]); caches that serve them accept
    these (`DenseKVCache`, the sampler's `PagedKVCache`).
    """
    ...


def window_mask(q_pos, k_pos, window) -> jax.Array:
  """True where key position k_pos is inside the sliding window of query position q_pos.

  A window of W tokens keeps keys q_pos - W < k_pos (HF `sliding_window_overlay`: the query
  and the W - 1 tokens before it); W <= 0 means no window (everything True). Arrays broadcast.
  """
  return (window <= 0) | (k_pos > q_pos - window)


def gqa_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                  mask_BTS: jax.Array, key_valid_BS: jax.Array | None = None,
                  sinks_H: jax.Array | None = None) -> jax.Array:
  """Grouped-query softmax attention with an explicit boolean mask.

  out[b, t, h] = sum_s softmax_s(q[b,t,h] . k[b,s,h // G] / sqrt(D) | mask) v[b,s,h // G],
  with G = H / K query heads per kv head (Ainslie et al. 2023, GQA; Vaswani et al. 2017 eq. 1).
  With sinks, head h's softmax has one more logit, sinks[h], whose probability is dropped:
  p_s = exp(z_s) / (exp(sinks[h]) + sum_s' exp(z_s')) (GPT-OSS's learned attention sinks;
  transformers `GptOssAttention`, eager path).

  Masked scores and probabilities are selected out with `where`, and values at keys outside
  `key_valid_BS` are replaced by 0 before the weighted sum, so NaN or inf held at such keys
  (padding, stale cache entries) never reaches an output. A query with no visible key gets 0.

  Args:
    q_BTHD: queries [B, T, H, D].
    k_BSKD: keys [B, S, K, D]; H must be a multiple of K.
    v_BSKD: values [B, S, K, D].
    mask_BTS: bool [B, T, S]; True where query t may attend to key s.
    key_valid_BS: bool [B, S], keys that hold real data (e.g. segment_ids != 0 in packed
      training rows, positions already written in a cache). None = keys visible to at least one
      query, which protects against stale entries but not against a padding key that padding
      queries attend to; pass it explicitly where padding may hold NaN.

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
  if key_valid_BS is None:
    key_valid_BS = jnp.any(mask_BTS, axis=1)
  mask_BTS = mask_BTS & key_valid_BS[:, None, :]
  g = h // kv
  q = q_BTHD.reshape(b, t, kv, g, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BSKD,
                      preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
  mask = mask_BTS[:, None, None, :, :]
  scores = jnp.where(mask, scores, MASK_VALUE)
  if sinks_H is None:
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)
  else:
    sinks = sinks_H.astype(jnp.float32).reshape(1, kv, g, 1, 1)
    m = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sinks)
    e = jnp.where(mask, jnp.exp(scores - m), 0.0)
    probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sinks - m))
  v_safe = jnp.where(key_valid_BS[:, :, None, None], v_BSKD, jnp.zeros((), v_BSKD.dtype))
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_BSKD.dtype), v_safe,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, d).astype(q_BTHD.dtype)


def last_valid_position(positions_BT: jax.Array, valid_BT: jax.Array) -> jax.Array:
  """int32 [B]: largest position of a valid token in each row (-1 for a row with none)."""
  return jnp.max(jnp.where(valid_BT, positions_BT, -1), axis=1).astype(jnp.int32)


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

  def update_attend(self, layer, q_BTHD, k_BTKD, v_BTKD, positions_BT, valid_BT, *,
                    window=None, sinks=None):
    """Writes K/V of valid tokens of `layer` at their positions, then attends causally.

    Args:
      layer: int32 scalar layer index.
      q_BTHD: [B, T, H, D] queries of the new tokens.
      k_BTKD, v_BTKD: [B, T, K, D] keys/values of the new tokens (RoPE already applied to k).
      positions_BT: int32 [B, T] absolute position of each new token (< S_max).
      valid_BT: bool [B, T]; invalid tokens (padding) write nothing.
      window: optional int32 scalar sliding window of this layer (tokens; 0 = full).
      sinks: optional float32 [H] sink logits of this layer (`gqa_attention`).

    Returns:
      (out [B, T, H, D], updated cache). A query at position p sees entries 0..p; entries past
      the row's last valid position (never written, or stale) are selected out.
    """
    b, t = positions_BT.shape
    s_max = self.k.shape[2]
    write_pos = jnp.where(valid_BT, positions_BT, s_max)  # out of bounds -> dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    layers = jnp.broadcast_to(layer, (b, t))
    k = self.k.at[layers, rows, write_pos].set(k_BTKD.astype(self.k.dtype), mode="drop")
    v = self.v.at[layers, rows, write_pos].set(v_BTKD.astype(self.v.dtype), mode="drop")
    key_pos = jnp.arange(s_max)
    mask = key_pos[None, None, :] <= positions_BT[:, :, None]
    if window is not None:
      mask = mask & window_mask(positions_BT[:, :, None], key_pos[None, None, :], window)
    live = key_pos[None, :] <= last_valid_position(positions_BT, valid_BT)[:, None]
    layer_k = jax.lax.dynamic_index_in_dim(k, layer, keepdims=False).astype(q_BTHD.dtype)
    layer_v = jax.lax.dynamic_index_in_dim(v, layer, keepdims=False).astype(q_BTHD.dtype)
    out = gqa_attention(q_BTHD, layer_k, layer_v, mask, key_valid_BS=live, sinks_H=sinks)
    return out, self.replace(k=k, v=v)
