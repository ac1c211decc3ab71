"""Analytic cost model of a named accelerator from the model's shape (what-ifs off this machine).

Every number here is a prediction from published chip specifications (`costs.chips`) and the
model's shape; the assumptions are fields of `Assumptions`, stated where they are used.

Model shape (`ModelShape.of(ModelConfig)` or `ModelShape.from_dims`):
  N = *active* matmul parameters per token: per layer E*H*D (q) + 2*E*K*D (k, v) + H*D*E (o),
  plus 3*E*F (SwiGLU) in a dense layer or E*X (router) + k*3*E*Fe (the k routed experts of X,
  each a SwiGLU of width Fe) in a mixture-of-experts layer, plus the output projection E*V (the
  embedding lookup does no multiply-add; Kaplan et al. 2020, "Scaling Laws for Neural Language
  Models", Sec. 2.1, leave embeddings out likewise). The *total* matmul parameters count all X
  experts (X*3*E*Fe per MoE layer); they set the stored bytes, the optimizer's work and the
  FSDP gathers. Biases and norms are left out (< 0.1% of either model below).
  weight bytes = (total + E*V if untied) * bytes per parameter; expert bytes = the routed
  experts' share of them; KV bytes per token = 2 (K and V) * full-attention layers * kv_heads *
  head_dim * bytes per value; a sliding-window layer (GPT-OSS) holds at most `window` tokens,
  so it adds at most window * 2 * kv_heads * head_dim * bytes per active slot per step.

Sampler engine on `tp` devices (tensor parallel), per decode step (Williams et al. 2009,
"Roofline"; decoding reads every weight it uses once per step plus each active slot's live KV):
  decode_step_s = (weight bytes - expert bytes) / (tp * HBM bandwidth * hbm_efficiency)
  expert_step_s = expert bytes / (same): a step reads only the experts its b active tokens
    route to, a fraction `expected_experts_hit(X, k, b) / X` of them (uniform routing, the
    target of the load-balancing loss; `CostModel` applies it per step)
  slot_step_s   = sliding-window KV bytes per slot / (same)
  token_step_s  = KV bytes per token / (same)
  flop_slot_step_s = 2 N / (tp * peak * decode_mfu)   (compute-bound floor per slot, active N)
  prefill: one read of every weight per call (a prompt's tokens hit every expert), 2 N FLOPs
  per token at prefill_mfu.
Learner on `n` devices (FSDP), per step (PaLM, Chowdhery et al. 2022, Appendix B):
  train_token_s = (6 N + 12 layers * heads * head_dim * T) / (n * peak * train_mfu), T = row
  length, N active (a token's forward and backward multiply only through its k experts);
  micro_batch_s = 2 weight bytes / interconnect (FSDP all-gathers all the weights, every
  expert, for the forward and the backward of every micro-batch); train_step_s = optimizer
  update, reading and writing `optimizer_bytes_per_param` bytes per *total* parameter /
  (n * HBM bandwidth) + overhead.
Weight push: weight bytes / (interconnect bandwidth * push_efficiency) + push overhead.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlax_pipe.config import ModelConfig, RopeScaling
from rlax_pipe.costs import chips as chips_lib
from rlax_pipe.costs.model import CostModel

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def expected_experts_hit(n_experts: int, experts_per_tok: int, tokens) -> np.ndarray:
  """Expected number of distinct experts that `tokens` tokens route to in one MoE layer, when
  each token picks `experts_per_tok` of `n_experts` uniformly and independently of the others:
  X * (1 - (1 - k/X)^b). One token misses a given expert with probability C(X-1, k)/C(X, k) =
  1 - k/X; b independent tokens all miss it with (1 - k/X)^b; sum over the X experts
  (linearity of expectation). Uniform routing is what the Switch load-balancing loss (Fedus et
  al. 2022, Eq. 4) drives a router towards; a skewed router hits fewer experts, so this is the
  larger (safer) estimate of the weight bytes a decode step reads. It grows like k*b for small
  b and saturates at X; b may be fractional (an average over decode steps).

  Args:
    n_experts: X >= 1.
    experts_per_tok: k in [1, X].
    tokens: b >= 0, float or float64 array (tokens decoded in one step of that layer).

  Returns:
    float64 (array) of the expected distinct experts, in [0, X].

  Raises:
    ValueError: if not 1 <= k <= X or b < 0.
  """
  if not 1 <= experts_per_tok <= n_experts:
    raise ValueError(f"expected_experts_hit: need 1 <= experts_per_tok ({experts_per_tok}) <= "
                     f"n_experts ({n_experts}).")
  b = np.asarray(tokens, np.float64)
  if np.any(b < 0):
    raise ValueError(f"expected_experts_hit: tokens={tokens} must be >= 0.")
  return n_experts * (1.0 - (1.0 - experts_per_tok / n_experts) ** b)


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What the cost model needs of a decoder (module docstring).

  Attributes:
    matmul_params: N, *active* matmul parameters per token (all of them in a dense model).
    weight_bytes: bytes of one copy of all the weights (every expert).
    kv_bytes_per_token: K and V of one token over the full-attention layers, bytes.
    attn_flops_per_token_per_ctx: 12 * layers * heads * head_dim (training attention FLOPs per
      token per token of row length).
    name: label.
    total_matmul_params: matmul parameters counting every expert; None = dense (= N).
    expert_bytes: bytes of the routed experts' weights over all MoE layers (in weight_bytes).
    n_experts: X, routed experts per MoE layer (0 = dense).
    experts_per_tok: k, experts each token is routed to (0 = dense).
    window_kv_bytes_per_slot: K and V bytes a slot reads per decode step in sliding-window
      layers once its context fills the window (0 = none).
  """

  matmul_params: float
  weight_bytes: float
  kv_bytes_per_token: float
  attn_flops_per_token_per_ctx: float
  name: str = ""
  total_matmul_params: float | None = None
  expert_bytes: float = 0.0
  n_experts: int = 0
  experts_per_tok: int = 0
  window_kv_bytes_per_slot: float = 0.0

  @property
  def stored_matmul_params(self) -> float:
    """Matmul parameters stored (every expert): what the optimizer updates."""
    return self.matmul_params if self.total_matmul_params is None else self.total_matmul_params

  @classmethod
  def from_dims(cls, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int,
                n_kv_heads: int, head_dim: int, d_ff: int, tie_embeddings: bool,
                param_bytes: int, kv_bytes: int, n_experts: int = 0, experts_per_tok: int = 0,
                moe_d_ff: int = 0, moe_layers: int = 0, sliding_layers: int = 0,
                sliding_window: int = 0, name: str = "") -> ModelShape:
    """The shape of a decoder given by its dimensions (module docstring; letters as there).

    Args:
      vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim: V, E, layers, H, K, D.
      d_ff: F, SwiGLU width of the dense (non-MoE) layers.
      tie_embeddings: the output projection is the embedding (stored once).
      param_bytes, kv_bytes: bytes per stored parameter and per cached K / V value.
      n_experts, experts_per_tok, moe_d_ff: X, k, Fe of the MoE layers (0 when dense).
      moe_layers: how many of the n_layers are MoE layers (the rest are dense).
      sliding_layers, sliding_window: layers attending to only the last `sliding_window`
        tokens (GPT-OSS), and that window (tokens).

    Raises:
      ValueError: on inconsistent MoE or sliding-window dimensions.
    """
    if moe_layers and not (1 <= experts_per_tok <= n_experts and moe_d_ff >= 1):
      raise ValueError(f"ModelShape.from_dims: {moe_layers} MoE layers need 1 <= experts_per_tok "
                       f"({experts_per_tok}) <= n_experts ({n_experts}) and moe_d_ff "
                       f"({moe_d_ff}) >= 1.")
    if not (0 <= moe_layers <= n_layers and 0 <= sliding_layers <= n_layers):
      raise ValueError(f"ModelShape.from_dims: moe_layers={moe_layers} and sliding_layers="
                       f"{sliding_layers} must be in [0, n_layers={n_layers}].")
    if sliding_layers and sliding_window < 1:
      raise ValueError("ModelShape.from_dims: sliding_layers need sliding_window >= 1.")
    e, h, k, d = d_model, n_heads, n_kv_heads, head_dim
    attn = e * h * d + 2 * e * k * d + h * d * e
    dense = n_layers - moe_layers
    expert = 3 * e * moe_d_ff  # one routed expert's SwiGLU
    head = e * vocab_size
    active = n_layers * attn + dense * 3 * e * d_ff + moe_layers * (
        e * n_experts + experts_per_tok * expert) + head
    total = active + moe_layers * (n_experts - experts_per_tok) * expert
    stored = total + (0 if tie_embeddings else head)
    kv_layer = 2 * k * d * kv_bytes
    return cls(matmul_params=float(active), weight_bytes=float(stored * param_bytes),
               kv_bytes_per_token=float((n_layers - sliding_layers) * kv_layer),
               attn_flops_per_token_per_ctx=float(12 * n_layers * h * d), name=name,
               total_matmul_params=float(total) if moe_layers else None,
               expert_bytes=float(moe_layers * n_experts * expert * param_bytes),
               n_experts=n_experts if moe_layers else 0,
               experts_per_tok=experts_per_tok if moe_layers else 0,
               window_kv_bytes_per_slot=float(sliding_layers * sliding_window * kv_layer))

  @classmethod
  def of(cls, cfg: ModelConfig, name: str = "", kv_dtype: str | None = None) -> ModelShape:
    """The shape of a `ModelConfig` (weights in its param_dtype, KV in `kv_dtype` or the
    compute dtype)."""
    return cls.from_dims(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
        n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, d_ff=cfg.d_ff,
        tie_embeddings=cfg.tie_embeddings, param_bytes=_BYTES[cfg.param_dtype],
        kv_bytes=_BYTES[kv_dtype or cfg.compute_dtype], n_experts=cfg.n_experts,
        experts_per_tok=cfg.n_experts_per_tok, moe_d_ff=cfg.moe_d_ff,
        moe_layers=cfg.n_moe_layers,
        sliding_layers=sum(t == "sliding_attention" for t in cfg.layer_types),
        sliding_window=cfg.sliding_window or 0, name=name)


# meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, 32 heads, 8 kv heads, head_dim
# 128, intermediate 14336, vocab 128256, untied embeddings; bf16.
LLAMA_3_8B = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         head_dim=128, d_ff=14336, rope_theta=500000.0, tie_embeddings=False,
                         param_dtype="bfloat16", compute_dtype="bfloat16", max_seq_len=8192)


# Qwen/Qwen3-30B-A3B as a `ModelConfig` (the simulator's what-ifs and the AOT compiles take it).
QWEN3_30B_A3B = ModelConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
                            n_kv_heads=4, head_dim=128, d_ff=6144, rope_theta=1e6, qk_norm=True,
                            tie_embeddings=False, param_dtype="bfloat16",
                            compute_dtype="bfloat16", max_seq_len=40960, n_experts=128,
                            n_experts_per_tok=8, moe_d_ff=768, norm_topk_prob=True)
# Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers (all MoE: decoder_sparse_step 1, no
# mlp_only_layers), 32 heads, 4 kv heads, head_dim 128, 128 experts, 8 per token,
# moe_intermediate_size 768, vocab 151936, untied embeddings; bf16. 30.5 B total, 3.3 B active.
QWEN3_30B_A3B_SHAPE = ModelShape.from_dims(
    vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    d_ff=6144, tie_embeddings=False, param_bytes=2, kv_bytes=2, n_experts=128,
    experts_per_tok=8, moe_d_ff=768, moe_layers=48, name="qwen3-30b-a3b")
