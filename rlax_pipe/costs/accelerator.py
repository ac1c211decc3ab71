"""Analytic cost model of a named accelerator from the model's shape (what-ifs off this machine).

Every number here is a prediction from published chip specifications (`costs.chips`) and the
model's shape; the assumptions are fields of `Assumptions`, stated where they are used.

Model shape (`ModelShape.of(ModelConfig)`):
  N = matmul parameters: per layer E*H*D (q) + 2*E*K*D (k, v) + H*D*E (o) + 3*E*F (SwiGLU), plus
  the output projection E*V (the embedding lookup does no multiply-add; Kaplan et al. 2020,
  "Scaling Laws for Neural Language Models", Sec. 2.1, leave embeddings out likewise);
  weight bytes = (N + E*V if untied) * bytes per parameter; KV bytes per token = 2 (K and V) *
  layers * kv_heads * head_dim * bytes per value.

Sampler engine on `tp` devices (tensor parallel), per decode step (Williams et al. 2009,
"Roofline"; decoding reads all weights once per step plus each active slot's live KV):
  decode_step_s = weight bytes / (tp * HBM bandwidth * hbm_efficiency)
  token_step_s  = KV bytes per token / (tp * HBM bandwidth * hbm_efficiency)
  flop_slot_step_s = 2 N / (tp * peak * decode_mfu)   (compute-bound floor per slot)
  prefill: one weight read per call, 2 N FLOPs per token at prefill_mfu.
Learner on `n` devices (FSDP), per step (PaLM, Chowdhery et al. 2022, Appendix B):
  train_token_s = (6 N + 12 layers * heads * head_dim * T) / (n * peak * train_mfu), T = row
  length; micro_batch_s = 2 weight bytes / interconnect (FSDP all-gathers the weights for the
  forward and the backward of every micro-batch); train_step_s = optimizer update, reading and
  writing `optimizer_bytes_per_param` bytes per parameter / (n * HBM bandwidth) + overhead.
Weight push: weight bytes / (interconnect bandwidth * push_efficiency) + push overhead.
"""

from __future__ import annotations

import dataclasses

from rlax_pipe.config import ModelConfig
from rlax_pipe.costs import chips as chips_lib
from rlax_pipe.costs.model import CostModel

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What the cost model needs of a decoder.

  Attributes:
    matmul_params: N (module docstring).
    weight_bytes: bytes of one copy of the weights.
    kv_bytes_per_token: K and V of one token over all layers, bytes.
    attn_flops_per_token_per_ctx: 12 * layers * heads * head_dim (training attention FLOPs per
      token per token of row length).
    name: label.
  """

  matmul_params: float
  weight_bytes: float
  kv_bytes_per_token: float
  attn_flops_per_token_per_ctx: float
  name: str = ""

  @classmethod
  def of(cls, cfg: ModelConfig, name: str = "", kv_dtype: str | None = None) -> ModelShape:
    """The shape of a `ModelConfig` (weights in its param_dtype, KV in `kv_dtype` or the
    compute dtype)."""
    e, h, k, d, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    per_layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f
    n = cfg.n_layers * per_layer + e * cfg.vocab_size
    stored = n + (0 if cfg.tie_embeddings else e * cfg.vocab_size)
    kv = _BYTES[kv_dtype or cfg.compute_dtype]
    return cls(matmul_params=float(n), weight_bytes=float(stored * _BYTES[cfg.param_dtype]),
               kv_bytes_per_token=float(2 * cfg.n_layers * k * d * kv),
               attn_flops_per_token_per_ctx=float(12 * cfg.n_layers * h * d), name=name)


# meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, 32 heads, 8 kv heads, head_dim
# 128, intermediate 14336, vocab 128256, untied embeddings; bf16.
LLAMA_3_8B = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         head_dim=128, d_ff=14336, rope_theta=500000.0, tie_embeddings=False,
                         param_dtype="bfloat16", compute_dtype="bfloat16", max_seq_len=8192)


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
      decode_step_s=shape.weight_bytes / bw, slot_step_s=0.0,
      token_step_s=shape.kv_bytes_per_token / bw,
      flop_slot_step_s=2 * n / (sampler_tp * c.peak_flops_bf16 * a.decode_mfu),
      prefill_call_s=shape.weight_bytes / bw,
      prefill_token_s=2 * n / (sampler_tp * c.peak_flops_bf16 * a.prefill_mfu),
      train_step_s=(a.learner_overhead_s + a.optimizer_bytes_per_param * n
                    / (learner_devices * c.hbm_bandwidth)),
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
