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
from rlax_pipe.model import moe as moe_lib
from rlax_pipe.model import moe_parallel
from rlax_pipe.model import rotary
from rlax_pipe.model import train_attention

Params = dict[str, Any]


def _layer_shapes(cfg: ModelConfig, n: int,
                  moe: bool = False) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  """(shape, logical axes) of a stack of n blocks: dense (SwiGLU MLP) or MoE (router, experts)."""
  e, h, k, d, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  shapes = {
      "attn_norm": ((n, e), ("layers", "embed")),
      "wq": ((n, e, h, d), ("layers", "embed", "heads", "head_dim")),
      "wk": ((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim")),
      "wv": ((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim")),
      "wo": ((n, h, d, e), ("layers", "heads", "head_dim", "embed")),
      "mlp_norm": ((n, e), ("layers", "embed")),
  }
  if moe:
    x, fe = cfg.n_experts, cfg.moe_d_ff
    shapes["router"] = ((n, e, x), ("layers", "embed", "expert"))
    if cfg.router_bias:
      shapes["router_bias"] = ((n, x), ("layers", "expert"))
    shapes["experts_gate"] = ((n, x, e, fe), ("layers", "expert", "embed", "mlp"))
    shapes["experts_up"] = ((n, x, e, fe), ("layers", "expert", "embed", "mlp"))
    shapes["experts_down"] = ((n, x, fe, e), ("layers", "expert", "mlp", "embed"))
    if cfg.expert_bias:
      shapes["experts_gate_bias"] = ((n, x, fe), ("layers", "expert", "mlp"))
      shapes["experts_up_bias"] = ((n, x, fe), ("layers", "expert", "mlp"))
      shapes["experts_down_bias"] = ((n, x, e), ("layers", "expert", "embed"))
  else:
    shapes["w_gate"] = ((n, e, f), ("layers", "embed", "mlp"))
    shapes["w_up"] = ((n, e, f), ("layers", "embed", "mlp"))
    shapes["w_down"] = ((n, f, e), ("layers", "mlp", "embed"))
  if cfg.qkv_bias:
    shapes["bq"] = ((n, h, d), ("layers", "heads", "head_dim"))
    shapes["bk"] = ((n, k, d), ("layers", "kv_heads", "head_dim"))
    shapes["bv"] = ((n, k, d), ("layers", "kv_heads", "head_dim"))
  if cfg.qk_norm:
    shapes["q_norm"] = ((n, d), ("layers", "head_dim"))
    shapes["k_norm"] = ((n, d), ("layers", "head_dim"))
  if cfg.o_bias:
    shapes["bo"] = ((n, e), ("layers", "embed"))
  if cfg.attention_sinks:
    shapes["sinks"] = ((n, h), ("layers", "heads"))
  return shapes


def layer_segments(cfg: ModelConfig) -> tuple[tuple[str, int, int, int], ...]:
  """Runs of consecutive layers of one kind, in model order, each scanned with one `lax.scan`.

  Returns:
    Tuples (stack, start, stop, first_layer): the blocks stack[start:stop] of params[stack]
    ("layers" = dense blocks, "moe_layers" = MoE blocks) are the model's layers first_layer,
    first_layer + 1, ... A dense model is one run ("layers", 0, n_layers, 0).
  """
  out, counts = [], {"layers": 0, "moe_layers": 0}
  for i, is_moe in enumerate(cfg.layer_is_moe):
    stack = "moe_layers" if is_moe else "layers"
    if out and out[-1][0] == stack:
      out[-1][2] += 1
    else:
      out.append([stack, counts[stack], counts[stack] + 1, i])
    counts[stack] += 1
  return tuple(tuple(seg) for seg in out)


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
  """Tree of (shape, logical_axes) for every parameter, the single source of the layout.

  Returns:
    {"embed": ((V, E), ("vocab", "embed")), "final_norm": ..., "layers": {name: (shape, axes)}
    (the dense blocks, stacked; absent when every layer is MoE), "moe_layers": {...} (the MoE
    blocks, stacked; only when cfg.n_experts > 0; order of execution: `layer_segments`), and
    "lm_head": ((E, V), ("embed", "vocab")) when embeddings are untied}.
  """
  specs = {
      "embed": ((cfg.vocab_size, cfg.d_model), ("vocab", "embed")),
      "final_norm": ((cfg.d_model,), ("embed",)),
  }
  n_moe = cfg.n_moe_layers
  if cfg.n_layers - n_moe:
    specs["layers"] = _layer_shapes(cfg, cfg.n_layers - n_moe)
  if n_moe:
    specs["moe_layers"] = _layer_shapes(cfg, n_moe, moe=True)
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
  """Random initial parameters (norm scales 1, biases and sink logits 0, matrices
  truncated-normal).

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
    elif name in ("bq", "bk", "bv", "bo", "sinks", "router_bias") or name.startswith(
        "experts_") and name.endswith("_bias"):
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


def _packed_mask(segment_ids_BT: jax.Array, window=None) -> jax.Array:
  """Causal-by-index mask restricted to equal segment ids: bool [B, T, T]; with an int32 scalar
  `window` > 0, also restricted to the last `window` tokens (indices i - window < j <= i)."""
  t = segment_ids_BT.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  if window is not None:
    causal = causal & kv_cache_lib.window_mask(jnp.arange(t)[:, None], jnp.arange(t)[None, :],
                                               window)
  same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  return causal[None] & same


def _block(cfg: ModelConfig, h_BTE, lp, positions_BT, attend, moe_in=None):
  """One pre-norm transformer block. `attend(q, k, v, sinks)` returns ([B,T,H,D], cache_out);
  sinks is the layer's fp32 [H] sink logits, or None without `cfg.attention_sinks`.

  A dense block (`moe_in` None) returns (h, cache_out); an MoE block (`moe_in` = (experts_BTk
  or None, mask_BT)) returns (h, cache_out, (experts_BTk, load_balance_loss, z_loss)).
  """
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
  attn, cache_out = attend(q, k, v, lp["sinks"].astype(jnp.float32) if cfg.attention_sinks
                            else None)
  h_BTE = h_BTE + jnp.einsum("bthd,hde->bte", attn, lp["wo"])
  if cfg.o_bias:
    h_BTE = h_BTE + lp["bo"][None, None]
  x = rms_norm(h_BTE, lp["mlp_norm"], cfg.rms_eps)
  if moe_in is not None:
    experts_BTk, mask_BT = moe_in[:2]
    mesh = moe_in[2] if len(moe_in) > 2 else None
    b, t, e = x.shape
    kk = cfg.n_experts_per_tok
    experts_fn = None
    if moe_parallel.uses_expert_parallelism(mesh):  # experts split over the "expert" axis
      experts_fn = lambda x_TE, ids, w, p: moe_parallel.expert_parallel_swiglu(
          x_TE, ids, w, moe_parallel.expert_params_of(p), mesh)
    out, experts, lb, z = moe_lib.moe_block(
        x.reshape(b * t, e), lp, k=kk, softmax_over=cfg.router_softmax,
        norm_topk_prob=cfg.norm_topk_prob,
        experts_Tk=None if experts_BTk is None else experts_BTk.reshape(b * t, kk),
        mask_T=mask_BT.reshape(b * t), activation=cfg.expert_activation,
        alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, experts_fn=experts_fn)
    return h_BTE + out.reshape(b, t, e), cache_out, (experts.reshape(b, t, kk), lb, z)
  gate = jnp.einsum("bte,ef->btf", x, lp["w_gate"])
  up = jnp.einsum("bte,ef->btf", x, lp["w_up"])
  h_BTE = h_BTE + jnp.einsum("btf,fe->bte", jax.nn.silu(gate) * up, lp["w_down"])
  return h_BTE, cache_out


def _check_routes(cfg: ModelConfig, routes_BTLk, shape_BT) -> None:
  if routes_BTLk is None:
    return
  want = (*shape_BT, cfg.n_moe_layers, cfg.n_experts_per_tok)
  if cfg.n_experts == 0 or tuple(routes_BTLk.shape) != want:
    raise ValueError(f"routes_BTLk has shape {tuple(routes_BTLk.shape)}; this model needs "
                     f"[B, T, L_moe, k] = {want}" + (" (it has no MoE layer: pass None)."
                                                     if cfg.n_experts == 0 else "."))


def _run_layers(params: Params, h_BTE, cfg: ModelConfig, carry_extra, step_fn, routes_BTLk,
                wrap=lambda f: f):
  """Runs every layer in model order: one `lax.scan` per run of `layer_segments`.

  `step_fn(h, extra, lp, layer, stack, routes_BTk)` runs one block and returns
  (h, extra, aux or None); `wrap` wraps the scanned body (remat). Returns (h, extra, MoeOutputs
  or None): MoE layers' routes [B, T, L_moe, k] and their aux losses averaged over layers.
  """
  routes_LBTk = None if routes_BTLk is None else jnp.moveaxis(routes_BTLk, 2, 0)
  aux_all = []
  for stack, start, stop, first in layer_segments(cfg):
    lps = params[stack]
    n_stack = next(iter(lps.values())).shape[0]
    if (start, stop) != (0, n_stack):
      lps = jax.tree.map(lambda a, i=start, j=stop: a[i:j], lps)
    layers = jnp.arange(first, first + stop - start, dtype=jnp.int32)
    moe = stack == "moe_layers"
    xs_routes = routes_LBTk[start:stop] if (moe and routes_LBTk is not None) else None

    def body(carry, xs, stack=stack):
      h, extra = carry
      lp, layer, r = xs
      h, extra, aux = step_fn(h, extra, lp, layer, stack, r)
      return (h, extra), aux

    (h_BTE, carry_extra), aux = jax.lax.scan(wrap(body), (h_BTE, carry_extra),
                                             (lps, layers, xs_routes))
    if moe:
      aux_all.append(aux)
  if not aux_all:
    return h_BTE, carry_extra, None
  routes = jnp.concatenate([a[0] for a in aux_all], axis=0)  # [L_moe, B, T, k]
  lb = jnp.concatenate([a[1] for a in aux_all])
  z = jnp.concatenate([a[2] for a in aux_all])
  return h_BTE, carry_extra, moe_lib.MoeOutputs(
      routes_BTLk=jnp.moveaxis(routes, 0, 2), load_balance_loss=jnp.mean(lb), z_loss=jnp.mean(z))


def _cached_layers(params: Params, h_BTE, positions_BT, cfg: ModelConfig, cache, valid_BT,
                   routes_BTLk=None):
  """The cache path: layers in a scan that CARRIES the cache, so XLA updates it in place.

  Each layer calls `cache.update_attend(layer_index, q, k, v, positions, valid)`, which writes
  the new tokens' K/V into the carried cache and attends over it. (Passing the cache as a scan
  input and collecting it as a scan output would copy the whole cache every call.)
  Returns (h, cache, MoeOutputs or None).
  """
  valid = jnp.ones(positions_BT.shape, bool) if valid_BT is None else valid_BT
  windows = _layer_windows(cfg)

  def step(h, c, lp, layer, stack, routes_BTk):
    window = None if windows is None else windows[layer]

    def attend(q, k, v, sinks):
      extra = {} if window is None else {"window": window}
      if sinks is not None:
        extra["sinks"] = sinks
      return c.update_attend(layer, q, k, v, positions_BT, valid, **extra)

    if stack == "moe_layers":
      h, c, aux = _block(cfg, h, lp, positions_BT, attend, (routes_BTk, valid))
      return h, c, aux
    h, c = _block(cfg, h, lp, positions_BT, attend)
    return h, c, None

  return _run_layers(params, h_BTE, cfg, cache, step, routes_BTLk)


def _layer_windows(cfg: ModelConfig) -> jax.Array | None:
  """int32 [L] attention window per layer (0 = full; indexed by the scanned layer index), or
  None without windowed layers."""
  windows = cfg.layer_windows
  return None if windows is None else jnp.asarray(windows, jnp.int32)


def forward(params: Params, tokens_BT: jax.Array, positions_BT: jax.Array, cfg: ModelConfig, *,
            segment_ids_BT: jax.Array | None = None, cache=None, valid_BT: jax.Array | None = None,
            remat: bool = False, return_hidden: bool = False,
            routes_BTLk: jax.Array | None = None, return_moe: bool = False):
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
    routes_BTLk: MoE models only: optional int32 [B, T, L_moe, k] experts to use per token and
      MoE layer (router replay; weights still from this model's router, `model.moe.route`);
      None = each layer's own top-k.
    return_moe: also return a `moe.MoeOutputs` (routes used, load-balance and z losses); None
      for a dense model.

  Returns:
    (logits float32 [B, T, V], cache or None), then hidden [B, T, E] if return_hidden, then
    the MoeOutputs if return_moe.

  Raises:
    ValueError: on rank/shape mismatches (routes included), or segment ids given together
      with a cache.
  """
  if tokens_BT.ndim != 2 or positions_BT.shape != tokens_BT.shape:
    raise ValueError(f"tokens {tokens_BT.shape} and positions {positions_BT.shape} must be [B, T].")
  if cache is not None and segment_ids_BT is not None:
    raise ValueError("segment_ids_BT (packing) is for cache-free forwards; pass valid_BT instead.")
  _check_routes(cfg, routes_BTLk, tokens_BT.shape)
  if cache is None:  # the training path (packed full sequences), shared with the learner
    h, moe = hidden_states(params, tokens_BT, positions_BT, cfg, segment_ids_BT=segment_ids_BT,
                           remat="full" if remat else "none", routes_BTLk=routes_BTLk,
                           return_moe=True)
    new_cache = None
  else:
    cdt = jnp.dtype(cfg.compute_dtype)
    h = jnp.take(params["embed"], tokens_BT, axis=0).astype(cdt)
    if valid_BT is not None:  # padding (prefill padding, idle decode slots): selected, not scaled
      h = jnp.where(valid_BT[:, :, None], h, jnp.zeros((), cdt))
    h, new_cache, moe = _cached_layers(params, h, positions_BT, cfg, cache, valid_BT,
                                       routes_BTLk)
    h = rms_norm(h, params["final_norm"], cfg.rms_eps)
  logits = jnp.einsum("bte,ev->btv", h.astype(jnp.float32),
                      output_head(params, cfg).astype(jnp.float32))
  return (logits, new_cache) + ((h,) if return_hidden else ()) + ((moe,) if return_moe else ())


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
                        segment_ids_BT: jax.Array, block_len: int | None, *,
                        window: jax.Array | None = None,
                        sinks_H: jax.Array | None = None) -> jax.Array:
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
    window: optional int32 scalar sliding window in tokens (0 = full attention; see
      `kv_cache.window_mask`). Within a packed sample, positions and indices differ by a
      constant, so the window is applied on indices.
    sinks_H: optional float32 [H] sink logits (`kv_cache.gqa_attention`).

  Returns:
    [B, T, H, D] in q's dtype.
  """
  b, t = segment_ids_BT.shape
  real = (segment_ids_BT > 0)[:, :, None, None]
  k_BTKD = jnp.where(real, k_BTKD, jnp.zeros((), k_BTKD.dtype))
  v_BTKD = jnp.where(real, v_BTKD, jnp.zeros((), v_BTKD.dtype))
  if block_len is None or block_len >= t:
    return kv_cache_lib.gqa_attention(q_BTHD, k_BTKD, v_BTKD,
                                      _packed_mask(segment_ids_BT, window), sinks_H=sinks_H)
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
    if window is not None:
      causal = causal & kv_cache_lib.window_mask((first + jnp.arange(block_len))[:, None],
                                                 jnp.arange(t)[None, :], window)
    mask = causal[None] & (seg_blk[:, :, None] == segment_ids_BT[:, None, :])
    return kv_cache_lib.gqa_attention(q_blk, k_BTKD, v_BTKD, mask, sinks_H=sinks_H)

  body = jax.checkpoint(block)
  _, out = jax.lax.scan(lambda c, x: (c, body(*x)), None, (q, seg_q, start))
  return jnp.swapaxes(out, 0, 1).reshape(b, n * block_len, h, d)[:, :t]


def hidden_states(params: Params, tokens_BT: jax.Array, positions_BT: jax.Array,
                  cfg: ModelConfig, *, segment_ids_BT: jax.Array | None = None,
                  remat: str = "none", constrain: Constrain | None = None,
                  attention_block_len: int | None = None, routes_BTLk: jax.Array | None = None,
                  return_moe: bool = False,
                  attention_impl: str | Callable[..., jax.Array] = "blockwise"):
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
    routes_BTLk: MoE only: optional int32 [B, T, L_moe, k] replayed experts (see `forward`).
    return_moe: also return the `moe.MoeOutputs` (None for a dense model); its aux losses
      average over real tokens (segment > 0).
    attention_impl: "blockwise" (`blockwise_attention`) or a fused kernel of
      `train_attention.KERNELS` ("pallas_tpu", "pallas_gpu", their "_interpret" forms; same
      outputs, no fp32 scores in memory; `train_attention.resolve_train_attention` picks one),
      or a callable attend(q_BTHD, k_BTKD, v_BTKD, segment_ids_BT) -> [B, T, H, D] (e.g.
      `train_attention.sharded_flash_attention` for a sharded learner). The fused kernels
      take no attention sinks and no sliding windows: such models (GPT-OSS) need "blockwise".

  Returns:
    [B, T, E] in cfg.compute_dtype, or (hidden, MoeOutputs or None) with return_moe.

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
  _check_routes(cfg, routes_BTLk, tokens_BT.shape)
  layer_axes = {stack: {k: v[1:] for k, v in axes[stack].items()}  # without the stacked L axis
                for stack in ("layers", "moe_layers") if stack in axes}

  fused = callable(attention_impl) or attention_impl != "blockwise"
  if fused and (cfg.attention_sinks or cfg.sliding_window is not None):
    raise ValueError(
        f"attention_impl={attention_impl!r}: the fused training kernels take no attention sinks "
        "and no sliding windows (this model has them, e.g. GPT-OSS); set "
        "--config.learner.attention_impl=blockwise.")

  def step(h, extra, lp, layer, stack, routes_BTk):
    window = None if windows is None else windows[layer]
    if callable(attention_impl):
      attend = lambda q, k, v, sinks: (attention_impl(q, k, v, seg), None)
    elif attention_impl == "blockwise":
      attend = lambda q, k, v, sinks: (blockwise_attention(
          q, k, v, seg, attention_block_len, window=window, sinks_H=sinks), None)
    else:
      attend = lambda q, k, v, sinks: (train_attention.flash_attention(
          q, k, v, seg, attention_impl, attention_block_len), None)
    lp = {k: c(v, layer_axes[stack][k], weight=True) for k, v in lp.items()}
    if stack == "moe_layers":
      h, _, aux = _block(cfg, h, lp, positions_BT, attend,
                         (routes_BTk, seg > 0, getattr(c, "mesh", None)))
    else:
      (h, _), aux = _block(cfg, h, lp, positions_BT, attend), None
    return c(h, ("batch", "length", "embed")), extra, aux

  windows = _layer_windows(cfg)
  h, _, moe = _run_layers(params, h, cfg, (), step, routes_BTLk,
                          wrap=lambda f: remat_block(f, remat))
  h = rms_norm(h, params["final_norm"], cfg.rms_eps)
  return (h, moe) if return_moe else h
