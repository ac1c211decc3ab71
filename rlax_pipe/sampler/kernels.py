"""JAX's shipped Pallas paged-attention kernels behind the sampler's `attention_impl` switch.

- "pallas_gpu": `jax.experimental.pallas.ops.gpu.paged_attention` (decode; split-K over pages).
- "pallas_tpu": `jax.experimental.pallas.ops.tpu.paged_attention` (decode).
- "pallas_tpu_ragged": `jax.experimental.pallas.ops.tpu.ragged_paged_attention` (token-packed
  queries of any length per sequence: prefill and decode in one kernel; K/V-combined pool).

Every wrapper keeps the contract of `paged_attention.paged_attention_reference` (queries
[B, T, H, D], positions, valid flags, block tables of this layer) and hands the kernel the WHOLE
pool with block tables offset by `layer * P` (layers are folded into the page axis), so no layer
slice is copied. Each kernel skips pages past a sequence's length (work follows live pages).

On a multi-device sampler mesh the kernel runs under `jax.shard_map` over "tp": queries split by
head, the pool by kv head (a custom call cannot be partitioned by XLA); with kv heads not
divisible by tp the pool is replicated and each device computes all heads.

Masking note (issue #14 item 8): these kernels mask *scores* and then multiply probabilities by
values, so a NaN stored beyond a sequence's length inside its last compute block would reach the
output. The engine therefore zeroes every page it grants when a kernel is in use
(`replica.EngineReplica`); the reference selects stale values out instead.

Letters as in `paged_attention`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from rlax_pipe.sampler.page_pool import PoolLayout

KERNEL_IMPLS: tuple[str, ...] = ("pallas_gpu", "pallas_tpu", "pallas_tpu_ragged")
DECODE_ONLY: tuple[str, ...] = ("pallas_gpu", "pallas_tpu")


def _largest_divisor_at_most(n: int, cap: int) -> int:
  return max(i for i in range(1, min(n, cap) + 1) if n % i == 0)


def _lengths(positions_BT, valid_BT):
  """Per-row KV length for a decode query (position + 1); 1 for invalid rows (finite output)."""
  return jnp.where(valid_BT[:, 0], positions_BT[:, 0] + 1, 1).astype(jnp.int32)


def gpu_decode(q_BHD, k_pool, v_pool, tables_BW, lengths_B, *, interpret: bool = False):
  """JAX's Pallas GPU paged decode kernel on pre-scaled queries [B, H, D] (pool dtype).

  Split over pages (k_splits) and compute block are the largest divisors of W up to 16 and 8;
  on hardware Triton's dot needs head_dim and pages_per_compute_block * page_size >= 16.
  """
  from jax.experimental.pallas.ops.gpu import paged_attention as gpu_pa  # only this path needs it

  width = tables_BW.shape[1]
  k_splits = _largest_divisor_at_most(width, 16)
  per_block = _largest_divisor_at_most(width // k_splits, 8)
  return gpu_pa.paged_attention(q_BHD, k_pool, v_pool, tables_BW, lengths_B, k_splits=k_splits,
                                pages_per_compute_block=per_block, interpret=interpret)


def tpu_decode(q_BHD, k_pool, v_pool, tables_BW, lengths_B, *, interpret: bool = False):
  """JAX's Pallas TPU paged decode kernel (it computes in bf16 for bf16/f32 pools)."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_pa
  from jax.experimental.pallas import tpu as pltpu

  per_block = _largest_divisor_at_most(tables_BW.shape[1], 8)
  call = lambda: tpu_pa(q_BHD, k_pool, v_pool, lengths_B, tables_BW,
                        pages_per_compute_block=per_block)
  if interpret:
    with pltpu.force_tpu_interpret_mode():
      return call()
  return call()


