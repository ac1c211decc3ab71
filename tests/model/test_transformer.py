"""Model tests: an independent dense reference, packing isolation, cache decode vs full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import model
from rlax_pipe.config import ModelConfig

CFGS = {
    "llama": ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=8, d_ff=48, tie_embeddings=False),
    "qwen2": ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1,
                         head_dim=8, d_ff=48, qkv_bias=True),
    "qwen3": ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=8, d_ff=48, qk_norm=True),
}


def _randomize(params, seed=1):
  """Perturb norms/biases away from 1/0 so every parameter matters in the comparison."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(
      treedef, [a + 0.1 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)])


def _reference_logits(params, tokens, cfg):
  """Plain numpy, one sequence at a time, per-head loops: an independent implementation."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  t_len = len(tokens)

  def norm(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_eps) * w

  def rot(x, pos):  # x [D]
    d = x.shape[-1]
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    a = pos * inv
    x1, x2 = x[: d // 2], x[d // 2:]
    return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)])

  h = p["embed"][tokens]
  group = cfg.n_heads // cfg.n_kv_heads
  for i in range(cfg.n_layers):
    lp = {k: v[i] for k, v in p["layers"].items()}
    x = norm(h, lp["attn_norm"])
    out = np.zeros((t_len, cfg.n_heads, cfg.head_dim))
    for head in range(cfg.n_heads):
      kvh = head // group
      q = x @ lp["wq"][:, head]
      k = x @ lp["wk"][:, kvh]
      v = x @ lp["wv"][:, kvh]
      if cfg.qkv_bias:
        q, k, v = q + lp["bq"][head], k + lp["bk"][kvh], v + lp["bv"][kvh]
      if cfg.qk_norm:
        q, k = norm(q, lp["q_norm"]), norm(k, lp["k_norm"])
      q = np.stack([rot(q[t], t) for t in range(t_len)])
      k = np.stack([rot(k[t], t) for t in range(t_len)])
      s = q @ k.T / np.sqrt(cfg.head_dim)
      s = np.where(np.tril(np.ones((t_len, t_len), bool)), s, -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      w /= w.sum(-1, keepdims=True)
      out[:, head] = w @ v
    h = h + np.einsum("thd,hde->te", out, lp["wo"])
    x = norm(h, lp["mlp_norm"])
    g = x @ lp["w_gate"]
    h = h + ((g / (1 + np.exp(-g))) * (x @ lp["w_up"])) @ lp["w_down"]
  h = norm(h, p["final_norm"])
  head = p["embed"].T if cfg.tie_embeddings else p["lm_head"]
  return h @ head


@pytest.mark.parametrize("family", sorted(CFGS))
def test_forward_matches_numpy_reference(family):
  cfg = CFGS[family]
  params = _randomize(model.init_params(cfg, jax.random.key(0)))
  tokens = np.array([[3, 9, 1, 44, 7, 2, 60]], np.int32)
  pos = np.arange(7, dtype=np.int32)[None]
  logits, _ = jax.jit(model.forward, static_argnums=3)(params, tokens, pos, cfg)
  assert logits.dtype == jnp.float32
  ref = _reference_logits(params, tokens[0], cfg)
  np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=2e-4, rtol=1e-4)


def test_packing_isolates_samples():
  cfg = CFGS["qwen3"]
  params = _randomize(model.init_params(cfg, jax.random.key(0)))
  a, b = np.array([5, 6, 7, 8], np.int32), np.array([9, 10, 11], np.int32)
  packed = np.concatenate([a, b, [0]])[None].astype(np.int32)
  seg = np.array([[1, 1, 1, 1, 2, 2, 2, 0]], np.int32)
  pos = np.array([[0, 1, 2, 3, 0, 1, 2, 0]], np.int32)
  logits, _ = model.forward(params, packed, pos, cfg, segment_ids_BT=seg)
  la, _ = model.forward(params, a[None], np.arange(4, dtype=np.int32)[None], cfg)
  lb, _ = model.forward(params, b[None], np.arange(3, dtype=np.int32)[None], cfg)
  np.testing.assert_allclose(logits[0, :4], la[0], atol=1e-5)
  np.testing.assert_allclose(logits[0, 4:7], lb[0], atol=1e-5)
  assert np.all(np.isfinite(np.asarray(logits)))


@pytest.mark.parametrize("family", sorted(CFGS))
def test_dense_cache_prefill_then_decode_matches_full_forward(family):
  cfg = CFGS[family]
  params = _randomize(model.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(0)
  lengths = [3, 6]  # ragged prompts, right-padded in the prefill
  total = 10
  seqs = rng.integers(1, cfg.vocab_size, size=(2, total)).astype(np.int32)
  cache = model.DenseKVCache.init(cfg.n_layers, 2, 16, cfg.n_kv_heads, cfg.head_dim)
  t_pre = max(lengths)
  pos = np.broadcast_to(np.arange(t_pre, dtype=np.int32), (2, t_pre))
  valid = pos < np.array(lengths)[:, None]
  logits_pre, cache = model.forward(params, seqs[:, :t_pre], pos, cfg, cache=cache, valid_BT=valid)
  step_logits = {0: [logits_pre[0, lengths[0] - 1]], 1: [logits_pre[1, lengths[1] - 1]]}
  cur = np.array(lengths)
  decode = jax.jit(lambda p, t, q, c: model.forward(p, t, q, cfg, cache=c))
  for _ in range(total - max(lengths)):
    tok = seqs[np.arange(2), cur][:, None]
    out, cache = decode(params, tok, cur[:, None].astype(np.int32), cache)
    for b in range(2):
      step_logits[b].append(out[b, 0])
    cur = cur + 1
  full, _ = model.forward(params, seqs, np.broadcast_to(np.arange(total, dtype=np.int32), (2, total)),
                          cfg)
  for b in range(2):
    got = np.stack(step_logits[b])
    want = np.asarray(full[b, lengths[b] - 1: lengths[b] - 1 + len(got)])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_param_axes_cover_every_param_and_use_known_names():
  known = {"embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "layers"}
  for cfg in CFGS.values():
    params = model.init_params(cfg, jax.random.key(0))
    axes = model.param_axes(cfg)
    p_leaves, p_def = jax.tree.flatten(params)
    a_leaves = p_def.flatten_up_to(axes)
    for arr, ax in zip(p_leaves, a_leaves):
      assert len(ax) == arr.ndim and set(ax) <= known


def test_param_and_compute_dtype_are_separate():
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                    d_ff=32, param_dtype="float32", compute_dtype="bfloat16")
  params = model.init_params(cfg, jax.random.key(0))
  assert params["layers"]["wq"].dtype == jnp.float32
  logits, _ = model.forward(params, np.ones((1, 4), np.int32), np.arange(4, dtype=np.int32)[None],
                            cfg, return_hidden=False)
  assert logits.dtype == jnp.float32
  _, _, hidden = model.forward(params, np.ones((1, 4), np.int32),
                               np.arange(4, dtype=np.int32)[None], cfg, return_hidden=True)
  assert hidden.dtype == jnp.bfloat16


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="n_kv_heads"):
    ModelConfig(n_heads=4, n_kv_heads=3)
  with pytest.raises(ValueError, match="compute_dtype"):
    ModelConfig(compute_dtype="float8")
