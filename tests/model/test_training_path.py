"""The transformer's training path (no cache): blockwise attention, padding, remat policies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe.config import ModelConfig
from rlax_pipe.model import kv_cache, transformer

TINY = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4,
                   d_ff=32)


def _packed_segments(b, t, rng):
  seg = np.zeros((b, t), np.int32)
  for r in range(b):
    cut, end = int(rng.integers(2, t - 3)), t - int(rng.integers(0, 3))
    seg[r, :cut], seg[r, cut:end] = 1, 2
  return jnp.asarray(seg)


@pytest.mark.parametrize("block_len", [None, 3, 4, 11])
def test_blockwise_attention_equals_one_dense_call(block_len):
  """Outputs and gradients match `gqa_attention` with the packed causal mask at every real
  query (T = 11: blocks of 3 and 4 leave a padded last block)."""
  rng = np.random.default_rng(0)
  b, t = 2, 11
  q = jnp.asarray(rng.normal(size=(b, t, 4, 4)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, t, 2, 4)), jnp.float32) for _ in range(2))
  seg = _packed_segments(b, t, rng)
  real = (seg > 0)[:, :, None, None]
  w = jnp.asarray(rng.normal(size=(b, t, 4, 4)), jnp.float32)

  def ours(q, k, v):
    return jnp.sum(jnp.where(real, w * transformer.blockwise_attention(q, k, v, seg, block_len),
                             0.0))

  def dense(q, k, v):
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    mask = causal[None] & (seg[:, :, None] == seg[:, None, :])
    return jnp.sum(jnp.where(real, w * kv_cache.gqa_attention(q, k, v, mask), 0.0))

  got, want = (jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, k, v) for f in (ours, dense))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for a, b_ in zip(got[1], want[1]):
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-6)


def test_padding_values_never_reach_real_tokens():
  """NaN keys / values at padding positions leave every real token's output unchanged."""
  rng = np.random.default_rng(1)
  b, t = 2, 9
  q = jnp.asarray(rng.normal(size=(b, t, 4, 4)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, t, 2, 4)), jnp.float32) for _ in range(2))
  seg = _packed_segments(b, t, rng)
  assert bool(jnp.any(seg == 0))
  pad = (seg == 0)[:, :, None, None]
  clean = transformer.blockwise_attention(q, k, v, seg, 4)
  dirty = transformer.blockwise_attention(q, jnp.where(pad, jnp.nan, k), jnp.where(pad, jnp.nan, v),
                                          seg, 4)
  real = np.asarray(seg > 0)
  np.testing.assert_array_equal(np.asarray(dirty)[real], np.asarray(clean)[real])


def test_hidden_states_match_forward_and_remat_policies_agree():
  rng = np.random.default_rng(2)
  params = transformer.init_params(TINY, jax.random.key(0))
  tokens = jnp.asarray(rng.integers(0, 32, (2, 10)), jnp.int32)
  seg = _packed_segments(2, 10, rng)
  pos = jnp.asarray(np.concatenate([np.arange(10)[None]] * 2), jnp.int32)
  logits, _, h_fwd = transformer.forward(params, tokens, pos, TINY, segment_ids_BT=seg,
                                         return_hidden=True)
  for remat in transformer.REMAT_POLICIES:
    h = transformer.hidden_states(params, tokens, pos, TINY, segment_ids_BT=seg, remat=remat,
                                  attention_block_len=4)
    np.testing.assert_allclose(h, h_fwd, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="remat policy"):
    transformer.hidden_states(params, tokens, pos, TINY, remat="sometimes")
