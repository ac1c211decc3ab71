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

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe.config import ModelConfig, RopeScaling
from rlax_pipe.model import kv_cache as kv_cache_lib
from rlax_pipe.model import rotary
from rlax_pipe.model import train_attention

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


def rope(x_BTND: jax.Array, positions_BT: jax.Array, theta: float,
         scaling: RopeScaling | None = None) -> jax.Array:
  """Rotary position embedding, half-split convention (Su et al. 2021 eq. 34; HF `rotate_half`).

  Args:
    x_BTND: [B, T, N, D] queries or keys (D even).
    positions_BT: int32 [B, T] absolute positions.
    theta: rotary base.
    scaling: optional context-extension scaling (linear / llama3 / yarn, `model.rotary`).

  Returns:
    [B, T, N, D] rotated, in x's dtype (angles in fp32).
  """
  inv_freq, attention_factor = rotary.inverse_frequencies(x_BTND.shape[-1], theta, scaling)
  return rotary.apply(x_BTND, positions_BT, inv_freq, attention_factor)


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
  q = rope(q, positions_BT, cfg.rope_theta, cfg.rope_scaling)
  k = rope(k, positions_BT, cfg.rope_theta, cfg.rope_scaling)
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
  at a position <= its own (prefill when T > 1, decode when T == 1). Invalid tokens (padding)
  get a zero embedding selected with `jnp.where`, as padding does on the training path: whatever
  the padding id's embedding row holds, NaN or inf included, never enters the layers.

  Args:
    params: tree from `init_params` (or an HF import).
    tokens_BT: int32 [B, T] token ids (< vocab_size).
    positions_BT: int32 [B, T] positions (restart at 0 for every packed sample).
    cfg: model configuration (static).
    segment_ids_BT: int32 [B, T] packing ids (no-cache mode only); None = one sample per row.
    cache: a `kv_cache.KVCache` pytree or None; carried through the layer loop and updated in
      place (donate it to the jitted caller).
    valid_BT: bool [B, T] (cache mode) which tokens are real; None = all.
    remat: rematerialise each block in the backward pass (no-cache mode; the learner calls
      `hidden_states` directly with a named remat policy).
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
  if cache is None:  # the training path (packed full sequences), shared with the learner
    h = hidden_states(params, tokens_BT, positions_BT, cfg, segment_ids_BT=segment_ids_BT,
                      remat="full" if remat else "none")
    logits = jnp.einsum("bte,ev->btv", h.astype(jnp.float32),
                        output_head(params, cfg).astype(jnp.float32))
    return (logits, None, h) if return_hidden else (logits, None)
  cdt = jnp.dtype(cfg.compute_dtype)
  h = jnp.take(params["embed"], tokens_BT, axis=0).astype(cdt)
  if valid_BT is not None:  # padding (prefill padding, idle decode slots): selected, not scaled
    h = jnp.where(valid_BT[:, :, None], h, jnp.zeros((), cdt))
  h, new_cache = _cached_layers(params, h, positions_BT, cfg, cache, valid_BT)

  h = rms_norm(h, params["final_norm"], cfg.rms_eps)
  logits = jnp.einsum("bte,ev->btv", h.astype(jnp.float32),
                      output_head(params, cfg).astype(jnp.float32))
  if return_hidden:
    return logits, new_cache, h
  return logits, new_cache


# ---- the training path (no cache): packed sequences, sharding hooks, remat policies ----------

REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots_saveable")

# constrain(x, logical_axes, weight=False) -> x: a sharding hook; `weight=True` marks a parameter
# (the learner gathers it for compute and reduce-scatters its gradient).
Constrain = Callable[..., jax.Array]


def _no_constraint(x, _, weight=False):
  del weight
  return x


def output_head(params: Params, cfg: ModelConfig) -> jax.Array:
  """The [E, V] output projection: the transposed embedding when tied, else `lm_head`."""
  return params["embed"].T if cfg.tie_embeddings else params["lm_head"]


def remat_block(fn: Callable, policy: str) -> Callable:
  """Wraps a scanned block with `jax.checkpoint` per remat policy.

  "none": keep every activation for the backward pass; "full": keep only the block's input and
  recompute the rest (FSDP then re-gathers each layer's weights in the backward pass);
  "dots_saveable": keep the outputs of matmuls and recompute the cheap elementwise ops
  (`jax.checkpoint_policies.dots_saveable`).

  Raises:
    ValueError: on an unknown policy (the message lists REMAT_POLICIES).
  """
  if policy == "none":
    return fn
  if policy == "full":
    return jax.checkpoint(fn)
  if policy == "dots_saveable":
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_saveable)
  raise ValueError(f"remat policy {policy!r}; choose one of {REMAT_POLICIES}.")


