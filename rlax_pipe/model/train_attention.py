"""Fused (flash) attention for the training forward: JAX's Pallas kernels behind one call.

The learner's default training attention (`transformer.blockwise_attention`) is unfused: every
block of queries writes its fp32 scores and probabilities to memory and reads them back (on a
TPU-compiled Qwen3-0.6B step, at least 0.7 TB of the ~1.1-1.35 TB moved per micro-batch;
issue #28). A flash kernel (Dao et al. 2022, "FlashAttention", Algorithm 1: online softmax over
key blocks, probabilities recomputed from the saved log-sum-exp in the backward pass) keeps
them in on-chip memory. This module wraps JAX's own kernels, it does not write one:

- "pallas_tpu": `jax.experimental.pallas.ops.tpu.flash_attention` (Mosaic), [B, H, T, D];
- "pallas_gpu": `jax.experimental.pallas.ops.gpu.attention.mha` (Triton), [B, T, H, D];
- "pallas_tpu_interpret" / "pallas_gpu_interpret": the same kernels run by the Pallas
  interpreter (any backend, slow: for checking the numerics on CPU).

Both kernels take the packed segment ids and the causal flag the learner uses: query t attends
to key s iff s <= t and segment[t] == segment[s] (padding, segment 0, attends to padding only,
with keys and values zeroed as in `blockwise_attention`, so the outputs equal blockwise's).
Grouped-query attention: the K kv heads are repeated to the H query heads (head h reads kv head
h // G, G = H / K, as `kv_cache.gqa_attention`); the kernels need equal head counts.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

TRAIN_ATTENTION_IMPLS: tuple[str, ...] = ("blockwise", "flash", "auto")
KERNELS: tuple[str, ...] = ("blockwise", "pallas_tpu", "pallas_gpu", "pallas_tpu_interpret",
                            "pallas_gpu_interpret")
_TPU_LANES = 128  # the TPU kernel's sequence blocks are multiples of the 128-lane vreg width
_GPU_BLOCK = 64


def _kernel_blocks(kernel: str, seq_len: int, block_len: int | None) -> int | None:
  """The kernel's query / key block length for rows of `seq_len` tokens, None if none fits."""
  if kernel.startswith("pallas_tpu"):
    block = min(block_len or 512, seq_len)
    block -= block % _TPU_LANES
    return block if block >= _TPU_LANES and seq_len % block == 0 else None
  block = min(_GPU_BLOCK, seq_len)
  return block if seq_len % block == 0 else None


def resolve_train_attention(impl: str, platform: str, seq_len: int,
                            block_len: int | None = 512) -> str:
  """The kernel (one of KERNELS) that `LearnerConfig.attention_impl` means on `platform`.

  "blockwise" -> "blockwise" everywhere. "flash" -> "pallas_tpu" on TPU, "pallas_gpu" on GPU,
  "pallas_tpu_interpret" elsewhere (CPU: the TPU kernel interpreted, correct but slow, for
  checks). "auto" -> the platform's flash kernel on TPU / GPU when `seq_len` fits its blocks,
  else "blockwise" (always on CPU).

  Args:
    impl: one of TRAIN_ATTENTION_IMPLS.
    platform: the learner mesh's device platform ("tpu", "gpu"/"cuda"/"rocm", "cpu").
    seq_len: T, tokens per packed row.
    block_len: `LearnerConfig.attention_block_len` (the TPU kernel's block length, rounded down
      to a multiple of 128; None = 512).

  Raises:
    ValueError: on an unknown impl, or "flash" with a row length the kernel cannot block
      (the TPU kernel needs T a multiple of a block of >= 128 tokens; the GPU one of 64).
  """
  if impl not in TRAIN_ATTENTION_IMPLS:
    raise ValueError(f"LearnerConfig.attention_impl={impl!r}; choose one of "
                     f"{TRAIN_ATTENTION_IMPLS}.")
  if impl == "blockwise":
    return "blockwise"
  gpu = platform in ("gpu", "cuda", "rocm")
  kernel = "pallas_tpu" if platform == "tpu" else "pallas_gpu" if gpu else "pallas_tpu_interpret"
  if impl == "auto" and kernel == "pallas_tpu_interpret":
    return "blockwise"
  if _kernel_blocks(kernel, seq_len, block_len) is None:
    if impl == "auto":
      return "blockwise"
    raise ValueError(
        f"--config.learner.attention_impl='flash': kernel {kernel} cannot block rows of "
        f"{seq_len} tokens (TPU: a multiple of a block of >= 128 tokens, "
        f"attention_block_len={block_len}; GPU: a multiple of {_GPU_BLOCK}); pad the rows "
        "(pipeline seq_len) to such a length or use attention_impl='auto' / 'blockwise'.")
  return kernel


