"""MoE block: routing, grouped experts and aux losses against float64 numpy; the model's MoE
layers (mixed dense / MoE layout, cached decode == full forward, router replay, dense unchanged)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import model
from rlax_pipe.config import ModelConfig
from rlax_pipe.model import moe
from rlax_pipe.model import transformer

# The tests' own programs are tiny and compile-bound: LLVM at -O0 compiles them faster and
# computes the same values (no fast-math either way).
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

MOE_CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                      head_dim=8, d_ff=48, qk_norm=True, n_experts=4, n_experts_per_tok=2,
                      moe_d_ff=16, mlp_only_layers=(1,))


# ---- float64 numpy references of the equations ----------------------------------------------

def _np_softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def _np_route(logits, k, softmax_over, norm, experts=None):
  z = np.asarray(logits, np.float64)
  if experts is None:
    experts = np.stack([np.argsort(-row, kind="stable")[:k] for row in z])
  if softmax_over == "all":
    w = np.take_along_axis(_np_softmax(z), experts, -1)
    if norm:
      w = w / w.sum(-1, keepdims=True)
  else:
    w = _np_softmax(np.take_along_axis(z, experts, -1))
  return experts, w


def _np_swiglu_experts(x, experts, w, gate, up, down):
  x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j in range(experts.shape[1]):
      i = experts[t, j]
      g, u = x[t] @ gate[i], x[t] @ up[i]
      out[t] += w[t, j] * ((g / (1 + np.exp(-g))) * u) @ down[i]
  return out


def _np_aux(logits, experts, mask):
  z = np.asarray(logits, np.float64)
  m = np.asarray(mask, np.float64)
  n, x, k = m.sum(), z.shape[1], experts.shape[1]
  p = (_np_softmax(z) * m[:, None]).sum(0) / n
  f = np.array([((experts == i) * m[:, None]).sum() for i in range(x)]) / (n * k)
  lse = np.log(np.exp(z).sum(-1))
  return x * (f * p).sum(), (m * lse ** 2).sum() / n


@pytest.mark.parametrize("softmax_over,norm", [("all", True), ("all", False), ("topk", True)])
def test_route_matches_numpy(softmax_over, norm):
  logits = jax.random.normal(jax.random.key(0), (9, 6))
  experts, w = moe.route(logits, 3, softmax_over=softmax_over, norm_topk_prob=norm)
  ref_e, ref_w = _np_route(np.asarray(logits), 3, softmax_over, norm)
  np.testing.assert_array_equal(experts, ref_e)
  np.testing.assert_allclose(w, ref_w, rtol=1e-6, atol=1e-7)
  # Replay of other experts: weights from this router's logits at those ids, same rule.
  replay = np.array([[5, 0, 2]] * 9, np.int32)
  experts, w = moe.route(logits, 3, softmax_over=softmax_over, norm_topk_prob=norm,
                         experts_Tk=jnp.asarray(replay))
  np.testing.assert_array_equal(experts, replay)
  np.testing.assert_allclose(w, _np_route(np.asarray(logits), 3, softmax_over, norm, replay)[1],
                             rtol=1e-6, atol=1e-7)


def test_aux_losses_match_numpy():
  logits = 3 * jax.random.normal(jax.random.key(1), (10, 5))
  experts, _ = moe.route(logits, 2)
  mask = np.array([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], bool)
  lb_ref, z_ref = _np_aux(np.asarray(logits), np.asarray(experts), mask)
  np.testing.assert_allclose(moe.load_balance_loss(logits, experts, jnp.asarray(mask)), lb_ref,
                             rtol=1e-6)
  np.testing.assert_allclose(moe.z_loss(logits, jnp.asarray(mask)), z_ref, rtol=1e-6)
  # Perfectly uniform routing gives 1 (Switch eq. 4 normalisation).
  uniform = moe.load_balance_loss(jnp.zeros((4, 4)), jnp.array([[0, 1], [2, 3], [0, 1], [2, 3]]))
  np.testing.assert_allclose(uniform, 1.0, rtol=1e-6)


def test_moe_block_matches_numpy_and_replay_keeps_router_gradients():
  t, e, x, f, k = 11, 8, 4, 6, 2
  keys = jax.random.split(jax.random.key(2), 5)
  p = {"router": jax.random.normal(keys[0], (e, x)),
       "experts_gate": jax.random.normal(keys[1], (x, e, f)) / 3,
       "experts_up": jax.random.normal(keys[2], (x, e, f)) / 3,
       "experts_down": jax.random.normal(keys[3], (x, f, e)) / 3}
  xs = jax.random.normal(keys[4], (t, e))
  raw = lambda xs, p, r=None: moe.moe_block(xs, p, k=k, experts_Tk=r)
  block = jit(raw)
  out, experts, lb, z = block(xs, p)
  logits = np.asarray(xs, np.float64) @ np.asarray(p["router"], np.float64)
  ref_e, ref_w = _np_route(logits, k, "all", True)
  np.testing.assert_array_equal(experts, ref_e)
  ref = _np_swiglu_experts(np.asarray(xs), ref_e, ref_w, p["experts_gate"], p["experts_up"],
                           p["experts_down"])
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
  lb_ref, z_ref = _np_aux(logits, ref_e, np.ones(t))
  np.testing.assert_allclose([lb, z], [lb_ref, z_ref], rtol=1e-4)
  # Replaying its own routes reproduces the output; the router still gets a gradient.
  out2, experts2, _, _ = block(xs, p, experts)
  np.testing.assert_array_equal(experts2, experts)
  np.testing.assert_allclose(out2, out, rtol=1e-6, atol=1e-7)
  grad = jit(jax.grad(lambda p: raw(xs, p, experts)[0].sum()))(p)
  assert float(jnp.abs(grad["router"]).sum()) > 0


def test_layout_and_config_validation():
  assert MOE_CFG.layer_is_moe == (True, False, True)
  assert transformer.layer_segments(MOE_CFG) == (
      ("moe_layers", 0, 1, 0), ("layers", 0, 1, 1), ("moe_layers", 1, 2, 2))
  specs = model.param_specs(MOE_CFG)
  assert specs["layers"]["w_gate"][0] == (1, 32, 48)
  assert specs["moe_layers"]["experts_gate"] == ((2, 4, 32, 16),
                                                 ("layers", "expert", "embed", "mlp"))
  assert ModelConfig(n_experts=4, n_layers=4, decoder_sparse_step=2).layer_is_moe == (
      False, True, False, True)
  dense = ModelConfig()
  assert set(model.param_specs(dense)) == {"embed", "final_norm", "layers"}
  for bad, match in [(dict(n_experts=1), "n_experts"),
                     (dict(n_experts=4, n_experts_per_tok=5), "n_experts_per_tok"),
                     (dict(n_experts=4, router_softmax="sigmoid"), "router_softmax"),
                     (dict(n_experts=4, mlp_only_layers=(0, 1)), "no layer is MoE"),
                     (dict(mlp_only_layers=(7,)), "mlp_only_layers"),
                     (dict(router_z_loss_coef=-1.0), "router_z_loss_coef")]:
    with pytest.raises(ValueError, match=match):
      ModelConfig(**bad)


@functools.partial(jit, static_argnums=(0, 1))  # one program, not one per eager op
def _params(cfg, seed=0):
  params = model.init_params(cfg, jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(
      treedef, [a + 0.1 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)])


def test_moe_model_decode_matches_full_forward_and_replay():
  cfg = MOE_CFG
  params = _params(cfg)
  t = 9
  tokens = jax.random.randint(jax.random.key(3), (2, t), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
  fwd = jit(lambda p, tk, q, r=None: model.forward(p, tk, q, cfg, routes_BTLk=r,
                                                        return_moe=True))
  full, _, out = fwd(params, tokens, pos)
  assert out.routes_BTLk.shape == (2, t, 2, 2) and out.routes_BTLk.dtype == jnp.int32
  assert np.isfinite(float(out.load_balance_loss)) and float(out.z_loss) > 0
  # Prefill 5 tokens into the dense reference cache, then decode one token at a time.
  cache = model.DenseKVCache.init(cfg.n_layers, 2, 16, cfg.n_kv_heads, cfg.head_dim)
  decode = jit(lambda p, tk, q, c: model.forward(p, tk, q, cfg, cache=c, return_moe=True))
  pre, cache, pre_moe = decode(params, tokens[:, :5], pos[:, :5], cache)
  steps, routes = [pre], [pre_moe.routes_BTLk]
  for i in range(5, t):
    logits, cache, m = decode(params, tokens[:, i:i + 1], pos[:, i:i + 1], cache)
    steps.append(logits)
    routes.append(m.routes_BTLk)
  np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(jnp.concatenate(routes, 1), out.routes_BTLk)
  # Replaying the model's own routes gives the same logits; other routes change them.
  replayed, _, rep = fwd(params, tokens, pos, out.routes_BTLk)
  np.testing.assert_allclose(replayed, full, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(rep.routes_BTLk, out.routes_BTLk)
  other = (out.routes_BTLk + 1) % cfg.n_experts
  assert not np.allclose(fwd(params, tokens, pos, other)[0], full)
  with pytest.raises(ValueError, match="L_moe"):
    model.forward(params, tokens, pos, cfg, routes_BTLk=out.routes_BTLk[:, :, :1])


def test_moe_training_path_packing_and_gradients():
  """Packed rows equal separate rows; aux losses ignore padding; gradients reach every weight."""
  cfg = dataclasses.replace(MOE_CFG, router_bias=True)
  params = _params(cfg, seed=4)
  a = jax.random.randint(jax.random.key(5), (1, 4), 0, cfg.vocab_size)
  b = jax.random.randint(jax.random.key(6), (1, 3), 0, cfg.vocab_size)
  packed = jnp.concatenate([a, b, jnp.zeros((1, 2), jnp.int32)], 1)
  pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0, 0]], jnp.int32)
  seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0, 0]], jnp.int32)
  hid = jit(lambda p, tk, q, s=None: model.hidden_states(p, tk, q, cfg, segment_ids_BT=s,
                                                              return_moe=True))
  h, out = hid(params, packed, pos, seg)
  ha, oa = hid(params, a, pos[:, :4])
  hb, ob = hid(params, b, pos[:, 4:7])
  np.testing.assert_allclose(h[:, :4], ha, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(h[:, 4:7], hb, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(out.routes_BTLk[:, :7],
                                jnp.concatenate([oa.routes_BTLk, ob.routes_BTLk], 1))
  # z-loss is a mean over real tokens: the packed value is the token-weighted mean of the two.
  np.testing.assert_allclose(out.z_loss, (4 * oa.z_loss + 3 * ob.z_loss) / 7, rtol=1e-5)

  def loss(p):
    h, o = model.hidden_states(p, packed, pos, cfg, segment_ids_BT=seg, return_moe=True,
                               remat="full")
    return jnp.sum(h * h) + o.load_balance_loss + o.z_loss

  grads = jit(jax.grad(loss))(params)
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    assert np.all(np.isfinite(g)), path
    assert float(jnp.abs(g).sum()) > 0, path


def test_dense_model_reports_no_moe():
  cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                    head_dim=8, d_ff=24)
  params = _params(cfg)
  tokens = jnp.zeros((1, 3), jnp.int32)
  pos = jnp.arange(3, dtype=jnp.int32)[None]
  logits, cache, out = jit(lambda p: model.forward(p, tokens, pos, cfg, return_moe=True))(params)
  assert out is None and cache is None and logits.shape == (1, 3, 32)
  with pytest.raises(ValueError, match="no MoE layer"):
    model.forward(params, tokens, pos, cfg, routes_BTLk=jnp.zeros((1, 3, 1, 2), jnp.int32))


def test_upcycled_dense_model_computes_the_same_function():
  """Sparse upcycling: equal experts and renormalised top-k weights give the dense logits."""
  dense = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
                      head_dim=8, d_ff=24)
  params = _params(dense)
  moe_cfg, moe_params = moe.upcycle(dense, params, 4, 2, jax.random.key(1), router_std=1.0,
                                    router_z_loss_coef=1e-3)
  assert moe_cfg.layer_is_moe == (True, True) and moe_cfg.router_z_loss_coef == 1e-3
  assert set(moe_params) == {"embed", "final_norm", "moe_layers"}
  tokens = jax.random.randint(jax.random.key(2), (2, 6), 0, 32)
  pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
  fwd = jit(model.forward, static_argnums=3)
  np.testing.assert_allclose(fwd(moe_params, tokens, pos, moe_cfg)[0],
                             fwd(params, tokens, pos, dense)[0], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="dense model"):
    moe.upcycle(moe_cfg, moe_params, 4, 2, jax.random.key(1))