def blockwise_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array,
                        segment_ids_BT: jax.Array, block_len: int | None) -> jax.Array:
  """Causal attention within equal segment ids, `block_len` queries at a time.

  Each block of queries attends to all T keys through `kv_cache.gqa_attention` (so every output
  row is computed exactly as by one dense call), inside a `lax.scan` whose body is
  rematerialised: the [B, K, G, block, T] fp32 scores of one block are the largest temporary,
  instead of the dense [B, K, G, T, T], in the forward and the backward pass. Keys and values of
  padding positions (segment 0) are selected out (zeros via `jnp.where`), so whatever they hold
  never reaches a real token (padding queries attend only to padding).

  Args:
    q_BTHD: [B, T, H, D] queries; k_BTKD, v_BTKD: [B, T, K, D] keys and values.
    segment_ids_BT: int32 [B, T] packing ids (0 = padding).
    block_len: queries per block (>= 1); None or >= T = one dense call.

  Returns:
    [B, T, H, D] in q's dtype.
  """
  b, t = segment_ids_BT.shape
  real = (segment_ids_BT > 0)[:, :, None, None]
  k_BTKD = jnp.where(real, k_BTKD, jnp.zeros((), k_BTKD.dtype))
  v_BTKD = jnp.where(real, v_BTKD, jnp.zeros((), v_BTKD.dtype))
  if block_len is None or block_len >= t:
    return kv_cache_lib.gqa_attention(q_BTHD, k_BTKD, v_BTKD, _packed_mask(segment_ids_BT))
  n = -(-t // block_len)
  pad = n * block_len - t
  h, d = q_BTHD.shape[2:]
  q = jnp.pad(q_BTHD, ((0, 0), (0, pad), (0, 0), (0, 0)))
  q = jnp.swapaxes(q.reshape(b, n, block_len, h, d), 0, 1)  # [n, B, C, H, D]
  seg_q = jnp.swapaxes(jnp.pad(segment_ids_BT, ((0, 0), (0, pad)), constant_values=-1)
                       .reshape(b, n, block_len), 0, 1)  # padded queries match nothing
  start = jnp.arange(n, dtype=jnp.int32) * block_len

  def block(q_blk, seg_blk, first):
    causal = (first + jnp.arange(block_len))[:, None] >= jnp.arange(t)[None, :]
    mask = causal[None] & (seg_blk[:, :, None] == segment_ids_BT[:, None, :])
    return kv_cache_lib.gqa_attention(q_blk, k_BTKD, v_BTKD, mask)

  body = jax.checkpoint(block)
  _, out = jax.lax.scan(lambda c, x: (c, body(*x)), None, (q, seg_q, start))
  return jnp.swapaxes(out, 0, 1).reshape(b, n * block_len, h, d)[:, :t]


def hidden_states(params: Params, tokens_BT: jax.Array, positions_BT: jax.Array,
                  cfg: ModelConfig, *, segment_ids_BT: jax.Array | None = None,
                  remat: str = "none", constrain: Constrain | None = None,
                  attention_block_len: int | None = None,
                  attention_impl: str | Callable[..., jax.Array] = "blockwise") -> jax.Array:
  """Final normalised hidden states of packed full sequences (the training path, no cache).

  Causal attention within equal `segment_ids_BT`; padding (segment 0) gets a zero embedding
  selected with `jnp.where` (whatever the padding token's embedding holds, NaN included, it never
  reaches a real token or a gradient), and attends only to padding.

  Sharding: `constrain(x, logical_axes, weight=True)` is called on each layer's weights (inside
  the layer scan, so the learner's hook all-gathers one layer's FSDP shards at a time and
  reduce-scatters that layer's gradient) and on the embedding table; `constrain(x, axes)` on the
  residual stream ("batch", "length", "embed") after every block, which keeps activations split
  over the batch axes only.

  Args:
    params: tree from `init_params` (or an HF import).
    tokens_BT: int32 [B, T] token ids (< vocab_size).
    positions_BT: int32 [B, T] positions (restart at 0 for every packed sample).
    cfg: model configuration (static).
    segment_ids_BT: int32 [B, T] packing ids; None = one sample per row, no padding.
    remat: one of REMAT_POLICIES (see `remat_block`).
    constrain: optional sharding hook `constrain(x, logical_axes, weight=False) -> x`;
      None = none.
    attention_block_len: queries per attention block (`blockwise_attention`); None = dense.
    attention_impl: "blockwise" (`blockwise_attention`) or a fused kernel of
      `train_attention.KERNELS` ("pallas_tpu", "pallas_gpu", their "_interpret" forms; same
      outputs, no fp32 scores in memory; `train_attention.resolve_train_attention` picks one),
      or a callable attend(q_BTHD, k_BTKD, v_BTKD, segment_ids_BT) -> [B, T, H, D] (e.g.
      `train_attention.sharded_flash_attention` for a sharded learner).

  Returns:
    [B, T, E] in cfg.compute_dtype.

  Raises:
    ValueError: on rank/shape mismatches or an unknown remat policy.
  """
  if tokens_BT.ndim != 2 or positions_BT.shape != tokens_BT.shape:
    raise ValueError(f"tokens {tokens_BT.shape} and positions {positions_BT.shape} must be [B, T].")
  c = constrain or _no_constraint
  cdt = jnp.dtype(cfg.compute_dtype)
  axes = param_axes(cfg)
  h = jnp.take(c(params["embed"], axes["embed"], weight=True), tokens_BT, axis=0).astype(cdt)
  if segment_ids_BT is None:
    seg = jnp.ones_like(tokens_BT)  # one real sample per row
  else:
    seg = segment_ids_BT
    h = jnp.where((seg > 0)[:, :, None], h, jnp.zeros((), cdt))
  h = c(h, ("batch", "length", "embed"))
  layer_axes = {k: v[1:] for k, v in axes["layers"].items()}  # without the stacked L axis

  def body(h, lp):
    lp = {k: c(v, layer_axes[k], weight=True) for k, v in lp.items()}
    if callable(attention_impl):
      attend = lambda q, k, v: (attention_impl(q, k, v, seg), None)
    elif attention_impl == "blockwise":
      attend = lambda q, k, v: (blockwise_attention(q, k, v, seg, attention_block_len), None)
    else:
      attend = lambda q, k, v: (train_attention.flash_attention(
          q, k, v, seg, attention_impl, attention_block_len), None)
    h, _ = _block(cfg, h, lp, positions_BT, attend)
    return c(h, ("batch", "length", "embed")), None

  h, _ = jax.lax.scan(remat_block(body, remat), h, params["layers"])
  return rms_norm(h, params["final_norm"], cfg.rms_eps)
