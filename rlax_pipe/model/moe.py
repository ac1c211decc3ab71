"""Mixture-of-experts feed-forward block, as pure functions: top-k router, dropless grouped experts.

A token's hidden state x [E] is routed to k of X experts (Shazeer et al. 2017; Fedus et al. 2021,
Switch Transformers): router logits z = x W_r (+ b_r) [X]; the k selected experts each run a
SwiGLU MLP (Shazeer 2020) and their outputs are summed with the routing weights. Two routing
rules (`ModelConfig.router_softmax`):

* "all" (Qwen3-MoE, Mixtral): p = softmax(z) over all X experts, select the k largest p, weights
  = those p, divided by their sum when `norm_topk_prob`;
* "topk" (GPT-OSS): select the k largest z, weights = softmax over those k logits.

Experts are dropless (no capacity factor): the T*k (token, expert) assignments are sorted by
expert, each expert's contiguous group is multiplied by its own weights with one grouped matmul
(`jax.lax.ragged_dot` over the stacked [X, ...] expert weights), and the results are un-sorted
and combined. Every assignment is computed; nothing is dropped or padded to a capacity.

Router replay (R3, "Stabilizing MoE RL by aligning training and inference routers"): given
`experts_Tk` chosen elsewhere (e.g. by the sampler), those experts are used and their weights
come from THIS router's logits gathered at those ids (same rule as above), so gradients still
flow to the router. `moe_block` always returns the experts it used.

Auxiliary terms, returned (the learner scales them by its coefficients):
* Switch load-balancing loss (Fedus et al. 2021, eq. 4): X * sum_i f_i P_i, with f_i the fraction
  of the T*k assignments that went to expert i and P_i the mean router probability
  softmax(z)_i; 1 at perfect balance, X at total collapse onto one expert.
* Router z-loss (Zoph et al. 2022, ST-MoE, eq. 5): mean over tokens of (logsumexp_j z_j)^2.
Both average only over real tokens (`mask_T`).

Letters: T tokens, E embed, X experts, k experts per token, F expert MLP width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

ROUTER_SOFTMAX: tuple[str, ...] = ("all", "topk")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoeOutputs:
  """What a forward pass with `return_moe=True` reports about its MoE layers.

  Attributes:
    routes_BTLk: int32 [B, T, L_moe, k] expert ids each token used in each MoE layer (layers in
      model order, dense layers skipped); feed back as `routes_BTLk=` to replay them.
    load_balance_loss: float32 scalar, the Switch loss (eq. 4) averaged over MoE layers.
    z_loss: float32 scalar, the router z-loss (ST-MoE eq. 5) averaged over MoE layers.
  """

  routes_BTLk: jax.Array
  load_balance_loss: jax.Array
  z_loss: jax.Array


def route(logits_TX: jax.Array, k: int, *, softmax_over: str = "all", norm_topk_prob: bool = True,
          experts_Tk: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Top-k routing: selected experts and their weights (fp32).

  "all": p = softmax(z) over X experts, top-k of p, weights = p at those experts (divided by
  their sum when norm_topk_prob). "topk": top-k of z, weights = softmax over those k logits
  (norm_topk_prob does not apply: they already sum to 1). Ties break toward the lower id.

  Args:
    logits_TX: [T, X] router logits (any float dtype; computed in fp32).
    k: experts per token, 1 <= k <= X.
    softmax_over: "all" or "topk" (ROUTER_SOFTMAX).
    norm_topk_prob: renormalise the k selected probabilities to sum to 1 ("all" only).
    experts_Tk: optional int32 [T, k] experts to use instead of the top-k (router replay); the
      weights are then this router's, gathered at those ids by the same rule. A token whose
      row holds a negative id (`router_replay.NO_ROUTE`: a prompt or padding token) is routed
      by its own top-k.

  Returns:
    (experts_Tk int32 [T, k], weights_Tk float32 [T, k]).

  Raises:
    ValueError: bad rank, k out of range, unknown softmax_over, experts_Tk of the wrong shape.
  """
  if logits_TX.ndim != 2:
    raise ValueError(f"router logits must be [T, X]; got shape {logits_TX.shape}.")
  t, x = logits_TX.shape
  if not 1 <= k <= x:
    raise ValueError(f"k={k} experts per token must be in [1, n_experts={x}].")
  if softmax_over not in ROUTER_SOFTMAX:
    raise ValueError(f"softmax_over={softmax_over!r}; choose one of {ROUTER_SOFTMAX}.")
  z = logits_TX.astype(jnp.float32)
  if experts_Tk is None:
    _, experts_Tk = jax.lax.top_k(z, k)  # softmax is monotone: top-k of z == top-k of p
  elif experts_Tk.shape != (t, k):
    raise ValueError(f"experts_Tk has shape {experts_Tk.shape}; expected [T, k] = {(t, k)}.")
  else:  # a token whose replayed ids are negative (router_replay.NO_ROUTE) uses its own top-k
    _, own_Tk = jax.lax.top_k(z, k)
    experts_Tk = jnp.where(jnp.all(experts_Tk >= 0, axis=-1, keepdims=True),
                           experts_Tk.astype(jnp.int32), own_Tk)
  experts_Tk = experts_Tk.astype(jnp.int32)
  if softmax_over == "all":
    w = jnp.take_along_axis(jax.nn.softmax(z, axis=-1), experts_Tk, axis=-1)
    if norm_topk_prob:
      w = w / jnp.sum(w, axis=-1, keepdims=True)
  else:
    w = jax.nn.softmax(jnp.take_along_axis(z, experts_Tk, axis=-1), axis=-1)
  return experts_Tk, w