# openai/gpt-oss-20b config.json: hidden 2880, 24 layers (all MoE), 64 heads, 8 kv heads,
# head_dim 64, 32 local experts, 4 per token, intermediate_size 2880, vocab 201088, untied;
# layer_types alternate sliding_attention (window 128) and full_attention: 12 of each. Expert
# weights are stored in MXFP4 on the Hub; this shape prices them in bf16 (as the learner and a
# bf16 sampler hold them after import). 20.9 B total, 3.6 B active (N: the unembedding counted,
# the embedding lookup not; the model card's counts).
# openai/gpt-oss-20b as a `ModelConfig` (the AOT compiles and the what-ifs take it; the same
# config `model.hf_config.config_from_hf` reads from its config.json, tests/costs check that):
# YaRN rope (factor 32 over 4096 tokens, beta 32 / 1, not truncated), theta 150000, attention
# and router and expert biases, one sink per head, the clamped SwiGLU experts (alpha 1.702,
# limit 7), softmax over the top-4 router logits, layers alternating sliding (128) / full.
GPT_OSS_20B = ModelConfig(
    vocab_size=201088, d_model=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64,
    d_ff=2880, rope_theta=150000.0, rms_eps=1e-5, qkv_bias=True, o_bias=True,
    tie_embeddings=False, param_dtype="bfloat16", compute_dtype="bfloat16",
    max_seq_len=131072,
    rope_scaling=RopeScaling(rope_type="yarn", factor=32.0,
                             original_max_position_embeddings=4096, beta_fast=32.0,
                             beta_slow=1.0, truncate=False),
    attention_sinks=True, sliding_window=128,
    layer_types=("sliding_attention", "full_attention") * 12, n_experts=32,
    n_experts_per_tok=4, moe_d_ff=2880, router_softmax="topk", router_bias=True,
    expert_bias=True, expert_activation="gpt_oss", swiglu_alpha=1.702, swiglu_limit=7.0)
