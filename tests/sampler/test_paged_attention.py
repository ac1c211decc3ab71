"""Paged attention vs dense causal attention; PagedKVCache vs DenseKVCache; NaN isolation;
length-aware work; the pool's in-place ops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe.model.kv_cache import DenseKVCache, gqa_attention
from rlax_pipe.sampler import paged_attention as pa
from rlax_pipe.sampler.page_pool import PoolLayout
from rlax_pipe.sampler.paged_cache import PagedKVCache, resolve_impl

K, G, D, S, P, W, L = 2, 3, 8, 4, 40, 6, 2  # kv heads, group, dim, page, pool, width, layers
H = K * G
LAYOUTS = {"split": PoolLayout(L, K, P, S, D), "combined": PoolLayout(L, K, P, S, D,
                                                                       combined=True)}


def _random_tables(rng, lengths, width=W):
  """Non-contiguous random pages: each row gets ceil(len / S) distinct pages of a shuffled pool;
  the rest of its row names page 0 (padding)."""
  perm = rng.permutation(P)
  tables, used = np.zeros((len(lengths), width), np.int32), 0
  for b, n in enumerate(lengths):
    k = -(-n // S)
    tables[b, :k] = perm[used:used + k]
    used += k
  return tables


def _garbage_pools(rng, layout, nan=False):
  """Pools full of large garbage (stale pages); with nan=True, NaN instead."""
  fill = (lambda shape: np.full(shape, np.nan, np.float32)) if nan else (
      lambda shape: (rng.normal(size=shape) * 100).astype(np.float32))
  return tuple(jnp.asarray(fill(s)) for s in layout.shapes)


def _dense_reference(q_BTHD, k_BLKD, v_BLKD, positions_BT):
  mask = jnp.arange(k_BLKD.shape[1])[None, None, :] <= positions_BT[:, :, None]
  return gqa_attention(q_BTHD, k_BLKD, v_BLKD, mask)


def _write(layout, pools, layer, tables, k_new, v_new, positions, valid):
  page, offset = pa.page_slots(jnp.asarray(tables), jnp.asarray(positions), S)
  return layout.write(pools, layer, jnp.asarray(k_new), jnp.asarray(v_new), page, offset,
                      jnp.asarray(valid))


@pytest.mark.parametrize("layout_name", ["split", "combined"])
@pytest.mark.parametrize("chunk,chunk_pages,nan", [(1, 2, False), (5, 4, False), (1, 1, True),
                                                   (5, 3, True)])
def test_reference_matches_dense_causal_attention(layout_name, chunk, chunk_pages, nan):
  """Rows with ragged lengths (partly filled last pages) write K/V for positions
  [start, start + chunk) after a cached prefix of `start` tokens, then attend. Stale pages hold
  garbage, or NaN (issue #14 item 8: NaN in a stale page must not reach a real token)."""
  layout = LAYOUTS[layout_name]
  rng = np.random.default_rng(chunk + 10 * chunk_pages)
  starts = np.array([0, 3, 9, 14, W * S - chunk])  # page-aligned, mid-page, and a full table
  b = len(starts)
  total = starts + chunk
  tables = _random_tables(rng, total)
  k_all = rng.normal(size=(b, W * S, K, D)).astype(np.float32)
  v_all = rng.normal(size=(b, W * S, K, D)).astype(np.float32)
  prefix_pos = np.broadcast_to(np.arange(W * S), (b, W * S)).astype(np.int32)
  prefix_valid = prefix_pos < starts[:, None]
  positions = (starts[:, None] + np.arange(chunk)[None, :]).astype(np.int32)
  q = rng.normal(size=(b, chunk, H, D)).astype(np.float32)
  new_k = np.take_along_axis(k_all, positions[:, :, None, None], axis=1)
  new_v = np.take_along_axis(v_all, positions[:, :, None, None], axis=1)
  layer = 1

  @jax.jit
  def paged(pools):
    pools = _write(layout, pools, layer, tables, k_all, v_all, prefix_pos, prefix_valid)
    cache = PagedKVCache(pools=pools, block_tables=jnp.asarray(tables), layout=layout,
                         chunk_pages=chunk_pages)
    out, cache = cache.update_attend(jnp.int32(layer), q, new_k, new_v, positions,
                                     jnp.ones((b, chunk), bool))
    return out, pa.dense_view(cache.pools, layout, layer, jnp.asarray(tables))

  out, (gathered_k, _) = paged(_garbage_pools(rng, layout, nan))
  assert np.all(np.isfinite(out))
  expected = _dense_reference(q, k_all, v_all, positions)
  np.testing.assert_allclose(out, expected, atol=2e-6, rtol=1e-5)
  gathered_k = np.asarray(gathered_k)  # [K, B, L, D]: the pages hold the first total[b] tokens
  for row in range(b):
    np.testing.assert_array_equal(gathered_k[:, row, :total[row]],
                                  k_all[row, :total[row]].transpose(1, 0, 2))


def test_writes_touch_only_their_layer_and_valid_tokens():
  layout = LAYOUTS["split"]
  rng = np.random.default_rng(0)
  pools = _garbage_pools(rng, layout)
  tables = _random_tables(rng, [8, 8])
  new = rng.normal(size=(2, 3, K, D)).astype(np.float32)
  positions = np.array([[0, 1, 2], [5, 6, 7]], np.int32)
  valid = np.array([[True, False, True], [False, False, False]])
  out = jax.jit(_write, static_argnums=0)(layout, pools, 1, tables, new, new, positions, valid)
  changed = np.nonzero(np.any(np.asarray(out[0]) != np.asarray(pools[0]), axis=(0, 3)))
  assert sorted(zip(*changed)) == [(P + tables[0, 0], 0), (P + tables[0, 0], 2)]  # layer 1


def test_paged_cache_matches_dense_cache_through_prefill_and_decode():
  """Same call sequence (prefill chunk, then single-token decode steps) on both caches."""
  layout = LAYOUTS["split"]
  rng = np.random.default_rng(1)
  lengths = np.array([7, 1, 12])
  b, steps, max_len = len(lengths), 5, W * S
  tables = jnp.asarray(_random_tables(rng, lengths + steps))
  paged = PagedKVCache(pools=_garbage_pools(rng, layout), block_tables=tables, layout=layout,
                       chunk_pages=2)
  dense = DenseKVCache.init(L, b, max_len, K, D)
  t = int(lengths.max())
  calls = [(np.broadcast_to(np.arange(t), (b, t)), np.arange(t)[None, :] < lengths[:, None])]
  calls += [((lengths + i)[:, None], np.ones((b, 1), bool)) for i in range(steps)]

  @jax.jit
  def both(paged, dense, q, kn, vn, pos, valid):
    out_p, paged = paged.update_attend(jnp.int32(0), q, kn, vn, pos, valid)
    out_d, dense = dense.update_attend(jnp.int32(0), q, kn, vn, pos, valid)
    return out_p, out_d, paged, dense

  for pos, valid in calls:
    pos = pos.astype(np.int32)
    q = rng.normal(size=pos.shape + (H, D)).astype(np.float32)
    kn = rng.normal(size=pos.shape + (K, D)).astype(np.float32)
    vn = rng.normal(size=pos.shape + (K, D)).astype(np.float32)
    out_p, out_d, paged, dense = both(paged, dense, q, kn, vn, pos, valid)
    np.testing.assert_allclose(np.asarray(out_p)[valid], np.asarray(out_d)[valid], atol=2e-6)


def test_dense_attention_selects_out_nan_padding_and_stale_entries():
  """A NaN in a padding key (key_valid False) or a stale cache entry never reaches an output."""
  rng = np.random.default_rng(3)
  q = rng.normal(size=(1, 4, H, D)).astype(np.float32)
  k = rng.normal(size=(1, 6, K, D)).astype(np.float32)
  v = rng.normal(size=(1, 6, K, D)).astype(np.float32)
  seg = np.array([[1, 1, 0, 1, 0, 0]])  # keys 2, 4, 5 are padding
  k_nan, v_nan = k.copy(), v.copy()
  k_nan[:, seg[0] == 0], v_nan[:, seg[0] == 0] = np.nan, np.nan
  mask = (np.arange(6)[None, :] <= np.array([1, 3, 3, 3])[:, None])[None] & (seg[:, None, :] == 1)
  clean = gqa_attention(q, k, v, mask, key_valid_BS=seg == 1)
  got = gqa_attention(q, k_nan, v_nan, mask, key_valid_BS=seg == 1)
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, clean, atol=1e-6)
  cache = DenseKVCache.init(1, 1, 8, K, D).replace(
      k=jnp.full((1, 1, 8, K, D), jnp.nan), v=jnp.full((1, 1, 8, K, D), jnp.nan))
  out, _ = cache.update_attend(jnp.int32(0), q[:, :2], k[:, :2], v[:, :2],
                               np.array([[0, 1]], np.int32), np.ones((1, 2), bool))
  assert np.all(np.isfinite(out))


