"""Frozen configuration dataclasses, one per component. No flag reading here.

Each component receives only its own slice. Fields are documented where declared, with units and
valid ranges, and validated once in `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import math

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
ROPE_TYPES: tuple[str, ...] = ("linear", "llama3", "yarn")
ROUTER_SOFTMAX: tuple[str, ...] = ("all", "topk")  # `model.moe.route`


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A RoPE context-extension scaling (static, hashable); formulas in `model.rope`.

  Attributes:
    rope_type: one of ROPE_TYPES.
    factor: context extension factor f (> 0; > 1 extends).
    original_max_position_embeddings: pre-training context L0 (tokens; llama3 and yarn).
    low_freq_factor: llama3's a (> 0).
    high_freq_factor: llama3's b (> a).
    beta_fast: yarn's rotations bounding extrapolation (default 32).
    beta_slow: yarn's rotations bounding interpolation (default 1).
    attention_factor: yarn's cos / sin multiplier; None = derived from factor (and mscale).
    mscale: yarn's numerator coefficient of the derived attention factor (optional).
    mscale_all_dim: yarn's denominator coefficient (optional; with mscale).
    truncate: yarn rounds the correction range to whole dimensions (transformers' default).
  """

  rope_type: str
  factor: float
  original_max_position_embeddings: int | None = None
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"RopeScaling.rope_type={self.rope_type!r}; choose one of {ROPE_TYPES}.")
    if not (math.isfinite(self.factor) and self.factor > 0):
      raise ValueError(f"RopeScaling.factor={self.factor} must be finite and > 0.")
    if self.rope_type in ("llama3", "yarn") and not (
        isinstance(self.original_max_position_embeddings, int)
        and self.original_max_position_embeddings >= 1):
      raise ValueError(f"RopeScaling.original_max_position_embeddings="
                       f"{self.original_max_position_embeddings!r} must be an int >= 1 for "
                       f"rope_type={self.rope_type!r}.")
    if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ValueError(f"RopeScaling: need 0 < low_freq_factor ({self.low_freq_factor}) < "
                       f"high_freq_factor ({self.high_freq_factor}) for llama3.")




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
    rope_scaling: None (plain RoPE) or a `RopeScaling` (linear / llama3 / yarn context
      extension, as in Llama 3.1-3.3 and Qwen2.5 / Qwen3 configs).
    rms_eps: epsilon inside RMSNorm.
    qkv_bias: add biases to the q/k/v projections (Qwen2).
    qk_norm: RMSNorm over head_dim on q and k before RoPE (Qwen3).
    tie_embeddings: use the token embedding as the output projection.
    param_dtype: dtype in which parameters are stored ("float32", "bfloat16", "float16").
    compute_dtype: dtype of activations and matmuls; logits are always float32.
    max_seq_len: longest sequence (tokens, prompt + completion) the model will be asked to run.
    eos_token_ids: token ids that end a completion (any of them), e.g. from an HF checkpoint's
      config.json and generation_config.json; () = none declared here.
    n_experts: experts X per mixture-of-experts layer (`model.moe`); 0 = dense model (the
      default: every layer a SwiGLU MLP of width d_ff); >= 2 otherwise.
    n_experts_per_tok: experts k each token is routed to, 1 <= k <= n_experts (MoE only).
    moe_d_ff: hidden width F of each expert's SwiGLU MLP (>= 1; MoE only; Qwen3-MoE's
      moe_intermediate_size). Dense layers of a mixed model keep d_ff.
    router_softmax: "all" (softmax over all experts, then top-k: Qwen3-MoE) or "topk" (top-k
      logits, then softmax over those k: GPT-OSS).
    norm_topk_prob: with router_softmax="all", renormalise the k selected probabilities to sum
      to 1 (Qwen3-MoE's norm_topk_prob).
    router_bias: the router has a bias [X] (GPT-OSS).
    decoder_sparse_step: layer i is MoE iff (i + 1) % decoder_sparse_step == 0 and i is not in
      mlp_only_layers (Qwen3-MoE's rule; >= 1; 1 = every layer).
    mlp_only_layers: layer indices in [0, n_layers) that stay dense in an MoE model.
    router_aux_loss_coef: learner weight of the Switch load-balancing loss (>= 0; 0 = off;
      the loss is 1 at uniform routing; `model.moe.load_balance_loss`).
    router_z_loss_coef: learner weight of the router z-loss (>= 0; 0 = off; ST-MoE uses 1e-3;
      `model.moe.z_loss`).
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
  rope_scaling: RopeScaling | None = None
  eos_token_ids: tuple[int, ...] = ()
  n_experts: int = 0
  n_experts_per_tok: int = 2
  moe_d_ff: int = 256
  router_softmax: str = "all"
  norm_topk_prob: bool = True
  router_bias: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  router_aux_loss_coef: float = 0.0
  router_z_loss_coef: float = 0.0

  def __post_init__(self):
    if isinstance(self.mlp_only_layers, list):
      object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
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
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise TypeError(f"ModelConfig.rope_scaling must be a RopeScaling or None; got "
                      f"{type(self.rope_scaling).__name__}.")
    if not isinstance(self.eos_token_ids, tuple) or not all(
        isinstance(i, int) and 0 <= i < self.vocab_size for i in self.eos_token_ids):
      raise ValueError(f"ModelConfig.eos_token_ids={self.eos_token_ids!r} must be a tuple of "
                       f"token ids in [0, vocab_size={self.vocab_size}).")
    self._validate_moe()

  def _validate_moe(self):
    """Raises a ValueError naming the `--config.model.` field of an invalid MoE setting."""
    if not isinstance(self.n_experts, int) or self.n_experts < 0 or self.n_experts == 1:
      raise ValueError(f"--config.model.n_experts={self.n_experts!r} must be 0 (dense) or an "
                       "int >= 2.")
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"--config.model.{name}={value} must be finite and >= 0 (0 = off).")
    if self.router_softmax not in ROUTER_SOFTMAX:
      raise ValueError(f"--config.model.router_softmax={self.router_softmax!r}; choose one of "
                       f"{ROUTER_SOFTMAX}.")
    if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step < 1:
      raise ValueError(f"--config.model.decoder_sparse_step={self.decoder_sparse_step!r} must "
                       "be an int >= 1 (1 = every layer is MoE).")
    bad = [i for i in self.mlp_only_layers if not isinstance(i, int) or not
           0 <= i < self.n_layers]
    if bad or len(set(self.mlp_only_layers)) != len(self.mlp_only_layers):
      raise ValueError(f"--config.model.mlp_only_layers={self.mlp_only_layers!r} must be "
                       f"distinct layer indices in [0, n_layers={self.n_layers}).")
    if self.n_experts:
      if not isinstance(self.n_experts_per_tok, int) or not (
          1 <= self.n_experts_per_tok <= self.n_experts):
        raise ValueError(f"--config.model.n_experts_per_tok={self.n_experts_per_tok!r} must be "
                         f"in [1, n_experts={self.n_experts}].")
      if not isinstance(self.moe_d_ff, int) or self.moe_d_ff < 1:
        raise ValueError(f"--config.model.moe_d_ff={self.moe_d_ff!r} must be an int >= 1.")
      if not any(self.layer_is_moe):
        raise ValueError(f"--config.model.n_experts={self.n_experts} but no layer is MoE "
                         f"(decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers="
                         f"{self.mlp_only_layers}); set n_experts=0 for a dense model.")

  @property
  def layer_is_moe(self) -> tuple[bool, ...]:
    """Per layer, whether its feed-forward block is MoE (Qwen3-MoE's decoder_sparse_step and
    mlp_only_layers rule); all False for a dense model."""
    return tuple(self.n_experts > 0 and (i + 1) % self.decoder_sparse_step == 0
                 and i not in self.mlp_only_layers for i in range(self.n_layers))

  @property
  def n_moe_layers(self) -> int:
    """Number of MoE layers (L_moe, the third axis of router routes [B, T, L_moe, k])."""
    return sum(self.layer_is_moe)


# Weight matrices of the built-in model (`model.transformer`) that LoRA may adapt.
LORA_BUILTIN_TARGETS: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters (LoRA, Hu et al. 2021, eq. 3): W' = W + (alpha / rank) * B A.

  The learner trains only A [rank, in] and B [out, rank] of each targeted weight matrix; the
  base weights stay frozen (no gradient, no optimizer state). A starts uniform in
  +-1/sqrt(in) (PEFT's default, Kaiming-uniform with a = sqrt(5)) and B at zero, so the initial
  policy is exactly the base model.

  Attributes:
    rank: r, the adapters' inner width (>= 0; 0 = LoRA off: full fine-tuning, the default).
      Typical 8-64; must be <= the smallest input / output width of a targeted matrix.
    alpha: scale numerator (> 0): the update is scaled by alpha / rank (dimensionless); the
      common choice is alpha = 2 * rank or alpha = rank.
    target_modules: names of the weight matrices to adapt, matched against any key of a
      parameter's path (the built-in model's names: wq, wk, wv, wo, w_gate, w_up, w_down; for an
      NNX model its module names, e.g. "q_proj"). Only leaves with >= 2 axes besides a leading
      stacked "layers" axis are adapted; every name must match at least one.
  """

  rank: int = 0
  alpha: float = 16.0
  target_modules: tuple[str, ...] = LORA_BUILTIN_TARGETS

  def __post_init__(self):
    if isinstance(self.target_modules, list):
      object.__setattr__(self, "target_modules", tuple(self.target_modules))
    if not isinstance(self.rank, int) or self.rank < 0:
      raise ValueError(f"LoraConfig.rank={self.rank!r} must be an int >= 0 (0 = LoRA off).")
    if not (math.isfinite(self.alpha) and self.alpha > 0):
      raise ValueError(f"LoraConfig.alpha={self.alpha} must be finite and > 0.")
    if not self.target_modules or not all(isinstance(t, str) and t
                                          for t in self.target_modules):
      raise ValueError(f"LoraConfig.target_modules={self.target_modules!r} must be a non-empty "
                       "tuple of parameter names, e.g. ('wq', 'wv').")

  @property
  def enabled(self) -> bool:
    """Whether LoRA is on (rank > 0)."""
    return self.rank > 0

  @property
  def scale(self) -> float:
    """alpha / rank, the factor of B A in W' = W + scale * B A (only meaningful when enabled)."""
    return self.alpha / max(self.rank, 1)