GPT_OSS_20B_SHAPE = ModelShape.from_dims(
    vocab_size=201088, d_model=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64,
    d_ff=2880, tie_embeddings=False, param_bytes=2, kv_bytes=2, n_experts=32,
    experts_per_tok=4, moe_d_ff=2880, moe_layers=24, sliding_layers=12, sliding_window=128,
    name="gpt-oss-20b")


@dataclasses.dataclass(frozen=True)
class Assumptions:
  """Efficiencies and overheads of the analytic model (fractions of peak; seconds).

  Defaults: decoding reaches 80% of HBM bandwidth; prefill and decode compute 50% and training
  40% of the bf16 peak (MFU); 1 ms of host work per engine step and 0.5 ms per dispatch; the
  optimizer reads and writes 28 bytes per parameter (fp32 master weights, gradients, two Adam
  moments read; weights and moments written) plus 0.2 s of fixed learner work per step; pushes
  reach 50% of the interconnect bandwidth plus 5 ms.
  """

  hbm_efficiency: float = 0.8
  decode_mfu: float = 0.5
  prefill_mfu: float = 0.5
  train_mfu: float = 0.4
  engine_step_s: float = 1e-3
  dispatch_s: float = 5e-4
  optimizer_bytes_per_param: float = 28.0
  learner_overhead_s: float = 0.2
  push_efficiency: float = 0.5
  push_overhead_s: float = 5e-3

  def __post_init__(self):
    for name in ("hbm_efficiency", "decode_mfu", "prefill_mfu", "train_mfu", "push_efficiency"):
      if not 0 < getattr(self, name) <= 1:
        raise ValueError(f"Assumptions.{name}={getattr(self, name)} must be in (0, 1].")


