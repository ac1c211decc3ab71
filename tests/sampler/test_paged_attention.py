"""Paged attention vs dense causal attention; PagedKVCache vs DenseKVCache; Pallas vs reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe.model.kv_cache import DenseKVCache, gqa_attention
from rlax_pipe.sampler import paged_attention as pa
from rlax_pipe.sampler.paged_cache import PagedKVCache, resolve_impl

K, G, D, S, P, W = 2, 3, 8, 4, 40, 6  # kv heads, group, head dim, page size, pool, table width
H = K * G


def _random_tables(rng, lengths):
  """Non-contiguous random pages: each row gets ceil(len / S) distinct pages of a shuffled pool;
  the rest of its row names page 0 (padding)."""
  perm = rng.permutation(P)
  tables, used = np.zeros((len(lengths), W), np.int32), 0
  for b, n in enumerate(lengths):
    k = -(-n // S)
    tables[b, :k] = perm[used:used + k]
    used += k
  return tables


def _dense_reference(q_BTHD, k_BLKD, v_BLKD, positions_BT):
  mask = jnp.arange(k_BLKD.shape[1])[None, None, :] <= positions_BT[:, :, None]
  return gqa_attention(q_BTHD, k_BLKD, v_BLKD, mask)


@pytest.mark.parametrize("chunk", [1, 5])
def test_reference_matches_dense_causal_attention(chunk):
  """Rows with ragged lengths (partly filled last pages) write K/V for positions
  [start, start + chunk) after a cached prefix of `start` tokens, then attend."""
  rng = np.random.default_rng(chunk)
  starts = np.array([0, 3, 9, 14, W * S - chunk])  # page-aligned, mid-page, and a full table
  b = len(starts)
  total = starts + chunk
  tables = _random_tables(rng, total)
  k_all = rng.normal(size=(b, W * S, K, D)).astype(np.float32)
  v_all = rng.normal(size=(b, W * S, K, D)).astype(np.float32)
  # Pool full of garbage: stale pages must never be read.
  k_pages = rng.normal(size=(K, P, S, D)).astype(np.float32) * 100
  v_pages = rng.normal(size=(K, P, S, D)).astype(np.float32) * 100
  prefix_pos = np.broadcast_to(np.arange(W * S), (b, W * S))
  prefix_valid = prefix_pos < starts[:, None]
  positions = (starts[:, None] + np.arange(chunk)[None, :]).astype(np.int32)
  q = rng.normal(size=(b, chunk, H, D)).astype(np.float32)
  new_k = np.take_along_axis(k_all, positions[:, :, None, None], axis=1)
  new_v = np.take_along_axis(v_all, positions[:, :, None, None], axis=1)

  @jax.jit
  def paged_and_dense(k_pages, v_pages):
    k_pages = pa.write_pages(k_pages, k_all, tables, prefix_pos, prefix_valid)
    v_pages = pa.write_pages(v_pages, v_all, tables, prefix_pos, prefix_valid)
    cache = PagedKVCache(k=k_pages[None], v=v_pages[None], block_tables=jnp.asarray(tables))
    out, k_pages, _ = cache.update_attend(k_pages, v_pages, q, new_k, new_v, positions,
                                          jnp.ones((b, chunk), bool))
    return out, _dense_reference(q, k_all, v_all, positions), pa.gather_pages(k_pages, tables)

  out, expected, gathered = paged_and_dense(k_pages, v_pages)
  np.testing.assert_allclose(out, expected, atol=2e-6, rtol=1e-5)
  # The pages now hold exactly the first total[b] positions of every row.
  gathered = np.asarray(gathered)  # [K, B, L, D]
  for row in range(b):
    np.testing.assert_array_equal(gathered[:, row, :total[row]],
                                  k_all[row, :total[row]].transpose(1, 0, 2))


def test_invalid_tokens_write_nothing():
  rng = np.random.default_rng(0)
  pages = jnp.asarray(rng.normal(size=(K, P, S, D)).astype(np.float32))
  tables = _random_tables(rng, [8, 8])
  new = rng.normal(size=(2, 3, K, D)).astype(np.float32)
  positions = np.array([[0, 1, 2], [5, 6, 7]], np.int32)
  valid = np.array([[True, False, True], [False, False, False]])
  out = np.asarray(jax.jit(pa.write_pages)(pages, new, tables, positions, valid))
  changed = np.nonzero(np.any(out != np.asarray(pages), axis=(0, 3)))
  assert sorted(zip(*changed)) == [(tables[0, 0], 0), (tables[0, 0], 2)]


def test_paged_cache_matches_dense_cache_through_prefill_and_decode():
  """Same call sequence (prefill chunk, then single-token decode steps) on both caches."""
  rng = np.random.default_rng(1)
  lengths = np.array([7, 1, 12])
  b, steps, max_len = len(lengths), 5, W * S
  tables = jnp.asarray(_random_tables(rng, lengths + steps))
  paged = PagedKVCache(k=jnp.zeros((1, K, P, S, D)), v=jnp.zeros((1, K, P, S, D)),
                       block_tables=tables)
  dense = DenseKVCache.init(1, b, max_len, K, D)
  pk, pv, dk, dv = paged.k[0], paged.v[0], dense.k[0], dense.v[0]
  t = int(lengths.max())
  calls = [(np.broadcast_to(np.arange(t), (b, t)), np.arange(t)[None, :] < lengths[:, None])]
  calls += [((lengths + i)[:, None], np.ones((b, 1), bool)) for i in range(steps)]
  @jax.jit
  def both(pk, pv, dk, dv, q, kn, vn, pos, valid):
    out_p, pk, pv = paged.update_attend(pk, pv, q, kn, vn, pos, valid)
    out_d, dk, dv = dense.update_attend(dk, dv, q, kn, vn, pos, valid)
    return out_p, out_d, pk, pv, dk, dv

  for pos, valid in calls:
    pos = pos.astype(np.int32)
    q = rng.normal(size=pos.shape + (H, D)).astype(np.float32)
    kn = rng.normal(size=pos.shape + (K, D)).astype(np.float32)
    vn = rng.normal(size=pos.shape + (K, D)).astype(np.float32)
    out_p, out_d, pk, pv, dk, dv = both(pk, pv, dk, dv, q, kn, vn, pos, valid)
    np.testing.assert_allclose(np.asarray(out_p)[valid], np.asarray(out_d)[valid], atol=2e-6)


def test_pallas_gpu_kernel_matches_reference_in_interpret_mode():
  """JAX's Pallas GPU paged decode kernel, run by the Pallas interpreter on CPU."""
  rng = np.random.default_rng(2)
  lengths = np.array([1, 6, 17, 24])
  tables = jnp.asarray(_random_tables(rng, lengths))
  k_pages = jnp.asarray(rng.normal(size=(K, P, S, D)).astype(np.float32))
  v_pages = jnp.asarray(rng.normal(size=(K, P, S, D)).astype(np.float32))
  q = jnp.asarray(rng.normal(size=(len(lengths), 1, H, D)).astype(np.float32))
  positions = jnp.asarray(lengths[:, None] - 1, jnp.int32)
  expected = jax.jit(pa.paged_attention_reference)(q, k_pages, v_pages, tables, positions)
  got = pa.paged_decode_pallas_gpu(q, k_pages, v_pages, tables, positions, interpret=True)
  np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)


def test_shape_errors_are_explicit():
  with pytest.raises(ValueError, match="decode-only"):
    pa.paged_decode_pallas_gpu(jnp.zeros((1, 2, H, D)), jnp.zeros((K, P, S, D)),
                               jnp.zeros((K, P, S, D)), jnp.zeros((1, W), jnp.int32),
                               jnp.zeros((1, 2), jnp.int32))
  with pytest.raises(ValueError, match="pages"):
    pa.gather_pages(jnp.zeros((P, S, D)), jnp.zeros((1, W), jnp.int32))


def test_kernel_selection_by_backend():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1], dtype=object), ("tp",))
  assert resolve_impl("auto", mesh) == ("pallas_gpu" if jax.devices()[0].platform == "gpu"
                                        else "reference")
  if jax.devices()[0].platform != "gpu":
    with pytest.raises(ValueError, match="one-device GPU"):
      resolve_impl("pallas_gpu", mesh)