def load_balance_loss(logits_TX: jax.Array, experts_Tk: jax.Array,
                      mask_T: jax.Array | None = None) -> jax.Array:
  """Switch load-balancing loss (Fedus et al. 2021, eq. 4), top-k form: X * sum_i f_i P_i.

  f_i = (1 / (N k)) sum_t sum_j 1[experts_Tk[t, j] == i] (fraction of assignments; no gradient),
  P_i = (1 / N) sum_t softmax(z_t)_i, both over the N real tokens. Equals 1 when routing is
  uniform. (HF's `load_balancing_loss_func` sums f over the k slots, i.e. k times this.)

  Args:
    logits_TX: [T, X] router logits. experts_Tk: int32 [T, k] experts used.
    mask_T: optional bool/float [T], 1 for real tokens; None = all real.

  Returns:
    float32 scalar (0 when there is no real token).
  """
  t, x = logits_TX.shape
  m = jnp.ones((t,), jnp.float32) if mask_T is None else mask_T.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(m), 1.0)
  p_TX = jax.nn.softmax(logits_TX.astype(jnp.float32), axis=-1)
  p_X = jnp.sum(p_TX * m[:, None], axis=0) / n
  counts_X = jnp.sum(jax.nn.one_hot(experts_Tk, x, dtype=jnp.float32) * m[:, None, None],
                     axis=(0, 1))
  f_X = jax.lax.stop_gradient(counts_X / (n * experts_Tk.shape[1]))
  return x * jnp.sum(f_X * p_X)


def z_loss(logits_TX: jax.Array, mask_T: jax.Array | None = None) -> jax.Array:
  """Router z-loss (Zoph et al. 2022, ST-MoE eq. 5): mean_t (log sum_j exp z_tj)^2, real tokens.

  Args:
    logits_TX: [T, X] router logits. mask_T: optional [T], 1 for real tokens; None = all.

  Returns:
    float32 scalar.
  """
  t = logits_TX.shape[0]
  m = jnp.ones((t,), jnp.float32) if mask_T is None else mask_T.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits_TX.astype(jnp.float32), axis=-1)
  return jnp.sum(m * lse * lse) / jnp.maximum(jnp.sum(m), 1.0)


EXPERT_ACTIVATIONS: tuple[str, ...] = ("swiglu", "gpt_oss")


def expert_glu(gate: jax.Array, up: jax.Array, activation: str = "swiglu",
               alpha: float = 1.702, limit: float = 7.0) -> jax.Array:
  """The experts' gated activation, elementwise on [..., F] gate and up projections.

  "swiglu" (Shazeer 2020, eq. 6): silu(gate) * up. "gpt_oss" (the clamped variant of GPT-OSS;
  transformers `GptOssExperts._apply_gate`): g = min(gate, limit), u = clip(up, -limit, limit),
  (u + 1) * g * sigmoid(alpha * g).

  Raises:
    ValueError: on an unknown activation (the message lists EXPERT_ACTIVATIONS).
  """
  if activation == "swiglu":
    return jax.nn.silu(gate) * up
  if activation == "gpt_oss":
    g = jnp.minimum(gate, limit)
    u = jnp.clip(up, -limit, limit)
    return (u + 1) * (g * jax.nn.sigmoid(alpha * g))
  raise ValueError(f"expert activation {activation!r}; choose one of {EXPERT_ACTIVATIONS}.")