def analytic_cost_model(shape: ModelShape, chip: str | chips_lib.Chip, *, sampler_tp: int,
                        learner_devices: int, train_row_len: int,
                        assumptions: Assumptions = Assumptions()) -> CostModel:
  """The `CostModel` of one sampler engine on `sampler_tp` chips and a learner on
  `learner_devices` chips (module docstring).

  Args:
    shape: the model.
    chip: a `costs.chips` name (e.g. "H200") or entry.
    sampler_tp: chips per sampler engine (>= 1).
    learner_devices: chips of the learner (>= 1).
    train_row_len: T, tokens per packed learner row (attention FLOPs grow with it).
    assumptions: efficiencies and overheads.

  Raises:
    ValueError: on device counts < 1, or weights that do not fit an engine's HBM.
  """
  c = chips_lib.chip(chip) if isinstance(chip, str) else chip
  if sampler_tp < 1 or learner_devices < 1 or train_row_len < 1:
    raise ValueError(f"analytic_cost_model: sampler_tp={sampler_tp}, learner_devices="
                     f"{learner_devices}, train_row_len={train_row_len} must be >= 1.")
  if shape.weight_bytes >= sampler_tp * c.hbm_bytes:
    raise ValueError(f"analytic_cost_model: {shape.weight_bytes:.3g} B of weights do not fit in "
                     f"{sampler_tp} x {c.hbm_bytes:.3g} B of {c.name} HBM; raise sampler_tp.")
  a = assumptions
  bw = sampler_tp * c.hbm_bandwidth * a.hbm_efficiency
  n = shape.matmul_params
  train_flops = 6 * n + shape.attn_flops_per_token_per_ctx * train_row_len
  return CostModel(
      engine_step_s=a.engine_step_s, dispatch_s=a.dispatch_s,
      decode_step_s=(shape.weight_bytes - shape.expert_bytes) / bw,
      slot_step_s=shape.window_kv_bytes_per_slot / bw,
      token_step_s=shape.kv_bytes_per_token / bw,
      expert_step_s=shape.expert_bytes / bw, moe_experts=shape.n_experts,
      moe_top_k=shape.experts_per_tok,
      flop_slot_step_s=2 * n / (sampler_tp * c.peak_flops_bf16 * a.decode_mfu),
      prefill_call_s=shape.weight_bytes / bw,
      prefill_token_s=2 * n / (sampler_tp * c.peak_flops_bf16 * a.prefill_mfu),
      train_step_s=(a.learner_overhead_s + a.optimizer_bytes_per_param
                    * shape.stored_matmul_params / (learner_devices * c.hbm_bandwidth)),
      train_token_s=train_flops / (learner_devices * c.peak_flops_bf16 * a.train_mfu),
      micro_batch_s=(2 * shape.weight_bytes / c.interconnect_bandwidth
                     if learner_devices > 1 else 0.0),
      push_s=a.push_overhead_s,
      push_byte_s=1.0 / (c.interconnect_bandwidth * a.push_efficiency),
      source=(f"analytic: {shape.name or 'model'} on {c.name} (sampler tp={sampler_tp}, "
              f"learner {learner_devices} chips; {c.source}; assumptions {a})"))


def kv_limited_slots(shape: ModelShape, chip: str | chips_lib.Chip, sampler_tp: int,
                     tokens_per_slot: float, hbm_fraction: float = 0.9,
                     max_slots: int = 1024) -> int:
  """Decode slots one engine holds: (hbm_fraction * tp * HBM - weights) / (KV bytes per token *
  tokens per slot), at least 1 and at most `max_slots`.

  Raises:
    ValueError: if the weights leave no room.
  """
  c = chips_lib.chip(chip) if isinstance(chip, str) else chip
  free = hbm_fraction * sampler_tp * c.hbm_bytes - shape.weight_bytes
  if free <= 0:
    raise ValueError(f"kv_limited_slots: weights ({shape.weight_bytes:.3g} B) fill {sampler_tp} "
                     f"x {c.name}; raise sampler_tp.")
  return max(1, min(max_slots, int(free // (shape.kv_bytes_per_token * tokens_per_slot))))
