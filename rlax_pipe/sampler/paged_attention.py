"""Paged attention, pure-jnp reference: causal grouped-query attention through block tables.

Row b of a block table [B, W] lists the pages of sequence b in order, so position p of that
sequence lives at page `block_tables[b, p // S]`, offset `p % S`. Pages past a sequence's length
may hold anything (stale tokens of earlier owners, NaN, padding page 0).

Length-aware: the reference loops over chunks of C pages with an online softmax (Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax"; the flash-decoding recurrence), and
runs only the chunks that hold live tokens: ceil((longest live row) / (C * S)) iterations. So a
step's attention work follows the longest live sequence in the batch, not the block-table width.

Sliding windows and sinks (GPT-OSS): with a window of W tokens a query at p sees only keys
p - W + 1 .. p, and the loop starts at the first chunk any row's window reaches, so a windowed
layer's work follows the window, not the sequence. A sink logit per head starts the online
softmax as an extra key with value 0 (running max = sink, normaliser = 1, accumulator = 0), which
is the softmax over [scores, sink] with the sink's probability dropped.

Masking by selection: scores at masked keys are replaced (`where`) by a large negative value, their
probabilities by exact zeros, and values at keys beyond a row's last live position by zeros
before the weighted sum, so a NaN or inf in a stale page never reaches a real token.

Letters: B rows, T queries per row, H query heads, K kv heads, G = H / K, D head dim, P pages per
layer, S page size, W block-table width, C pages per chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_pipe.model.kv_cache import MASK_VALUE, last_valid_position, window_mask
from rlax_pipe.sampler.page_pool import PoolLayout


def page_slots(block_tables_BW: jax.Array, positions_BT: jax.Array, page_size: int):
  """(page, offset) of every token: page = block_tables[b, p // S], offset = p % S.

  Args:
    block_tables_BW: int32 [B, W] page ids per row.
    positions_BT: int32 [B, T] token positions (positions >= W * S are clipped to the last
      column: callers mark such tokens invalid).
    page_size: S.

  Returns:
    (page int32 [B, T], offset int32 [B, T]).
  """
  width = block_tables_BW.shape[1]
  index = jnp.clip(positions_BT // page_size, 0, width - 1)
  page = jnp.take_along_axis(block_tables_BW, index, axis=1)
  return page.astype(jnp.int32), (positions_BT % page_size).astype(jnp.int32)


def _check(q_BTHD, layout: PoolLayout, block_tables_BW, positions_BT):
  if q_BTHD.ndim != 4 or positions_BT.shape != q_BTHD.shape[:2]:
    raise ValueError(f"q {q_BTHD.shape} must be [B, T, H, D] with positions {positions_BT.shape}.")
  if block_tables_BW.ndim != 2 or block_tables_BW.shape[0] != q_BTHD.shape[0]:
    raise ValueError(f"block tables {block_tables_BW.shape} must be [B, W] for q {q_BTHD.shape}.")
  h, d = q_BTHD.shape[2:]
  if h % layout.num_kv_heads or d != layout.head_dim:
    raise ValueError(f"q heads/dim {h}/{d} do not fit the pool's {layout.num_kv_heads} kv heads "
                     f"of dim {layout.head_dim}.")


def paged_attention_reference(q_BTHD: jax.Array, pools, layout: PoolLayout, layer,
                              block_tables_BW: jax.Array, positions_BT: jax.Array,
                              valid_BT: jax.Array, *, chunk_pages: int, window=None,
                              sinks_H: jax.Array | None = None) -> jax.Array:
  """Causal grouped-query attention over paged K/V (Vaswani et al. 2017 eq. 1; GQA).

  The valid query at position p of row b attends to that row's keys at positions 0..p.

  Args:
    q_BTHD: [B, T, H, D] queries (RoPE applied); H a multiple of K.
    pools: the pool arrays (`PoolLayout.shapes`), already holding this step's new K/V.
    layout: the pool's layout (static).
    layer: int32 scalar layer index.
    block_tables_BW: int32 [B, W] pages of each row (of this layer, in [0, P)).
    positions_BT: int32 [B, T] query positions (< W * S for valid queries).
    valid_BT: bool [B, T]; keys beyond a row's last valid position are never read into the
      output; invalid queries get 0 (or a finite value) and must be ignored by the caller.
    chunk_pages: C, pages per loop iteration (static, >= 1).
    window: optional int32 scalar sliding window (tokens; 0 = full; `kv_cache.window_mask`).
    sinks_H: optional float32 [H] sink logits (`kv_cache.gqa_attention`).

  Returns:
    [B, T, H, D] in q's dtype; scores, softmax and the weighted sum in fp32.

  Raises:
    ValueError: on rank or head mismatch.
  """
  _check(q_BTHD, layout, block_tables_BW, positions_BT)
  b, t, h, d = q_BTHD.shape
  kvh, s = layout.num_kv_heads, layout.page_size
  c = max(1, min(chunk_pages, block_tables_BW.shape[1]))
  pad = -block_tables_BW.shape[1] % c
  tables = jnp.pad(block_tables_BW, ((0, 0), (0, pad))) if pad else block_tables_BW
  last_B = last_valid_position(positions_BT, valid_BT)
  n_chunks = (jnp.max(last_B) + c * s) // (c * s)  # chunks holding positions 0..max(last)
  q = q_BTHD.reshape(b, t, kvh, h // kvh, d)
  scale = 1.0 / jnp.sqrt(jnp.float32(d))

  def body(j, carry):
    m, l, acc = carry
    pages_BC = jax.lax.dynamic_slice_in_dim(tables, j * c, c, axis=1)
    k_KBLD, v_KBLD = layout.read_chunk(pools, layer, pages_BC)
    key_pos = j * c * s + jnp.arange(c * s, dtype=jnp.int32)
    live_BL = key_pos[None, :] <= last_B[:, None]
    visible = (key_pos[None, None, :] <= positions_BT[:, :, None]) & live_BL[:, None, :]
    if window is not None:
      visible = visible & window_mask(positions_BT[:, :, None], key_pos[None, None, :], window)
    visible = visible[:, None, None]  # [B, 1, 1, T, L]
    v_KBLD = jnp.where(live_BL[None, :, :, None], v_KBLD, jnp.zeros((), v_KBLD.dtype))
    scores = jnp.einsum("btkgd,kbld->bkgtl", q, k_KBLD.astype(q.dtype),
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible, scores, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    probs = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    correction = jnp.exp(m - m_new)
    l = l * correction + jnp.sum(probs, axis=-1)
    acc = acc * correction[..., None] + jnp.einsum(
        "bkgtl,kbld->bkgtd", probs.astype(q.dtype), v_KBLD.astype(q.dtype),
        preferred_element_type=jnp.float32)
    return m_new, l, acc

  shape = (b, kvh, h // kvh, t)
  if sinks_H is None:
    init = (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (d,), jnp.float32))
  else:  # the sink as a first key of value 0: m = sink, l = exp(sink - sink) = 1
    sinks = jnp.broadcast_to(sinks_H.astype(jnp.float32).reshape(1, kvh, h // kvh, 1), shape)
    init = (sinks, jnp.ones(shape, jnp.float32), jnp.zeros(shape + (d,), jnp.float32))
  first_chunk = 0
  if window is not None:  # chunks wholly before every valid query's window hold nothing visible
    lo = jnp.min(jnp.where(valid_BT, positions_BT - window + 1, jnp.iinfo(jnp.int32).max))
    first_chunk = jnp.where(window > 0, jnp.clip(lo, 0, None) // (c * s), 0)
    first_chunk = jnp.minimum(first_chunk, n_chunks).astype(n_chunks.dtype)
  _, l, acc = jax.lax.fori_loop(first_chunk, n_chunks, body, init)
  out = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, d).astype(q_BTHD.dtype)


def dense_view(pools, layout: PoolLayout, layer, block_tables_BW: jax.Array):
  """Every page of each row of `layer`, contiguous: (keys, values), each [K, B, W * S, D].

  For tests and debugging (reads the whole block-table width).
  """
  return layout.read_chunk(pools, layer, block_tables_BW)