def grouped_swiglu(x_TE: jax.Array, experts_Tk: jax.Array, weights_Tk: jax.Array,
                   w_gate_XEF: jax.Array, w_up_XEF: jax.Array,
                   w_down_XFE: jax.Array, *, biases: tuple[jax.Array, ...] | None = None,
                   activation: str = "swiglu", alpha: float = 1.702,
                   limit: float = 7.0) -> jax.Array:
  """Dropless expert compute: sum_j weights[t, j] * SwiGLU_{experts[t, j]}(x_t).

  Sorts the T*k assignments by expert (stable), runs each expert's SwiGLU
  down(silu(x W_gate) * (x W_up)) (Shazeer 2020, eq. 6) on its contiguous group with
  `jax.lax.ragged_dot`, un-sorts and sums over the k slots with the routing weights (cast to
  x's dtype, as transformers does).

  Args:
    x_TE: [T, E] token hidden states. experts_Tk: int32 [T, k] in [0, X).
    weights_Tk: [T, k] routing weights.
    w_gate_XEF, w_up_XEF: [X, E, F] stacked expert input projections; w_down_XFE: [X, F, E].
    biases: optional per-expert biases (gate [X, F], up [X, F], down [X, E]) added after each
      projection (GPT-OSS).
    activation, alpha, limit: the gated activation (`expert_glu`; "swiglu" or "gpt_oss").

  Returns:
    [T, E] in x's dtype.
  """
  t, e = x_TE.shape
  k = experts_Tk.shape[1]
  n_experts = w_gate_XEF.shape[0]
  flat = experts_Tk.reshape(t * k)
  order = jnp.argsort(flat, stable=True)  # assignment index, sorted by expert
  x_sorted = jnp.take(x_TE, order // k, axis=0)  # [T*k, E]
  group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
  gate = jax.lax.ragged_dot(x_sorted, w_gate_XEF, group_sizes)
  up = jax.lax.ragged_dot(x_sorted, w_up_XEF, group_sizes)
  if biases is not None:  # per-expert biases, gathered by each sorted assignment's expert
    expert_sorted = jnp.take(flat, order)
    b_gate, b_up, b_down = (jnp.take(b, expert_sorted, axis=0) for b in biases)
    gate, up = gate + b_gate, up + b_up
  out_sorted = jax.lax.ragged_dot(expert_glu(gate, up, activation, alpha, limit), w_down_XFE,
                                  group_sizes)
  if biases is not None:
    out_sorted = out_sorted + b_down
  out = jnp.zeros_like(out_sorted).at[order].set(out_sorted, unique_indices=True)
  out_TkE = out.reshape(t, k, e)
  return jnp.einsum("tke,tk->te", out_TkE, weights_Tk.astype(x_TE.dtype))


def moe_block(x_TE: jax.Array, p: dict[str, Any], *, k: int, softmax_over: str = "all",
              norm_topk_prob: bool = True, experts_Tk: jax.Array | None = None,
              mask_T: jax.Array | None = None, activation: str = "swiglu",
              alpha: float = 1.702, limit: float = 7.0, experts_fn=None):
  """One MoE feed-forward layer on T tokens: route, grouped SwiGLU experts, aux losses.

  Args:
    x_TE: [T, E] normalised hidden states (compute dtype).
    p: {"router": [E, X], optional "router_bias": [X], "experts_gate": [X, E, F],
      "experts_up": [X, E, F], "experts_down": [X, F, E], optional "experts_gate_bias",
      "experts_up_bias" [X, F] and "experts_down_bias" [X, E] (all three or none)} (compute
      dtype).
    k, softmax_over, norm_topk_prob: routing rule (see `route`).
    activation, alpha, limit: the experts' gated activation (`expert_glu`).
    experts_Tk: optional int32 [T, k] replayed experts (see `route`); None = top-k.
    mask_T: optional [T] real-token mask for the aux losses (routing itself is per token).
    experts_fn: optional `experts_fn(x_TE, experts_Tk, weights_Tk, p) -> [T, E]` computing the
      experts instead of `grouped_swiglu` (same result), e.g. with the experts split over an
      "expert" mesh axis (`model.moe_parallel.expert_parallel_swiglu`).

  Returns:
    (out [T, E] in x's dtype, experts_Tk int32 [T, k] used, load_balance_loss float32 scalar,
    z_loss float32 scalar).

  Raises:
    ValueError: `experts_fn` together with expert biases or a non-SwiGLU activation (GPT-OSS):
      the expert-parallel path runs plain SwiGLU experts only.
  """
  if x_TE.ndim != 2:
    raise ValueError(f"x must be [T, E]; got shape {x_TE.shape}.")
  logits = jnp.einsum("te,ex->tx", x_TE, p["router"]).astype(jnp.float32)
  if "router_bias" in p:
    logits = logits + p["router_bias"].astype(jnp.float32)[None]
  experts_Tk, w = route(logits, k, softmax_over=softmax_over, norm_topk_prob=norm_topk_prob,
                        experts_Tk=experts_Tk)
  biases = (p["experts_gate_bias"], p["experts_up_bias"], p["experts_down_bias"]) if (
      "experts_gate_bias" in p) else None
  if experts_fn is None:
    out = grouped_swiglu(x_TE, experts_Tk, w, p["experts_gate"], p["experts_up"],
                         p["experts_down"], biases=biases, activation=activation, alpha=alpha,
                         limit=limit)
  elif biases is not None or activation != "swiglu":
    raise ValueError(
        "expert parallelism (an 'expert' mesh axis) runs plain SwiGLU experts without biases; "
        f"this model has activation={activation!r}, expert biases={biases is not None} (GPT-OSS): "
        "drop the 'expert' axis from the learner mesh (--config.learner.mesh_axes).")
  else:  # e.g. expert parallelism (`model.moe_parallel`)
    out = experts_fn(x_TE, experts_Tk, w, p)
  return (out, experts_Tk, load_balance_loss(logits, experts_Tk, mask_T),
          z_loss(logits, mask_T))


def upcycle(cfg, params: dict[str, Any], n_experts: int, n_experts_per_tok: int,
            rng: jax.Array, router_std: float = 0.02, **moe_fields):
  """Sparse upcycling (Komatsuzaki et al. 2022): a dense model's every MLP becomes an MoE layer
  whose X experts are copies of that MLP, with a fresh router ~ N(0, router_std^2).

  With norm_topk_prob (the default here) the k routing weights sum to 1, so while the experts
  are still equal the MoE model computes exactly the dense model's function (to fp32 rounding);
  training then lets the experts diverge. Used to start a tiny MoE from the shipped dense SFT
  warm start (`RunConfig.init="builtin_moe"`).

  Args:
    cfg: the dense model's `ModelConfig` (n_experts == 0).
    params: its params (`transformer.param_specs(cfg)` layout, numpy or jax).
    n_experts, n_experts_per_tok: X >= 2 and k in [1, X].
    rng: PRNG key of the router weights.
    router_std: standard deviation of the router weights (> 0).
    **moe_fields: further `ModelConfig` MoE fields (e.g. router_aux_loss_coef).

  Returns:
    (moe_cfg, moe_params): every layer MoE (moe_d_ff = d_ff), params in its layout (numpy).

  Raises:
    ValueError: cfg already has experts (or the MoE fields are invalid, from ModelConfig).
  """
  import numpy as np  # pylint: disable=import-outside-toplevel
  if cfg.n_experts:
    raise ValueError(f"upcycle needs a dense model; this one has n_experts={cfg.n_experts}.")
  moe_cfg = dataclasses.replace(cfg, n_experts=n_experts, n_experts_per_tok=n_experts_per_tok,
                                moe_d_ff=cfg.d_ff, **{"norm_topk_prob": True, **moe_fields})
  layers = {k: np.asarray(v) for k, v in params["layers"].items()}
  moe_layers = {k: v for k, v in layers.items() if k not in ("w_gate", "w_up", "w_down")}
  for ours, dense in (("experts_gate", "w_gate"), ("experts_up", "w_up"),
                      ("experts_down", "w_down")):
    moe_layers[ours] = np.repeat(layers[dense][:, None], n_experts, axis=1)
  dtype = layers["wq"].dtype
  moe_layers["router"] = np.asarray(router_std * jax.random.normal(
      rng, (cfg.n_layers, cfg.d_model, n_experts)), dtype)
  if moe_cfg.router_bias:
    moe_layers["router_bias"] = np.zeros((cfg.n_layers, n_experts), dtype)
  out = {k: np.asarray(v) for k, v in params.items() if k != "layers"}
  out["moe_layers"] = moe_layers
  return moe_cfg, out
