"""Learner configuration: `LearnerConfig` (mesh, accumulation, faults) with `OptimizerConfig` and
`CheckpointConfig` sub-configs, each component receiving only its slice."""

from __future__ import annotations

import dataclasses
import math

from rlax_pipe.config import LoraConfig
from rlax_pipe.model.train_attention import TRAIN_ATTENTION_IMPLS

SCHEDULES: tuple[str, ...] = ("constant", "cosine")
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots_saveable")
# Mesh axes that split batch rows (data parallelism); weights are split over fsdp only.
BATCH_MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer: global-norm clipping, then AdamW with a warmup + constant / cosine schedule.

  Attributes:
    learning_rate: peak learning rate (per optimizer step, > 0).
    warmup_steps: linear warmup length in optimizer steps (>= 0); the learning rate of applied
      step s (0-based) is peak * min(1, (s + 1) / warmup_steps), so the first step is not wasted
      with a zero rate. 0 = no warmup.
    schedule: after warmup, "constant" (stay at peak) or "cosine" (half-cosine from peak to
      peak * min_lr_ratio at step decay_steps, then constant).
    decay_steps: optimizer step at which the cosine reaches its floor (> warmup_steps);
      only used (and required) with schedule="cosine".
    min_lr_ratio: cosine floor as a fraction of the peak, in [0, 1].
    adam_b1: AdamW first-moment decay, in [0, 1).
    adam_b2: AdamW second-moment decay, in [0, 1).
    adam_eps: AdamW epsilon added to sqrt(second moment) (gradient units, > 0).
    weight_decay: decoupled weight decay coefficient (>= 0; applied to matrices and the
      embedding, not to norm scales or biases), scaled by the learning rate as in AdamW.
    max_grad_norm: clip the gradient to this global L2 norm before AdamW (> 0); None = off.
  """

  learning_rate: float = 3e-5
  warmup_steps: int = 2
  schedule: str = "constant"
  decay_steps: int | None = None
  min_lr_ratio: float = 0.0
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  adam_eps: float = 1e-8
  weight_decay: float = 0.0
  max_grad_norm: float | None = 1.0

  def __post_init__(self):
    if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
      raise ValueError(f"OptimizerConfig.learning_rate={self.learning_rate} must be finite, > 0.")
    if self.warmup_steps < 0:
      raise ValueError(f"OptimizerConfig.warmup_steps={self.warmup_steps} must be >= 0.")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"OptimizerConfig.schedule={self.schedule!r}; choose one of {SCHEDULES}.")
    if self.schedule == "cosine":
      if self.decay_steps is None or self.decay_steps <= self.warmup_steps:
        raise ValueError(
            f"OptimizerConfig.decay_steps={self.decay_steps} must be > warmup_steps="
            f"{self.warmup_steps} with schedule='cosine'.")
    elif self.decay_steps is not None:
      raise ValueError(
          f"OptimizerConfig.decay_steps={self.decay_steps} is only used with schedule='cosine' "
          f"(got schedule={self.schedule!r}); set it to None.")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ValueError(f"OptimizerConfig.min_lr_ratio={self.min_lr_ratio} must be in [0, 1].")
    for name in ("adam_b1", "adam_b2"):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f"OptimizerConfig.{name}={getattr(self, name)} must be in [0, 1).")
    if not self.adam_eps > 0:
      raise ValueError(f"OptimizerConfig.adam_eps={self.adam_eps} must be > 0.")
    if not self.weight_decay >= 0:
      raise ValueError(f"OptimizerConfig.weight_decay={self.weight_decay} must be >= 0.")
    if self.max_grad_norm is not None and not self.max_grad_norm > 0:
      raise ValueError(f"OptimizerConfig.max_grad_norm={self.max_grad_norm} must be > 0 or None.")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints of the learner state.

  Attributes:
    directory: where checkpoints go; None = no checkpointing (the RL job sets run_dir/checkpoints).
    keep: keep the newest N checkpoints (>= 1); older ones are deleted.
    async_save: write checkpoints in a background thread (the device-to-host copy happens before
      `save` returns, so the state can be donated right after).
  """

  directory: str | None = None
  keep: int = 3
  async_save: bool = True

  def __post_init__(self):
    if self.keep < 1:
      raise ValueError(f"CheckpointConfig.keep={self.keep} must be >= 1.")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """How the learner trains (static; hashable). Optimizer and checkpoints are sub-configs.

  Attributes:
    mesh_axes: ordered (mesh axis, size) pairs of the learner mesh, major axis first, among
      "data", "fsdp", "expert", "tp" ("expert" splits MoE experts and, elsewhere, acts as one
      more fsdp axis: `sharding.LEARNER_RULES`); the product is the number of learner devices, e.g.
      (("fsdp", 2), ("tp", 2)) for 4 devices. Default: 1 x 1 (a single device). () means "chosen
      by the RL job from the devices present" (`rlax_pipe.pipeline.devices`); a `Learner` needs
      explicit axes.
    optimizer: clipping, AdamW and the learning-rate schedule (`OptimizerConfig`).
    checkpoint: where and how the learner state is checkpointed (`CheckpointConfig`).
    micro_batch_rows: R >= 1, rows of every micro-batch (the fixed token budget R x L of one
      compiled forward/backward). A batch of any B rows is split into ceil(B / R) micro-batches
      per minibatch (the last padded with empty rows) whose gradients are accumulated by one
      compiled program, so batches of any size reuse the same executables (zero recompiles).
      Must be a multiple of the batch-splitting mesh axes' product (data x fsdp x expert).
    num_minibatches: m >= 1 optimizer updates per learner batch (PPO-style epochs of one pass):
      row r goes to minibatch r mod m. The behaviour log-probs stay the sampler's; the proximal
      log-probs (decoupled PPO) are those of the params before the batch's first update; the
      policy version advances once per batch, whatever m. m > 1 costs one extra forward pass
      over minibatches 1..m-1 (their proximal log-probs, before any update).
    logits_chunk_len: positions per chunk of the LM head and log-prob computation, processed
      with rematerialisation so no [R, L, V] fp32 logits are held (>= 1); None = full logits
      at once (the naive computation, for comparison).
    attention_block_len: queries per attention block in the training forward (the fp32
      scores of one block, [rows, heads, block, L], are the largest attention temporary instead
      of [rows, heads, L, L]; `transformer.blockwise_attention`), >= 1; None = dense. With a
      flash kernel it is the TPU kernel's query/key block (rounded down to a multiple of 128).
    attention_impl: training attention, one of TRAIN_ATTENTION_IMPLS: "blockwise" (default;
      `transformer.blockwise_attention`, fp32 scores of one block in memory), "flash" (JAX's
      Pallas flash-attention kernel: TPU (Mosaic) or GPU (Triton) by the learner mesh's
      platform, the TPU kernel interpreted on CPU (slow, for checks); same outputs, scores and
      probabilities never leave the chip's fast memory; rows must be a multiple of the kernel
      block), "auto" (flash on TPU / GPU when the row length fits the kernel, else blockwise).
    remat: transformer-block rematerialisation policy, one of REMAT_POLICIES: "none" (keep all
      activations), "full" (recompute each block in the backward pass: least memory, ~1/3 more
      compute), "dots_saveable" (keep matmul outputs, recompute elementwise ops). True / False
      are accepted as "full" / "none".
    max_consecutive_nonfinite: after this many consecutive optimizer steps with a non-finite
      loss or gradient (each one skipped), the learner saves a checkpoint (if it has a
      checkpoint directory) and raises `NonFiniteError`. >= 1.
    seed: seed of the learner's PRNG key and of a random params init (carried in the train
      state and checkpointed).
    compiler_options: extra XLA compiler options for the jitted init and train step, as
      (name, value) pairs, e.g. (("xla_backend_optimization_level", 0),) compiles about 3x
      faster on CPU (tests) at some runtime cost. Default () = XLA defaults.
    lora: low-rank adapters (`LoraConfig`: rank, alpha, target_modules). rank 0 (default) =
      full fine-tuning; rank >= 1 trains only the adapters (base frozen, optimizer state for the
      adapters only), checkpoints hold the adapters, and the weight channel pushes only the
      adapters (the sampler merges them into its copy of the base).
  """

  mesh_axes: tuple[tuple[str, int], ...] = (("fsdp", 1), ("tp", 1))
  optimizer: OptimizerConfig = OptimizerConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  micro_batch_rows: int = 16
  num_minibatches: int = 1
  logits_chunk_len: int | None = 256
  attention_block_len: int | None = 512
  attention_impl: str = "blockwise"
  remat: str = "none"
  max_consecutive_nonfinite: int = 3
  seed: int = 0
  compiler_options: tuple[tuple[str, str | int | float | bool], ...] = ()
  lora: LoraConfig = LoraConfig()

  def __post_init__(self):
    if self.mesh_axes != () and not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], int)
        and p[1] >= 1 for p in self.mesh_axes):
      raise ValueError(
          f"LearnerConfig.mesh_axes={self.mesh_axes!r} must be a tuple of (axis name, size >= 1) "
          "pairs, e.g. (('fsdp', 2), ('tp', 2)), or () for the RL job's choice.")
    if len({name for name, _ in self.mesh_axes}) != len(self.mesh_axes):
      raise ValueError(f"LearnerConfig.mesh_axes={self.mesh_axes!r} repeats an axis name.")
    self._validate_accumulation()
    if self.max_consecutive_nonfinite < 1:
      raise ValueError(
          f"LearnerConfig.max_consecutive_nonfinite={self.max_consecutive_nonfinite} must be "
          ">= 1.")
    if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
               for p in self.compiler_options):
      raise ValueError(f"LearnerConfig.compiler_options={self.compiler_options!r} must be a "
                       "tuple of (option name, value) pairs.")
    if not isinstance(self.lora, LoraConfig):
      raise TypeError(f"LearnerConfig.lora must be a LoraConfig; got {type(self.lora).__name__}.")

  def _validate_accumulation(self):
    """Checks micro-batch rows against the batch axes, minibatches, chunking and remat."""
    if isinstance(self.remat, bool):  # the old boolean spelling
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"LearnerConfig.remat={self.remat!r}; choose one of {REMAT_POLICIES}.")
    if self.micro_batch_rows < 1:
      raise ValueError(f"LearnerConfig.micro_batch_rows={self.micro_batch_rows} must be >= 1.")
    split = self.batch_shards
    expert = " x expert" if "expert" in self.mesh_shape else ""
    if self.micro_batch_rows % split:
      raise ValueError(
          f"LearnerConfig.micro_batch_rows={self.micro_batch_rows} must be a multiple of the "
          f"batch-splitting mesh axes (data x fsdp{expert} = {split} in mesh_axes="
          f"{self.mesh_axes}) so "
          "every device holds an equal share of each micro-batch; round it up to a multiple "
          f"of {split}.")
    if self.num_minibatches < 1:
      raise ValueError(f"LearnerConfig.num_minibatches={self.num_minibatches} must be >= 1.")
    if self.attention_impl not in TRAIN_ATTENTION_IMPLS:
      raise ValueError(f"--config.learner.attention_impl={self.attention_impl!r}; choose one of "
                       f"{TRAIN_ATTENTION_IMPLS}.")
    for name in ("logits_chunk_len", "attention_block_len"):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise ValueError(f"LearnerConfig.{name}={value} must be >= 1 or None (no chunking).")

  @property
  def batch_shards(self) -> int:
    """Number of devices batch rows are split over (product of the data, fsdp and expert
    axes)."""
    return math.prod(size for name, size in self.mesh_axes if name in BATCH_MESH_AXES)

  @property
  def mesh_shape(self) -> dict[str, int]:
    """The mesh axes as an ordered dict {name: size}."""
    return dict(self.mesh_axes)

  @property
  def num_devices(self) -> int:
    """Number of devices the learner mesh needs (product of the axis sizes)."""
    return math.prod(size for _, size in self.mesh_axes)

  def step_slice(self) -> "LearnerConfig":
    """This config with the fields the compiled step does not read reset to their defaults.

    Two learners whose `step_slice()` are equal (and with equal model / objective / sampling
    configs and mesh) run the same compiled program, so it can be shared.
    """
    host_only = ("max_consecutive_nonfinite", "checkpoint", "seed")
    defaults = {f.name: f.default for f in dataclasses.fields(LearnerConfig)}
    return dataclasses.replace(self, **{name: defaults[name] for name in host_only})
