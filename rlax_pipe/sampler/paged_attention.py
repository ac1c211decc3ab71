"""Paged attention: write K/V into pages through block tables, and attend through them.

Per layer the pool is [K, P, S, D] (kv heads, pages, page size, head dim). Row b of a block
table [B, W] lists the pages of sequence b in order, so position p of that sequence lives at
page `block_tables[b, p // S]`, offset `p % S`. Pages past a sequence's length may hold anything
(stale tokens of earlier owners, padding page 0): attention masks every key position greater
than the query's own position, so only positions 0..p are ever read.

Two implementations behind one signature:
- `paged_attention_reference`: pure jnp (gather the pages of each row into a contiguous view,
  mask by position, grouped-query softmax in fp32). Runs on every backend; any number of queries
  per row (prefill and decode).
- `paged_decode_pallas_gpu`: JAX's Pallas GPU paged decode kernel
  (jax.experimental.pallas.ops.gpu.paged_attention; one query per row). Selected only on GPU;
  on CPU it runs in interpret mode for tests.

Letters: B rows, T queries per row, H query heads, K kv heads, G = H / K, D head dim, P pages,
S page size, W block-table width (pages per sequence), L = W * S.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rlax_pipe.model.kv_cache import MASK_VALUE


def _check_pages(pages_KPSD: jax.Array, block_tables_BW: jax.Array):
  if pages_KPSD.ndim != 4 or block_tables_BW.ndim != 2:
    raise ValueError(f"expected pages [K, P, S, D] and block tables [B, W], got "
                     f"{pages_KPSD.shape} and {block_tables_BW.shape}.")


def page_slots(block_tables_BW: jax.Array, positions_BT: jax.Array, valid_BT: jax.Array,
               num_pages: int, page_size: int):
  """(page, offset) of every token; invalid tokens get page = num_pages (out of bounds).

  Args:
    block_tables_BW: int32 [B, W] page ids per row.
    positions_BT: int32 [B, T] token positions (valid ones < W * page_size).
    valid_BT: bool [B, T].
    num_pages: pool size P.
    page_size: S.

  Returns:
    (page int32 [B, T], offset int32 [B, T]).
  """
  width = block_tables_BW.shape[1]
  index = jnp.clip(positions_BT // page_size, 0, width - 1)
  page = jnp.take_along_axis(block_tables_BW, index, axis=1)
  page = jnp.where(valid_BT, page, num_pages)
  return page.astype(jnp.int32), (positions_BT % page_size).astype(jnp.int32)


def write_pages(pages_KPSD: jax.Array, new_BTKD: jax.Array, block_tables_BW: jax.Array,
                positions_BT: jax.Array, valid_BT: jax.Array) -> jax.Array:
  """Scatters new keys (or values) into their pages; invalid tokens write nothing.

  Args:
    pages_KPSD: [K, P, S, D] one layer of the pool.
    new_BTKD: [B, T, K, D] new keys or values.
    block_tables_BW: int32 [B, W].
    positions_BT: int32 [B, T] absolute positions of the new tokens.
    valid_BT: bool [B, T].

  Returns:
    The updated [K, P, S, D] pages (cast to the pool dtype).
  """
  _check_pages(pages_KPSD, block_tables_BW)
  if new_BTKD.shape[:2] != positions_BT.shape or new_BTKD.shape[2] != pages_KPSD.shape[0]:
    raise ValueError(f"new K/V {new_BTKD.shape} vs positions {positions_BT.shape} and pages "
                     f"{pages_KPSD.shape}.")
  _, num_pages, page_size, _ = pages_KPSD.shape
  page, offset = page_slots(block_tables_BW, positions_BT, valid_BT, num_pages, page_size)
  values_KBTD = jnp.moveaxis(new_BTKD, 2, 0).astype(pages_KPSD.dtype)
  return pages_KPSD.at[:, page, offset].set(values_KBTD, mode="drop")


def gather_pages(pages_KPSD: jax.Array, block_tables_BW: jax.Array) -> jax.Array:
  """Contiguous view of each row's pages: [K, B, L] positions 0..L-1, L = W * S.

  Returns:
    [K, B, L, D] in the pool dtype.
  """
  _check_pages(pages_KPSD, block_tables_BW)
  k, _, s, d = pages_KPSD.shape
  b, w = block_tables_BW.shape
  return pages_KPSD[:, block_tables_BW].reshape(k, b, w * s, d)


def paged_attention_reference(q_BTHD: jax.Array, k_pages_KPSD: jax.Array,
                              v_pages_KPSD: jax.Array, block_tables_BW: jax.Array,
                              positions_BT: jax.Array) -> jax.Array:
  """Causal grouped-query attention over paged K/V (Vaswani et al. 2017 eq. 1; GQA).

  The query at position p of row b attends to that row's keys at positions 0..p.

  Args:
    q_BTHD: [B, T, H, D] queries (RoPE applied); H a multiple of K.
    k_pages_KPSD, v_pages_KPSD: [K, P, S, D] one layer of the pool.
    block_tables_BW: int32 [B, W].
    positions_BT: int32 [B, T] query positions (< W * S).

  Returns:
    [B, T, H, D] in q's dtype; scores and softmax in fp32.

  Raises:
    ValueError: on rank or head mismatch.
  """
  if q_BTHD.ndim != 4 or positions_BT.shape != q_BTHD.shape[:2]:
    raise ValueError(f"q {q_BTHD.shape} must be [B, T, H, D] with positions {positions_BT.shape}.")
  b, t, h, d = q_BTHD.shape
  kv = k_pages_KPSD.shape[0]
  if h % kv or k_pages_KPSD.shape[-1] != d:
    raise ValueError(f"q heads/dim {h}/{d} do not fit pages {k_pages_KPSD.shape}.")
  k_KBLD = gather_pages(k_pages_KPSD, block_tables_BW).astype(q_BTHD.dtype)
  v_KBLD = gather_pages(v_pages_KPSD, block_tables_BW).astype(q_BTHD.dtype)
  q = q_BTHD.reshape(b, t, kv, h // kv, d)
  scores = jnp.einsum("btkgd,kbld->bkgtl", q, k_KBLD,
                      preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
  key_pos = jnp.arange(k_KBLD.shape[2])
  mask_BTL = key_pos[None, None, :] <= positions_BT[:, :, None]
  scores = jnp.where(mask_BTL[:, None, None], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgtl,kbld->btkgd", probs.astype(v_KBLD.dtype), v_KBLD,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, d).astype(q_BTHD.dtype)


def _largest_divisor_at_most(n: int, cap: int) -> int:
  return max(i for i in range(1, min(n, cap) + 1) if n % i == 0)


def paged_decode_pallas_gpu(q_BTHD: jax.Array, k_pages_KPSD: jax.Array, v_pages_KPSD: jax.Array,
                            block_tables_BW: jax.Array, positions_BT: jax.Array, *,
                            interpret: bool = False) -> jax.Array:
  """Same contract as `paged_attention_reference` for T == 1, via the Pallas GPU kernel.

  The kernel takes pre-scaled queries [B, H, D] and per-row lengths (= position + 1). Its split
  over pages (k_splits) and compute block are the largest divisors of W up to 16 and 8. Checked
  against the reference in Pallas interpret mode on CPU; on hardware, Triton's dot needs
  head_dim and pages_per_compute_block * page_size of at least 16.

  Raises:
    ValueError: if T != 1 (the kernel is decode-only).
  """
  # Imported here: only the GPU path needs Pallas.
  from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

  b, t, h, d = q_BTHD.shape
  if t != 1:
    raise ValueError(f"paged_decode_pallas_gpu is decode-only (T == 1), got T = {t}.")
  width = block_tables_BW.shape[1]
  k_splits = _largest_divisor_at_most(width, 16)
  per_block = _largest_divisor_at_most(width // k_splits, 8)
  # Queries are cast to the pool dtype (never the pool to the query dtype: that copies the pool).
  q_BHD = (q_BTHD[:, 0].astype(jnp.float32) / math.sqrt(d)).astype(k_pages_KPSD.dtype)
  lengths = (positions_BT[:, 0] + 1).astype(jnp.int32)
  out = pallas_paged.paged_attention(
      q_BHD, k_pages_KPSD, v_pages_KPSD, block_tables_BW.astype(jnp.int32), lengths,
      k_splits=k_splits, pages_per_compute_block=per_block, interpret=interpret)
  return out.reshape(b, 1, h, d).astype(q_BTHD.dtype)