def _eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      yield from _eqns(sub)


def test_attention_work_follows_live_pages_not_table_width():
  """The reference loops over chunks of C pages while a chunk holds live positions; each
  iteration reads a [K, B, C * S, D] slice: widening the block table 16x changes neither the
  reads per iteration nor the loop (checked on the jaxpr), and the page reads sit inside the
  loop (nothing reads the whole table width)."""
  layout = LAYOUTS["split"]
  rng = np.random.default_rng(4)

  def structure(width):
    tables = jnp.asarray(_random_tables(rng, [5, 9], width=width))
    q = jnp.zeros((2, 1, H, D))
    pos = jnp.array([[4], [8]], jnp.int32)
    fn = lambda pools: pa.paged_attention_reference(
        q, pools, layout, jnp.int32(0), tables, pos, jnp.ones((2, 1), bool), chunk_pages=2)
    jaxpr = jax.make_jaxpr(fn)(_garbage_pools(rng, layout)).jaxpr
    loops = [e for e in jaxpr.eqns if e.primitive.name == "while"]
    assert len(loops) == 1
    outside = [e for e in jaxpr.eqns if e.primitive.name == "gather"]
    inside = sorted(tuple(v.aval.shape) for e in _eqns(loops[0].params["body_jaxpr"].jaxpr)
                    for v in e.outvars if e.primitive.name == "gather")
    return outside, inside

  (out4, in4), (out64, in64) = structure(4), structure(64)
  assert not out4 and not out64 and in4 == in64
  assert (K, 2, 2, S, D) in in4, in4


