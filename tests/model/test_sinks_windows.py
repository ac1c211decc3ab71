"""GPT-OSS attention features of the built-in model: learned sinks, sliding-window layers, o_proj
bias. Checked against a float64 numpy version of the softmax-with-sink formula, the dense
reference cache (cached decode == full forward), and the paged reference (paged == dense)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe.config import ModelConfig
from rlax_pipe.model import transformer
from rlax_pipe.model.kv_cache import DenseKVCache, gqa_attention, window_mask
from rlax_pipe.sampler import paged_attention as pa
from rlax_pipe.sampler.page_pool import PoolLayout
from rlax_pipe.sampler.paged_cache import PagedKVCache, reference_only_reason, resolve_impl

# The tests' programs are tiny and compile-bound: LLVM at -O0 compiles them faster and
# computes the same values (no fast-math either way).
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=48, qkv_bias=True, o_bias=True, attention_sinks=True, sliding_window=3,
                  layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                  max_seq_len=32)


def _numpy_attention(q, k, v, sinks, window):
  """float64: p_s = exp(z_s) / (exp(sink_h) + sum exp(z_s')) over s <= t, t - s < window."""
  b, t, h, d = q.shape
  g = h // k.shape[2]
  out = np.zeros((b, t, h, d))
  for i in range(t):
    keys = [s for s in range(i + 1) if window <= 0 or i - s < window]
    for head in range(h):
      z = np.stack([np.sum(q[:, i, head] * k[:, s, head // g], -1) for s in keys], 1) / np.sqrt(d)
      e = np.exp(np.concatenate([z, np.full((b, 1), sinks[head])], axis=1))
      p = e[:, :-1] / e.sum(axis=1, keepdims=True)
      out[:, i, head] = np.einsum("bs,bsd->bd", p, v[:, keys, head // g])
  return out


@pytest.mark.parametrize("window", [0, 2])
def test_gqa_attention_with_sinks_and_window_matches_numpy(window):
  rng = np.random.default_rng(window)
  q = rng.normal(size=(2, 6, 4, 8))
  k, v = rng.normal(size=(2, 6, 2, 8)), rng.normal(size=(2, 6, 2, 8))
  sinks = rng.normal(size=4) * 2
  pos = np.arange(6)
  mask = (pos[None, :, None] >= pos[None, None, :]) & window_mask(
      pos[None, :, None], pos[None, None, :], window)
  got = gqa_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
                      jnp.broadcast_to(jnp.asarray(mask), (2, 6, 6)),
                      sinks_H=jnp.asarray(sinks, jnp.float32))
  np.testing.assert_allclose(got, _numpy_attention(q, k, v, sinks, window), atol=2e-6)


def test_config_rejects_inconsistent_layer_types():
  with pytest.raises(ValueError, match="sliding_window"):
    dataclasses.replace(CFG, sliding_window=None)
  with pytest.raises(ValueError, match="one per layer"):
    dataclasses.replace(CFG, layer_types=("full_attention",))
  assert CFG.layer_windows == (3, 0, 3)
  assert dataclasses.replace(CFG, layer_types=()).layer_windows is None


def _params(cfg, seed=0):
  """Every leaf N(0, 0.4) with numpy (nothing to compile): biases and sinks non-zero, so each
  one matters."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: jnp.asarray(rng.normal(0.0, 0.4, a.shape), jnp.float32),
                      transformer.abstract_params(cfg))


def test_a_windowed_layer_sees_only_its_window():
  """One sliding layer of window 3: token 0 reaches the logits at positions 0..2 only."""
  params = _params(CFG)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (1, 10)), jnp.int32)
  pos = jnp.arange(10, dtype=jnp.int32)[None]
  cfg1 = dataclasses.replace(CFG, n_layers=1, layer_types=("sliding_attention",))
  p1 = {**params, "layers": jax.tree.map(lambda a: a[:1], params["layers"])}
  fwd = jit(lambda t: transformer.forward(p1, t, pos, cfg1)[0])
  a, b = fwd(tokens), fwd(tokens.at[0, 0].set((tokens[0, 0] + 1) % 64))
  np.testing.assert_array_equal(a[0, 3:], b[0, 3:])
  assert np.max(np.abs(np.asarray(a[0, :3] - b[0, :3]))) > 0


def test_training_path_blockwise_and_packed_match_full_forward():
  params = _params(CFG, 2)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, 64, (1, 11)), jnp.int32)
  pos = jnp.arange(11, dtype=jnp.int32)[None]
  ppos = jnp.asarray([list(range(5)) + list(range(6))], jnp.int32)
  seg = jnp.asarray([[1] * 5 + [2] * 6], jnp.int32)

  @jit
  def run(p):
    full, _ = transformer.forward(p, tokens, pos, CFG)
    head = transformer.output_head(p, CFG)
    blockwise = transformer.hidden_states(p, tokens, pos, CFG, attention_block_len=4) @ head
    # Two samples packed in one row (positions restart): each equals its own forward.
    packed = transformer.hidden_states(p, tokens, ppos, CFG, segment_ids_BT=seg) @ head
    second, _ = transformer.forward(p, tokens[:, 5:], ppos[:, 5:], CFG)
    return full, blockwise, packed, second

  full, blockwise, packed, second = run(params)
  np.testing.assert_allclose(blockwise, full, atol=2e-5)
  np.testing.assert_allclose(packed[:, 5:], second, atol=2e-5)


def test_dense_cache_decode_matches_full_forward():
  params = _params(CFG, 4)
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 9)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
  full, _ = jit(lambda p: transformer.forward(p, tokens, pos, CFG))(params)
  step = jit(lambda p, t, q, c: transformer.forward(p, t, q, CFG, cache=c))
  cache = DenseKVCache.init(CFG.n_layers, 2, 16, CFG.n_kv_heads, CFG.head_dim)
  logits, cache = step(params, tokens[:, :4], pos[:, :4], cache)
  steps = [logits]
  for t in range(4, 9):
    out, cache = step(params, tokens[:, t:t + 1], pos[:, t:t + 1], cache)
    steps.append(out)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5)


K, G, D, S, P, W = 2, 2, 8, 4, 24, 5


@pytest.mark.parametrize("window,chunk_pages", [(0, 2), (3, 1), (6, 2), (9, 1)])
def test_paged_reference_with_sinks_and_window_matches_dense(window, chunk_pages):
  """Prefill chunks and decodes after cached prefixes, through random pages holding garbage."""
  layout = PoolLayout(1, K, P, S, D)
  rng = np.random.default_rng(window)
  starts = np.array([0, 3, 9, 14])
  chunk, b = 3, 4
  perm = rng.permutation(P)
  tables = perm[:b * W].reshape(b, W).astype(np.int32)
  k_all = rng.normal(size=(b, W * S, K, D)).astype(np.float32)
  v_all = rng.normal(size=(b, W * S, K, D)).astype(np.float32)
  sinks = jnp.asarray(rng.normal(size=K * G), jnp.float32)
  prefix_pos = np.broadcast_to(np.arange(W * S), (b, W * S)).astype(np.int32)
  positions = (starts[:, None] + np.arange(chunk)[None, :]).astype(np.int32)
  q = rng.normal(size=(b, chunk, K * G, D)).astype(np.float32)
  new_k = np.take_along_axis(k_all, positions[:, :, None, None], axis=1)
  new_v = np.take_along_axis(v_all, positions[:, :, None, None], axis=1)
  pools = tuple(jnp.asarray(rng.normal(size=s) * 100, jnp.float32) for s in layout.shapes)
  page, offset = pa.page_slots(jnp.asarray(tables), jnp.asarray(prefix_pos), S)
  pools = layout.write(pools, 0, jnp.asarray(k_all), jnp.asarray(v_all), page, offset,
                       jnp.asarray(prefix_pos < starts[:, None]))
  cache = PagedKVCache(pools=pools, block_tables=jnp.asarray(tables), layout=layout,
                       chunk_pages=chunk_pages)
  out, _ = jit(lambda c: c.update_attend(jnp.int32(0), q, new_k, new_v, positions,
                                             jnp.ones((b, chunk), bool), window=jnp.int32(window),
                                             sinks=sinks))(cache)
  key_pos = np.arange(W * S)
  mask = (key_pos[None, None] <= positions[:, :, None]) & np.asarray(
      window_mask(positions[:, :, None], key_pos[None, None], window))
  expected = gqa_attention(q, k_all, v_all, jnp.asarray(mask), sinks_H=sinks)
  np.testing.assert_allclose(out, expected, atol=2e-6, rtol=1e-5)


def test_kernels_fall_back_to_reference_with_a_reason():
  from rlax_pipe.model.builtin import Transformer
  reason = reference_only_reason(Transformer(CFG))
  assert "sinks" in reason and "sliding-window" in reason
  assert reference_only_reason(Transformer(ModelConfig())) is None
  mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,))
  assert resolve_impl("pallas_gpu", mesh, 8, reference_reason=reason) == "reference"
