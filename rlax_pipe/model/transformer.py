"""Decoder-only transformer of the Llama-3 / Qwen2 / Qwen3 family, as pure functions.

Parameters are a plain nested dict of arrays; `param_axes(cfg)` gives the same tree with a tuple of
logical axis names per array (embed, mlp, heads, kv_heads, head_dim, vocab, layers), from which
the learner and sampler derive their shardings. Transformer blocks are stacked along a leading
`layers` axis and run with `jax.lax.scan`.

One `forward` serves (a) full packed sequences (segment ids: no attention across samples) and
(b) prefill / decode against a KV cache (`kv_cache.KVCache`: the dense reference cache here, the
paged cache in `rlax_pipe.sampler`). Logits are always float32 (fp32 LM head).

Letters: B batch, T tokens, E embed, H heads, K kv heads, D head dim, F mlp, V vocab, L layers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe.config import ModelConfig
from rlax_pipe.model import kv_cache as kv_cache_lib

Params = dict[str, Any]


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  e, h, k, d, f, n = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                      cfg.n_layers)
  shapes = {
      "attn_norm": ((n, e), ("layers", "embed")),
      "wq": ((n, e, h, d), ("layers", "embed", "heads", "head_dim")),
      "wk": ((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim")),
      "wv": ((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim")),
      "wo": ((n, h, d, e), ("layers", "heads", "head_dim", "embed")),
      "mlp_norm": ((n, e), ("layers", "embed")),
      "w_gate": ((n, e, f), ("layers", "embed", "mlp")),
      "w_up": ((n, e, f), ("layers", "embed", "mlp")),
      "w_down": ((n, f, e), ("layers", "mlp", "embed")),
  }
  if cfg.qkv_bias:
    shapes["bq"] = ((n, h, d), ("layers", "heads", "head_dim"))
    shapes["bk"] = ((n, k, d), ("layers", "kv_heads", "head_dim"))
    shapes["bv"] = ((n, k, d), ("layers", "kv_heads", "head_dim"))
  if cfg.qk_norm:
    shapes["q_norm"] = ((n, d), ("layers", "head_dim"))
    shapes["k_norm"] = ((n, d), ("layers", "head_dim"))
  return shapes


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
  """Tree of (shape, logical_axes) for every parameter, the single source of the layout.

  Returns:
    {"embed": ((V, E), ("vocab", "embed")), "final_norm": ..., "layers": {name: (shape, axes)},
    and "lm_head": ((E, V), ("embed", "vocab")) when embeddings are untied}.
  """
  specs = {
      "embed": ((cfg.vocab_size, cfg.d_model), ("vocab", "embed")),
      "final_norm": ((cfg.d_model,), ("embed",)),
      "layers": _layer_shapes(cfg),
  }
  if not cfg.tie_embeddings:
    specs["lm_head"] = ((cfg.d_model, cfg.vocab_size), ("embed", "vocab"))
  return specs


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)


def param_axes(cfg: ModelConfig) -> dict[str, Any]:
  """Same tree as the params, each leaf a tuple of logical axis names."""
  return jax.tree.map(lambda s: s[1], param_specs(cfg), is_leaf=_is_spec)


def abstract_params(cfg: ModelConfig) -> dict[str, Any]:
  """Same tree as the params, each leaf a `jax.ShapeDtypeStruct` (no allocation)."""
  dtype = jnp.dtype(cfg.param_dtype)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], dtype), param_specs(cfg),
                      is_leaf=_is_spec)


def init_params(cfg: ModelConfig, rng: jax.Array) -> Params:
  """Random initial parameters (norm scales 1, biases 0, matrices truncated-normal).

  Matrices use std 1/sqrt(fan_in) (fan_in = contracted input width); the embedding uses std 1
  scaled by 1/sqrt(E) when tied. Jit this with `out_shardings` to create sharded params directly.

  Args:
    cfg: model configuration.
    rng: a PRNG key.

  Returns:
    A params tree matching `param_specs(cfg)`, in `cfg.param_dtype`.
  """
  specs = param_specs(cfg)
  flat_with_path, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)
  keys = jax.random.split(rng, len(flat_with_path))
  dtype = jnp.dtype(cfg.param_dtype)
  leaves = []
  for key, (path, (shape, _)) in zip(keys, flat_with_path):
    name = path[-1].key
    if name.endswith("norm"):
      leaves.append(jnp.ones(shape, dtype))
    elif name in ("bq", "bk", "bv"):
      leaves.append(jnp.zeros(shape, dtype))
    else:
      if name == "embed":
        fan_in = cfg.d_model if cfg.tie_embeddings else 1
      elif name == "wo":
        fan_in = cfg.n_heads * cfg.head_dim
      else:
        fan_in = shape[-3] if name in ("wq", "wk", "wv") else shape[-2]
      std = 1.0 / np.sqrt(fan_in)
      leaves.append((std * jax.random.truncated_normal(key, -2.0, 2.0, shape)).astype(dtype))
  return jax.tree.unflatten(treedef, leaves)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm (Zhang & Sennrich 2019, eq. 4): x / sqrt(mean(x^2) + eps) * scale, stats in fp32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  scale = scale.astype(x.dtype).reshape((1,) * (x.ndim - scale.ndim) + scale.shape)
  return scale * y.astype(x.dtype)


def rope(x_BTND: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding, half-split convention (Su et al. 2021 eq. 34; HF `rotate_half`).

  Args:
    x_BTND: [B, T, N, D] queries or keys (D even).
    positions_BT: int32 [B, T] absolute positions.
    theta: rotary base.

  Returns:
    [B, T, N, D] rotated, in x's dtype (angles in fp32).
  """
  d = x_BTND.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
  angles = positions_BT.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x = x_BTND.astype(jnp.float32)
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTND.dtype)