def test_shape_errors_are_explicit():
  layout = LAYOUTS["split"]
  pools = tuple(jnp.zeros(s) for s in layout.shapes)
  with pytest.raises(ValueError, match=r"\[B, T, H, D\]"):
    pa.paged_attention_reference(jnp.zeros((1, H, D)), pools, layout, 0,
                                 jnp.zeros((1, W), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                                 jnp.ones((1, 1), bool), chunk_pages=2)
  with pytest.raises(ValueError, match="kv heads"):
    pa.paged_attention_reference(jnp.zeros((1, 1, H + 1, D)), pools, layout, 0,
                                 jnp.zeros((1, W), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                                 jnp.ones((1, 1), bool), chunk_pages=2)


def test_kernel_selection_by_backend():
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1], dtype=object), ("tp",))
  platform = jax.devices()[0].platform
  assert resolve_impl("auto", mesh) == {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(
      platform, "reference")
  if platform == "cpu":
    for impl in ("pallas_gpu", "pallas_tpu", "pallas_tpu_ragged"):
      with pytest.raises(ValueError, match="needs a"):
        resolve_impl(impl, mesh)


def test_page_copies_and_zeroing_cover_every_layer():
  from rlax_pipe.sampler import device_loop, page_pool  # pylint: disable=import-outside-toplevel
  for layout in LAYOUTS.values():
    rng = np.random.default_rng(5)
    pools = _garbage_pools(rng, layout)
    before = [np.asarray(p) for p in pools]
    mesh = page_pool.default_mesh()
    src, dst = jnp.array([3, 0], jnp.int32), jnp.array([7, P], jnp.int32)  # second: padding
    copied = page_pool.copy_pages(tuple(jnp.array(p) for p in before), src, dst, layout=layout,
                                  sharding=layout.sharding(mesh))
    zeroed = device_loop.zero_pages(tuple(jnp.array(p) for p in before), jnp.array([5, P]),
                                    layout=layout, sharding=layout.sharding(mesh))
    for b, c, z in zip(before, copied, zeroed):
      page_axis = 0 if layout.combined else 1
      pages = lambda x: np.moveaxis(np.asarray(x), page_axis, 0).reshape(
          (L, P) + np.moveaxis(x, page_axis, 0).shape[1:])
      pb, pc, pz = pages(b), pages(c), pages(z)
      np.testing.assert_array_equal(pc[:, 7], pb[:, 3])
      np.testing.assert_array_equal(np.delete(pc, 7, axis=1), np.delete(pb, 7, axis=1))
      assert np.all(pz[:, 5] == 0)
      np.testing.assert_array_equal(np.delete(pz, 5, axis=1), np.delete(pb, 5, axis=1))
