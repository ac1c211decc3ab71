"""GPT-OSS experts: the clamped SwiGLU and per-expert biases in the grouped matmul, against a
float64 numpy loop over tokens and their k experts (transformers `GptOssExperts` semantics)."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe.model import moe


def _np_glu(g, u, alpha, limit):
  g = np.minimum(g, limit)
  u = np.clip(u, -limit, limit)
  return (u + 1) * g / (1 + np.exp(-alpha * g))


def test_clamped_swiglu_matches_numpy_on_both_sides_of_the_limits():
  g = np.linspace(-12, 12, 49)
  u = np.linspace(9, -9, 49)
  got = moe.expert_glu(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32), "gpt_oss",
                       1.702, 7.0)
  np.testing.assert_allclose(got, _np_glu(g, u, 1.702, 7.0), rtol=2e-6, atol=1e-6)
  with pytest.raises(ValueError, match="gpt_oss"):
    moe.expert_glu(jnp.zeros(2), jnp.zeros(2), "gelu")


def test_biased_clamped_experts_match_numpy():
  rng = np.random.default_rng(0)
  t, e, x, f, k = 7, 6, 4, 5, 2
  xs = rng.normal(size=(t, e)) * 2
  experts = np.stack([rng.permutation(x)[:k] for _ in range(t)]).astype(np.int32)
  weights = rng.random((t, k))
  w_gate, w_up = rng.normal(size=(x, e, f)), rng.normal(size=(x, e, f))
  w_down = rng.normal(size=(x, f, e))
  b_gate, b_up, b_down = rng.normal(size=(x, f)), rng.normal(size=(x, f)), rng.normal(size=(x, e))
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  got = moe.grouped_swiglu(f32(xs), jnp.asarray(experts), f32(weights), f32(w_gate), f32(w_up),
                           f32(w_down), biases=(f32(b_gate), f32(b_up), f32(b_down)),
                           activation="gpt_oss", alpha=1.702, limit=2.0)
  want = np.zeros((t, e))
  for i in range(t):
    for j in range(k):
      ex = experts[i, j]
      h = _np_glu(xs[i] @ w_gate[ex] + b_gate[ex], xs[i] @ w_up[ex] + b_up[ex], 1.702, 2.0)
      want[i] += weights[i, j] * (h @ w_down[ex] + b_down[ex])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
