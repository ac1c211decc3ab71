"""Expert parallelism on 8 virtual CPU devices: experts split over "expert", tokens exchanged by
all-to-all; values and gradients equal to a dense every-expert reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlax_pipe import sharding as sharding_lib
from rlax_pipe.model import moe_parallel

T, E, F, X, K = 32, 8, 6, 4, 2


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(T, E)).astype(np.float32)
  ids = np.stack([rng.choice(X, K, replace=False) for _ in range(T)]).astype(np.int32)
  w = rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)
  p = {"experts_gate": rng.normal(size=(X, E, F)).astype(np.float32) / 3,
       "experts_up": rng.normal(size=(X, E, F)).astype(np.float32) / 3,
       "experts_down": rng.normal(size=(X, F, E)).astype(np.float32) / 3}
  return x, ids, w, p


def _dense_reference(x, ids, w, p):
  """Every expert on every token, weighted by the routing weight of (token, expert) or 0."""
  gate = jnp.einsum("te,xef->xtf", x, p["experts_gate"])
  up = jnp.einsum("te,xef->xtf", x, p["experts_up"])
  y = jnp.einsum("xtf,xfe->xte", jax.nn.silu(gate) * up, p["experts_down"])
  combine = jnp.sum(jax.nn.one_hot(ids, X) * w[:, :, None], axis=1)  # [T, X]
  return jnp.einsum("xte,tx->te", y, combine)


def _numpy_reference(x, ids, w, p):
  x, w = x.astype(np.float64), w.astype(np.float64)
  out = np.zeros((T, E))
  for t in range(T):
    for j in range(K):
      i = ids[t, j]
      g, u = x[t] @ p["experts_gate"][i], x[t] @ p["experts_up"][i]
      out[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ p["experts_down"][i])
  return out


@pytest.fixture(scope="module")
def mesh():
  return sharding_lib.make_mesh(jax.devices()[:8], {"expert": 2, "fsdp": 4},
                                sharding_lib.LEARNER_RULES)


def test_expert_parallel_matches_the_reference_and_exchanges_by_all_to_all(mesh):
  x, ids, w, p = _inputs()
  fn = jax.jit(lambda *a: moe_parallel.expert_parallel_swiglu(*a, mesh=mesh))
  out = fn(x, ids, w, p)
  np.testing.assert_allclose(np.asarray(out), _numpy_reference(x, ids, w, p), rtol=1e-5,
                             atol=1e-5)
  hlo = fn.lower(x, ids, w, p).compile().as_text()
  assert hlo.count("all-to-all") >= 3  # dispatch (rows + ids) and combine
  # tokens split over fsdp x expert (the learner's batch axes): 32 / 8 rows per device
  assert out.sharding.shard_shape(out.shape) == (T // 8, E)


def test_expert_parallel_gradients_equal_the_dense_reference(mesh):
  x, ids, w, p = _inputs(1)

  def loss(fn, x, w, p):
    return jnp.sum(jnp.sin(fn(x, ids, w, p)))

  ep = lambda x, ids, w, p: moe_parallel.expert_parallel_swiglu(x, ids, w, p, mesh)
  got = jax.jit(jax.grad(lambda *a: loss(ep, *a), argnums=(0, 1, 2)))(x, w, p)
  want = jax.grad(lambda *a: loss(_dense_reference, *a), argnums=(0, 1, 2))(x, w, p)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5)


def test_expert_weights_are_split_per_device_by_the_rules(mesh):
  x, _, _, p = _inputs()
  axes = {"experts_gate": ("expert", "embed", "mlp"), "experts_up": ("expert", "embed", "mlp"),
          "experts_down": ("expert", "mlp", "embed")}
  shardings = sharding_lib.logical_to_sharding(axes, mesh, sharding_lib.LEARNER_RULES, p)
  assert shardings["experts_gate"].spec == P("expert", "fsdp", None)
  assert shardings["experts_down"].spec == P("expert", None, "fsdp")
  placed = jax.device_put(p, shardings)
  for shard in placed["experts_gate"].addressable_shards:
    assert shard.data.shape == (X // 2, E // 4, F)  # 2 of 4 experts, a quarter of embed
  # a dense weight's embed dim takes fsdp x expert (one more FSDP axis outside the experts)
  dense = sharding_lib.logical_to_spec(("embed", "mlp"), (E, F), mesh,
                                       sharding_lib.LEARNER_RULES)
  assert dense == P(("fsdp", "expert"), None)
  # under the compute rules the expert dim stays split, embed is gathered
  assert sharding_lib.logical_to_spec(("expert", "embed", "mlp"), (X, E, F), mesh,
                                      sharding_lib.LEARNER_COMPUTE_RULES) == P("expert", None,
                                                                                None)


def test_expert_parallel_errors(mesh):
  x, ids, w, p = _inputs()
  no_expert = sharding_lib.make_mesh(jax.devices()[:2], {"fsdp": 2})
  with pytest.raises(ValueError, match="no 'expert' axis"):
    moe_parallel.expert_parallel_swiglu(x, ids, w, p, no_expert)
  odd = {k: v[:3] for k, v in p.items()}
  with pytest.raises(ValueError, match="divisible"):
    moe_parallel.expert_parallel_swiglu(x, ids, w, odd, mesh)
