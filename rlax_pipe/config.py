"""Frozen configuration dataclasses, one per component. No flag reading here.

Each component receives only its own slice. Fields are documented where declared, with units and
valid ranges, and validated once in `__post_init__`.
"""

from __future__ import annotations

import dataclasses

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer of the Llama-3 / Qwen2 / Qwen3 family.

  Attributes:
    vocab_size: number of token ids (>= 2).
    d_model: residual width E (>= 1).
    n_layers: number of transformer blocks (>= 1).
    n_heads: query heads H (>= 1).
    n_kv_heads: key/value heads K for grouped-query attention; must divide n_heads.
    head_dim: per-head width D (even, for rotary embeddings).
    d_ff: SwiGLU hidden width F.
    rope_theta: rotary embedding base (Llama-3 uses 500000, Qwen 1e6, tiny defaults 10000).
    rms_eps: epsilon inside RMSNorm.
    qkv_bias: add biases to the q/k/v projections (Qwen2).
    qk_norm: RMSNorm over head_dim on q and k before RoPE (Qwen3).
    tie_embeddings: use the token embedding as the output projection.
    param_dtype: dtype in which parameters are stored ("float32", "bfloat16", "float16").
    compute_dtype: dtype of activations and matmuls; logits are always float32.
    max_seq_len: longest sequence (tokens, prompt + completion) the model will be asked to run.
  """

  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 384
  rope_theta: float = 10000.0
  rms_eps: float = 1e-6
  qkv_bias: bool = False
  qk_norm: bool = False
  tie_embeddings: bool = True
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  max_seq_len: int = 512

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff", "max_seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be >= 1.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads={self.n_heads} is not a multiple of n_kv_heads="
          f"{self.n_kv_heads}; grouped-query attention needs n_heads % n_kv_heads == 0.")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE.")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; choose one of {DTYPES}.")
    if self.rope_theta <= 0 or self.rms_eps <= 0:
      raise ValueError("ModelConfig.rope_theta and rms_eps must be > 0.")