def flash_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array,
                    segment_ids_BT: jax.Array, kernel: str,
                    block_len: int | None = 512) -> jax.Array:
  """Causal attention within equal segment ids by a fused Pallas kernel (differentiable).

  out[b, t, h] = sum_s softmax_s(q[b,t,h] . k[b,s,h // G] / sqrt(D) | s <= t, seg[s] = seg[t])
  v[b,s,h // G] (Vaswani et al. 2017 eq. 1; GQA, Ainslie et al. 2023), computed tile by tile
  with an online softmax (Dao et al. 2022, Algorithm 1); scores stay in fp32 inside the kernel.

  Args:
    q_BTHD: [B, T, H, D] queries; k_BTKD, v_BTKD: [B, T, K, D] keys and values, H % K == 0.
    segment_ids_BT: int32 [B, T] packing ids (0 = padding).
    kernel: one of KERNELS other than "blockwise".
    block_len: the TPU kernel's block length (rounded down to a multiple of 128; None = 512).

  Returns:
    [B, T, H, D] in q's dtype.

  Raises:
    ValueError: on an unknown kernel, shape mismatch, or a T the kernel cannot block.
  """
  if kernel not in KERNELS or kernel == "blockwise":
    raise ValueError(f"flash_attention kernel {kernel!r}; choose one of {KERNELS[1:]}.")
  b, t, h, d = q_BTHD.shape
  kv = k_BTKD.shape[2]
  if k_BTKD.shape != (b, t, kv, d) or v_BTKD.shape != k_BTKD.shape or h % kv:
    raise ValueError(f"flash_attention expects q [B,T,H,D], k/v [B,T,K,D] with H % K == 0; "
                     f"got {q_BTHD.shape}, {k_BTKD.shape}, {v_BTKD.shape}.")
  block = _kernel_blocks(kernel, t, block_len)
  if block is None:
    raise ValueError(f"flash_attention kernel {kernel}: T={t} is not a multiple of a usable "
                     f"block (block_len={block_len}).")
  real = (segment_ids_BT > 0)[:, :, None, None]
  k = jnp.repeat(jnp.where(real, k_BTKD, jnp.zeros((), k_BTKD.dtype)), h // kv, axis=2)
  v = jnp.repeat(jnp.where(real, v_BTKD, jnp.zeros((), v_BTKD.dtype)), h // kv, axis=2)
  seg = segment_ids_BT.astype(jnp.int32)
  scale = float(d) ** -0.5
  interpret = kernel.endswith("_interpret")
  if kernel.startswith("pallas_tpu"):
    out = _tpu_flash(q_BTHD, k, v, seg, scale, block, interpret)
  else:
    out = _gpu_flash(q_BTHD, k, v, seg, scale, block, interpret)
  return out.astype(q_BTHD.dtype)


def _tpu_flash(q, k, v, seg, scale, block, interpret):
  """JAX's TPU flash kernel on [B, T, H, D] inputs (it wants [B, H, T, D])."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_fa  # pylint: disable=g-import-not-at-top
  sizes = tpu_fa.BlockSizes(
      block_q=block, block_k_major=block, block_k=block, block_b=1,
      block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block,
      block_k_major_dq=block, block_k_dq=block, block_q_dq=block)
  tr = lambda x: jnp.swapaxes(x, 1, 2)

  def call(q, k, v):
    return tr(tpu_fa.flash_attention(tr(q), tr(k), tr(v), segment_ids=tpu_fa.SegmentIds(seg, seg),
                                     causal=True, sm_scale=scale, block_sizes=sizes))
  if not interpret:
    return call(q, k, v)
  # The interpreter is chosen when a pallas_call is traced, and the kernel's backward is traced
  # when the caller's gradient is: both are traced here, under the interpret-mode context.
  @jax.custom_vjp
  def interpreted(q, k, v):
    with pltpu.force_tpu_interpret_mode():
      return call(q, k, v)

  def fwd(q, k, v):
    return interpreted(q, k, v), (q, k, v)

  def bwd(res, g):
    with pltpu.force_tpu_interpret_mode():
      _, pull = jax.vjp(call, *res)
      return pull(g)
  interpreted.defvjp(fwd, bwd)
  return interpreted(q, k, v)


def _gpu_flash(q, k, v, seg, scale, block, interpret):
  """JAX's GPU (Triton) flash kernel, [B, T, H, D] in and out."""
  from jax.experimental.pallas.ops.gpu import attention as gpu_fa  # pylint: disable=g-import-not-at-top
  sizes = gpu_fa.BlockSizes(block_q=block, block_k=block, block_q_dkv=block,
                            block_kv_dkv=block, block_q_dq=block, block_kv_dq=block)
  return gpu_fa.mha(q, k, v, seg, sm_scale=scale, causal=True, block_sizes=sizes,
                    interpret=interpret)


def sharded_flash_attention(kernel: str, block_len: int | None, mesh: Any,
                            rules: Any = None) -> Callable[..., jax.Array]:
  """`flash_attention` run per device of `mesh` (`jax.shard_map`), for the sharded learner.

  A Pallas kernel is an opaque custom call to XLA's partitioner: under `jit` with sharded
  inputs it would be given the whole arrays (an all-gather of every activation). Here each
  device runs the kernel on its own rows (the batch dim split as `rules["batch"]`, the learner's
  data x fsdp) and, when both the query and the kv head counts divide it, its own heads
  (`rules["heads"]`, tp); attention never mixes rows or heads, so no collective is needed.

  Args:
    kernel: a fused kernel of KERNELS (not "blockwise").
    block_len: as in `flash_attention`.
    mesh: the learner mesh.
    rules: the compute rules table (default `sharding.LEARNER_COMPUTE_RULES`).

  Returns:
    attend(q_BTHD, k_BTKD, v_BTKD, segment_ids_BT) -> [B, T, H, D], as `flash_attention`.
  """
  from rlax_pipe import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  rules = sharding_lib.LEARNER_COMPUTE_RULES if rules is None else rules

  def attend(q, k, v, seg):
    b, _, h, _ = q.shape
    kv = k.shape[2]
    batch = sharding_lib.logical_to_spec(("batch",), (b,), mesh, rules)[0]
    heads = sharding_lib.logical_to_spec(("heads",), (h,), mesh, rules)[0]
    kv_heads = sharding_lib.logical_to_spec(("kv_heads",), (kv,), mesh, rules)[0]
    if heads != kv_heads:  # a head split that does not divide both: keep heads whole
      heads = None
    qs, kvs, ss = P(batch, None, heads, None), P(batch, None, heads, None), P(batch, None)
    fn = lambda q, k, v, s: flash_attention(q, k, v, s, kernel, block_len)
    return jax.shard_map(fn, mesh=mesh, in_specs=(qs, kvs, kvs, ss), out_specs=qs,
                         check_vma=False)(q, k, v, seg)
  return attend