def _packed_mask(segment_ids_BT: jax.Array) -> jax.Array:
  """Causal-by-index mask restricted to equal segment ids: bool [B, T, T]."""
  t = segment_ids_BT.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  return causal[None] & same


def _block(cfg: ModelConfig, h_BTE, lp, positions_BT, attend):
  """One pre-norm transformer block. `attend(q, k, v)` returns ([B,T,H,D], cache_out)."""
  cdt = jnp.dtype(cfg.compute_dtype)
  lp = jax.tree.map(lambda a: a.astype(cdt), lp)
  x = rms_norm(h_BTE, lp["attn_norm"], cfg.rms_eps)
  q = jnp.einsum("bte,ehd->bthd", x, lp["wq"])
  k = jnp.einsum("bte,ekd->btkd", x, lp["wk"])
  v = jnp.einsum("bte,ekd->btkd", x, lp["wv"])
  if cfg.qkv_bias:
    q, k, v = q + lp["bq"][None, None], k + lp["bk"][None, None], v + lp["bv"][None, None]
  if cfg.qk_norm:
    q = rms_norm(q, lp["q_norm"], cfg.rms_eps)
    k = rms_norm(k, lp["k_norm"], cfg.rms_eps)
  q = rope(q, positions_BT, cfg.rope_theta)
  k = rope(k, positions_BT, cfg.rope_theta)
  attn, cache_out = attend(q, k, v)
  h_BTE = h_BTE + jnp.einsum("bthd,hde->bte", attn, lp["wo"])
  x = rms_norm(h_BTE, lp["mlp_norm"], cfg.rms_eps)
  gate = jnp.einsum("bte,ef->btf", x, lp["w_gate"])
  up = jnp.einsum("bte,ef->btf", x, lp["w_up"])
  h_BTE = h_BTE + jnp.einsum("btf,fe->bte", jax.nn.silu(gate) * up, lp["w_down"])
  return h_BTE, cache_out


