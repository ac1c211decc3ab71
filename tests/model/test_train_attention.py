"""Fused training attention (JAX's Pallas flash kernels, interpreted on CPU) against a float64
dense reference and against the learner's blockwise attention (values and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from rlax_pipe.learner import LearnerConfig
from rlax_pipe.model import train_attention as ta
from rlax_pipe.model import transformer

B, T, D = 2, 128, 16  # T: the TPU kernel's smallest block (128 lanes)


def _inputs(H=2, K=1):
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32)
  k = jax.random.normal(ks[1], (B, T, K, D), jnp.float32)
  v = jax.random.normal(ks[2], (B, T, K, D), jnp.float32)
  # row 0: two packed samples and padding; row 1: one sample, padding holding NaN
  seg = np.zeros((B, T), np.int32)
  seg[0, :50], seg[0, 50:110] = 1, 2
  seg[1, :90] = 1
  k = k.at[1, 100].set(jnp.nan)
  v = v.at[1, 100].set(jnp.nan)
  return q, k, v, jnp.asarray(seg)


def _dense_reference(q, k, v, seg):
  """Float64 numpy: softmax(q k^T / sqrt(D)) v over keys s <= t of the same segment (GQA:
  head h reads kv head h // (H / K)); padding keys and values zeroed, as the learner does."""
  H, K = q.shape[2], k.shape[2]  # pylint: disable=invalid-name
  q, k, v, seg = (np.asarray(x, np.float64) for x in (q, k, v, seg))
  real = (seg > 0)[:, :, None, None]
  k, v = np.where(real, k, 0.0), np.where(real, v, 0.0)
  out = np.zeros_like(q)
  for b in range(B):
    for h in range(H):
      s = q[b, :, h] @ k[b, :, h // (H // K)].T / np.sqrt(D)
      allowed = np.tril(np.ones((T, T), bool)) & (seg[b][:, None] == seg[b][None, :])
      s = np.where(allowed, s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, h // (H // K)]
  return out


def _loss(attend):
  w = jnp.cos(jnp.arange(D, dtype=jnp.float32))[None, None, None, :]
  return lambda q, k, v: (attend(q, k, v) * w).sum()


# Interpreting a kernel costs seconds of tracing per call: the gradients (the same wrapper code
# for both kernels) are checked through the TPU kernel only.
@pytest.mark.parametrize("kernel,grads", [("pallas_tpu_interpret", True),
                                          ("pallas_gpu_interpret", False)])
def test_kernel_matches_dense_reference_and_blockwise_gradients(kernel, grads):
  q, k, v, seg = _inputs()
  flash = lambda q, k, v: ta.flash_attention(q, k, v, seg, kernel, block_len=128)
  out = jax.jit(flash)(q, k, v)
  assert out.shape == q.shape and out.dtype == jnp.float32
  assert bool(jnp.isfinite(out).all())
  np.testing.assert_allclose(out, _dense_reference(q, k, v, seg), atol=2e-5, rtol=1e-5)
  if not grads:
    return
  blockwise = lambda q, k, v: transformer.blockwise_attention(q, k, v, seg, 64)
  got = jax.jit(jax.grad(_loss(flash), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(_loss(blockwise), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    assert bool(jnp.isfinite(g).all())
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-4)


def test_sharded_kernel_on_fsdp_x_tp_mesh_matches_blockwise():
  q, k, v, seg = _inputs(H=4, K=2)  # rows over fsdp, heads (4 q / 2 kv) over tp
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tp"))
  attend = ta.sharded_flash_attention("pallas_gpu_interpret", 128, mesh)
  out = jax.jit(attend)(q, k, v, seg)
  np.testing.assert_allclose(out, transformer.blockwise_attention(q, k, v, seg, None),
                             atol=2e-5, rtol=1e-5)


def test_resolve_train_attention():
  assert ta.resolve_train_attention("blockwise", "tpu", 2048) == "blockwise"
  assert ta.resolve_train_attention("flash", "tpu", 2048, 512) == "pallas_tpu"
  assert ta.resolve_train_attention("flash", "gpu", 2048) == "pallas_gpu"
  assert ta.resolve_train_attention("flash", "cpu", 256) == "pallas_tpu_interpret"
  assert ta.resolve_train_attention("auto", "cpu", 2048) == "blockwise"
  assert ta.resolve_train_attention("auto", "tpu", 2048) == "pallas_tpu"
  assert ta.resolve_train_attention("auto", "tpu", 200) == "blockwise"  # no 128-block fits
  with pytest.raises(ValueError, match="attention_impl='flash'.*200 tokens"):
    ta.resolve_train_attention("flash", "tpu", 200)
  with pytest.raises(ValueError, match="attention_impl='dense'"):
    ta.resolve_train_attention("dense", "tpu", 2048)
  with pytest.raises(ValueError, match="learner.attention_impl='fused'.*blockwise"):
    LearnerConfig(attention_impl="fused")
  with pytest.raises(ValueError, match="kernel 'blockwise'"):
    ta.flash_attention(*_inputs(), "blockwise")
