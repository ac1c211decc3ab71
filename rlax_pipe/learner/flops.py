"""Model FLOPs per trained token and the peak throughput of named chips, for MFU.

MFU (model FLOPs utilization, Chowdhery et al. 2022, "PaLM", Sec. 4.1 and Appendix B) is the
model's FLOPs per token times the tokens trained per second, divided by the chip's peak: it
counts what the model needs, not what the program executes (rematerialisation, padding rows and
chunked-logit recomputation are not credited), so it is comparable across implementations.
"""

from __future__ import annotations

from rlax_pipe.config import ModelConfig
from rlax_pipe.costs import chips

def matmul_params(cfg: ModelConfig) -> int:
  """N: parameters that take part in a matmul per token (attention and MLP projections of every
  layer, plus the output projection E x V, counted once even when tied to the embedding). The
  embedding lookup and norm scales do no multiply-adds and are left out. A mixture-of-experts
  layer counts its *active* parameters: the router E x X and the k experts a token is routed
  to, k x 3 E Fe (the other X - k experts do no work for that token)."""
  e, h, k, d, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  attn = e * h * d + 2 * e * k * d + h * d * e
  moe = cfg.n_moe_layers
  per_moe = e * cfg.n_experts + cfg.n_experts_per_tok * 3 * e * cfg.moe_d_ff if moe else 0
  return (cfg.n_layers * attn + (cfg.n_layers - moe) * 3 * e * f + moe * per_moe
          + e * cfg.vocab_size)


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token: 6 N + 12 n_layers n_heads head_dim T.

  PaLM Appendix B (Chowdhery et al. 2022): a forward pass costs 2 FLOPs per parameter per token
  (one multiply-add) and the backward twice that, 6N in all; attention adds, per layer and
  token, 2 matmuls (q k^T and p v) of T x n_heads x head_dim multiply-adds each in the forward,
  i.e. 4 T H Q FLOPs, times 3 for forward + backward = 12 T H Q. T is the row length the
  attention spans (packed rows of `seq_len` tokens); causal masking is not discounted (as in
  PaLM). N is `matmul_params(cfg)` (Kaplan et al. 2020 Sec. 2.1 likewise leave embeddings out).

  Args:
    cfg: model configuration.
    seq_len: tokens per row T.

  Returns:
    FLOPs per trained token (float).
  """
  return (6.0 * matmul_params(cfg)
          + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len)


def peak_tflops(device_kind: str) -> tuple[float | None, str]:
  """(dense bf16 peak TFLOP/s, source) of a chip named by `jax.Device.device_kind`, from the one
  chip table `rlax_pipe.costs.chips` (vendors' data sheets; NVIDIA's "with sparsity" bf16 rates
  halved), or (None, reason) when the table does not know it (pass the peak explicitly then)."""
  c = chips.chip_for_device(device_kind)
  if c is not None:
    return c.peak_flops_bf16 / 1e12, f"rlax_pipe.costs.chips {c.name}: {c.source}"
  return None, (f"device kind {device_kind!r} is not in rlax_pipe.costs.chips.CHIPS "
                f"({[c.name for c in chips.CHIPS]}); pass its peak explicitly (--peak_tflops)")