def _cached_layers(params: Params, h_BTE, positions_BT, cfg: ModelConfig, cache, valid_BT):
  """The cache path: layers in a scan that CARRIES the cache, so XLA updates it in place.

  Each layer calls `cache.update_attend(layer_index, q, k, v, positions, valid)`, which writes
  the new tokens' K/V into the carried cache and attends over it. (Passing the cache as a scan
  input and collecting it as a scan output would copy the whole cache every call.)
  """
  valid = jnp.ones(positions_BT.shape, bool) if valid_BT is None else valid_BT

  def body(carry, xs):
    h, c = carry
    lp, layer = xs
    attend = lambda q, k, v: c.update_attend(layer, q, k, v, positions_BT, valid)
    h, c = _block(cfg, h, lp, positions_BT, attend)
    return (h, c), None

  layers = jnp.arange(cfg.n_layers, dtype=jnp.int32)
  (h_BTE, cache), _ = jax.lax.scan(body, (h_BTE, cache), (params["layers"], layers))
  return h_BTE, cache


def forward(params: Params, tokens_BT: jax.Array, positions_BT: jax.Array, cfg: ModelConfig, *,
            segment_ids_BT: jax.Array | None = None, cache=None, valid_BT: jax.Array | None = None,
            remat: bool = False, return_hidden: bool = False):
  """Runs the transformer; returns float32 logits and the updated cache.

  Without a cache: full sequences, causal attention within equal `segment_ids_BT` (packing;
  segment 0 = padding, which attends only to padding). With a cache: the new tokens' K/V are
  written at `positions_BT` (only where `valid_BT`), and each token attends to every cached entry
  at a position <= its own (prefill when T > 1, decode when T == 1).

  Args:
    params: tree from `init_params` (or an HF import).
    tokens_BT: int32 [B, T] token ids (< vocab_size).
    positions_BT: int32 [B, T] positions (restart at 0 for every packed sample).
    cfg: model configuration (static).
    segment_ids_BT: int32 [B, T] packing ids (no-cache mode only); None = one sample per row.
    cache: a `kv_cache.KVCache` pytree or None; carried through the layer loop and updated in
      place (donate it to the jitted caller).
    valid_BT: bool [B, T] (cache mode) which tokens are real; None = all.
    remat: rematerialise each block in the backward pass (saves memory when training).
    return_hidden: also return the final normalised hidden states [B, T, E].

  Returns:
    (logits float32 [B, T, V], cache or None), or (logits, cache, hidden) with return_hidden.

  Raises:
    ValueError: on rank/shape mismatches, or segment ids given together with a cache.
  """
  if tokens_BT.ndim != 2 or positions_BT.shape != tokens_BT.shape:
    raise ValueError(f"tokens {tokens_BT.shape} and positions {positions_BT.shape} must be [B, T].")
  if cache is not None and segment_ids_BT is not None:
    raise ValueError("segment_ids_BT (packing) is for cache-free forwards; pass valid_BT instead.")
  cdt = jnp.dtype(cfg.compute_dtype)
  h = jnp.take(params["embed"], tokens_BT, axis=0).astype(cdt)

  if cache is None:
    seg = jnp.zeros_like(tokens_BT) if segment_ids_BT is None else segment_ids_BT
    mask = _packed_mask(seg)

    def body(h, lp):
      attend = lambda q, k, v: (kv_cache_lib.gqa_attention(q, k, v, mask), None)
      h, _ = _block(cfg, h, lp, positions_BT, attend)
      return h, None

    if remat:
      body = jax.checkpoint(body)
    h, _ = jax.lax.scan(body, h, params["layers"])
    new_cache = None
  else:
    h, new_cache = _cached_layers(params, h, positions_BT, cfg, cache, valid_BT)

  h = rms_norm(h, params["final_norm"], cfg.rms_eps)
  head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
  logits = jnp.einsum("bte,ev->btv", h.astype(jnp.float32), head.astype(jnp.float32))
  if return_hidden:
    return logits, new_cache, h
  return logits, new_cache
