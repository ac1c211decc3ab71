"""Model FLOPs per trained token and the peak throughput of named chips, for MFU.

MFU (model FLOPs utilization, Chowdhery et al. 2022, "PaLM", Sec. 4.1 and Appendix B) is the
model's FLOPs per token times the tokens trained per second, divided by the chip's peak: it
counts what the model needs, not what the program executes (rematerialisation, padding rows and
chunked-logit recomputation are not credited), so it is comparable across implementations.
"""

from __future__ import annotations

from rlax_pipe.config import ModelConfig

# Dense (no structured sparsity) peak matmul throughput per chip, TFLOP/s, in bfloat16, keyed by
# a substring of `jax.Device.device_kind`. Sources: the vendors' data sheets (NVIDIA quotes
# "with sparsity" figures; the dense rate is half of them).
PEAK_TFLOPS_BF16: dict[str, tuple[float, str]] = {
    "H200": (989.5, "NVIDIA H200 Tensor Core GPU datasheet (2024): BF16 1,979 TFLOPS with "
                    "sparsity (SXM), dense = half"),
    "H100": (989.5, "NVIDIA H100 Tensor Core GPU datasheet (2023): BF16 1,979 TFLOPS with "
                    "sparsity (SXM), dense = half"),
    "A100": (312.0, "NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TFLOPS dense"),
    "L4": (121.0, "NVIDIA L4 Tensor Core GPU datasheet (2023): BF16 242 TFLOPS with sparsity, "
                  "dense = half"),
    "TPU v6 lite": (918.0, "Google Cloud TPU v6e documentation: 918 TFLOPS bf16 per chip"),
    "TPU v5 lite": (197.0, "Google Cloud TPU v5e documentation: 197 TFLOPS bf16 per chip"),
    "TPU v5p": (459.0, "Google Cloud TPU v5p documentation: 459 TFLOPS bf16 per chip"),
    "TPU v4": (275.0, "Google Cloud TPU v4 documentation: 275 TFLOPS bf16 per chip"),
}


def matmul_params(cfg: ModelConfig) -> int:
  """N: parameters that take part in a matmul per token (attention and MLP projections of every
  layer, plus the output projection E x V, counted once even when tied to the embedding). The
  embedding lookup and norm scales do no multiply-adds and are left out."""
  e, h, k, d, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  per_layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f
  return cfg.n_layers * per_layer + e * cfg.vocab_size


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
  """(dense bf16 peak TFLOP/s, source) of a chip named by `jax.Device.device_kind`, or (None,
  reason) when the table does not know it (pass the peak explicitly then)."""
  for key, (value, source) in PEAK_TFLOPS_BF16.items():
    if key.lower() in device_kind.lower():
      return value, source
  return None, (f"device kind {device_kind!r} is not in PEAK_TFLOPS_BF16 "
                f"({sorted(PEAK_TFLOPS_BF16)}); pass its peak explicitly (--peak_tflops)")