def tpu_ragged(q_NHD, kv_pool, kv_lens_B, tables_BW, cu_q_lens, num_seqs, *, sm_scale: float,
               interpret: bool = False, kernel=None):
  """JAX's Pallas TPU ragged paged attention on token-packed queries [N, H, D].

  `kernel` replaces the Pallas kernel (same signature), e.g. by JAX's own
  `ref_ragged_paged_attention`, to test the packing on CPU where the interpreter fails.
  """
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
  from jax.experimental.pallas import tpu as pltpu

  fn = rpa.ragged_paged_attention if kernel is None else kernel
  blocks = {}
  if kernel is None and not interpret and jax.devices()[0].platform != "tpu":
    # A deviceless compile (rlax_pipe.aot): JAX's tuned-size lookup reads the TPU generation
    # from jax.devices()[0] (a CPU here) and raises; pass its own defaults for an untuned
    # shape explicitly (queries per block <= 32 as JAX's default).
    # 128 pages per block (JAX's default) overflowed VMEM at 8 kv heads x 128 x 16-token pages
    # (v5e compile: CompileTimeScopedVmemOom); blocks of <= 512 tokens compile.
    page_size = kv_pool.shape[1]
    blocks = dict(num_kv_pages_per_block=_largest_divisor_at_most(
        tables_BW.shape[1], max(1, 512 // page_size)),
                  num_queries_per_block=min(q_NHD.shape[0], 32))
  call = lambda: fn(q_NHD, kv_pool, kv_lens_B, tables_BW, cu_q_lens, num_seqs,
                    sm_scale=sm_scale, **blocks)
  if interpret and kernel is None:
    with pltpu.force_tpu_interpret_mode():
      return call()
  return call()


def _pack(q_BTHD, valid_BT):
  """Token-packs the valid queries of each row (rows with none get one dummy query).

  Returns:
    (q_NHD [B*T, H, D], cu [B + 1] int32, gather index [B, T] into the packed axis, n_B).
  """
  b, t = valid_BT.shape
  n_B = jnp.maximum(jnp.sum(valid_BT, axis=1), 1).astype(jnp.int32)
  cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(n_B).astype(jnp.int32)])
  r = jnp.arange(b * t, dtype=jnp.int32)
  row = jnp.clip(jnp.searchsorted(cu, r, side="right") - 1, 0, b - 1)
  col = jnp.clip(r - cu[row], 0, t - 1)
  q_NHD = q_BTHD[row, col]
  index_BT = cu[:-1, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  return q_NHD, cu, jnp.clip(index_BT, 0, b * t - 1), n_B


def attend(impl: str, q_BTHD, pools, layout: PoolLayout, layer, tables_BW, positions_BT,
           valid_BT, *, mesh: Mesh | None, interpret: bool = False, ragged_kernel=None):
  """Kernel attention with the reference's contract (see module docstring).

  Decode-only kernels need T == 1; "pallas_tpu_ragged" takes any T, where the valid queries of a
  row must be consecutive positions ending at the row's last valid position (prefill and decode
  rows as the engine builds them).

  Raises:
    ValueError: for an unknown impl, or T != 1 with a decode-only kernel.
  """
  if impl not in KERNEL_IMPLS:
    raise ValueError(f"unknown kernel impl {impl!r}; choose one of {KERNEL_IMPLS}.")
  b, t, h, d = q_BTHD.shape
  if impl in DECODE_ONLY and t != 1:
    raise ValueError(f"{impl} is decode-only (T == 1), got T = {t}.")
  pools = layout.values(pools)
  tables = (tables_BW + layer * layout.num_pages).astype(jnp.int32)
  scale = 1.0 / math.sqrt(d)
  pool_spec = layout.sharding(mesh).spec if mesh is not None else P()
  heads_split = any(e is not None for e in pool_spec)
  q_spec = P(None, "tp", None) if heads_split else P()

  if impl == "pallas_tpu_ragged":
    q_NHD, cu, index_BT, _ = _pack(q_BTHD, valid_BT)
    last = jnp.max(jnp.where(valid_BT, positions_BT, 0), axis=1)
    kv_lens = (last + 1).astype(jnp.int32)
    num_seqs = jnp.array([b], jnp.int32)
    fn = lambda q, kv, lens, tb, c, ns: tpu_ragged(q, kv, lens, tb, c, ns, sm_scale=scale,
                                                   interpret=interpret, kernel=ragged_kernel)
    args, specs = (q_NHD, pools[0], kv_lens, tables, cu, num_seqs), (
        q_spec, pool_spec, P(), P(), P(), P())
  else:
    q_BHD = (q_BTHD[:, 0].astype(jnp.float32) * scale).astype(pools[0].dtype)
    kernel = gpu_decode if impl == "pallas_gpu" else tpu_decode
    fn = lambda q, k, v, tb, lens: kernel(q, k, v, tb, lens, interpret=interpret)
    args, specs = (q_BHD, pools[0], pools[1], tables, _lengths(positions_BT, valid_BT)), (
        q_spec, pool_spec, pool_spec, P(), P())
  if mesh is not None and mesh.size > 1:
    fn = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)
  out = fn(*args)
  if impl == "pallas_tpu_ragged":
    out = out[index_BT]  # [B, T, H, D]
    return jnp.where(valid_BT[:, :, None, None], out, 0).astype(q_BTHD.dtype)
  return out.reshape(b, 1, h, d).astype(q_BTHD.dtype)
