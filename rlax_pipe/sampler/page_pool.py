"""The device-side KV page pool: layout, sharding, in-place writes, page reads and page copies.

The pool holds, for every layer, P pages of S tokens. Layers are folded into the page axis
(page p of layer l is pool page `l * P + p`), so one array serves every layer and a kernel can
be handed the whole pool (no per-layer slice, which XLA would copy) with block tables offset by
`l * P`. Two layouts, chosen by the attention implementation:

- "split" (reference, pallas_gpu, pallas_tpu): keys and values in two arrays [K, L*P, S, D]
  (kv heads first), the page layout of JAX's Pallas paged decode kernels (GPU and TPU).
- "combined" (pallas_tpu_ragged): one array [L*P, S, 2K, D] with key head k at index 2k and value
  head k at 2k + 1, the layout of JAX's TPU ragged paged attention.

Writes scatter only the tokens of a step (`write`), reads gather only the pages of a chunk
(`read_chunk`), and `copy_pages` copies whole pages across all layers: with the pool donated and
carried through the layer and decode loops, XLA updates it in place, so a step's cost and
temporary memory do not depend on the pool size (checked on the compiled program in tests and in
`experiments/bench_sampler.py --suite=scaling`).

Storage as bits: XLA:CPU upcasts bfloat16 gathers and scatters to float32, converting the WHOLE
pool to f32 and back around every write and read (a bf16 decode step then cost ~9x more with a
16x larger pool; issue #28). A bf16 pool on a CPU mesh is therefore stored as uint16 (its bits,
`PoolLayout.bits`): writes bitcast the new tokens, reads bitcast the gathered pages, both small.
The TPU compiler scatters and gathers bf16 natively (checked on the TPU-compiled program), so
accelerator pools keep their float dtype, which the Pallas kernels need.

Sharding: the pool names logical axes only; `rlax_pipe.sharding.CACHE_RULES` maps them to mesh
axes: only kv heads are split (over "tp", when divisible), because a block table indexes pages
of the whole pool. The sampler mesh's "data" axis means independent replicas, each with its own
pool on its own "tp" sub-mesh (`rlax_pipe.sharding.replica_meshes`).

Letters: L layers, K kv heads, P pages per layer, S page size, D head dim, B rows, T tokens per
row, C pages per chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
import numpy as np

from rlax_pipe import sharding as sharding_lib
from rlax_pipe.model import Model
from rlax_pipe.sampler.config import SamplerConfig
from rlax_pipe.sharding import replicated  # pylint: disable=unused-import (re-exported)

# Logical axes of each layout's arrays (layers are folded into the page axis).
SPLIT_AXES: tuple[str, ...] = (sharding_lib.KV_HEADS, sharding_lib.PAGES, sharding_lib.PAGE_SIZE,
                               sharding_lib.HEAD_DIM)
COMBINED_AXES: tuple[str, ...] = (sharding_lib.PAGES, sharding_lib.PAGE_SIZE,
                                  sharding_lib.KV_HEADS, sharding_lib.HEAD_DIM)


def default_mesh() -> Mesh:
  """A one-device sampler mesh (first default device) with a single "tp" axis of size 1."""
  return sharding_lib.make_mesh(jax.devices()[:1], {sharding_lib.TP: 1})


@dataclasses.dataclass(frozen=True)
class PoolLayout:
  """Shape and layout of one replica's pool (hashable: a static argument of jitted steps).

  Attributes:
    num_layers, num_kv_heads, num_pages, page_size, head_dim: L, K, P, S, D.
    dtype: element dtype name (the values' dtype).
    combined: True = one [L*P, S, 2K, D] array (ragged TPU kernel); False = k and v arrays
      [K, L*P, S, D].
    bits: store the arrays as unsigned integers of the dtype's width (`storage_dtype`); set for
      bfloat16 on CPU by `of` (see the module docstring).
  """

  num_layers: int
  num_kv_heads: int
  num_pages: int
  page_size: int
  head_dim: int
  dtype: str = "float32"
  combined: bool = False
  bits: bool = False

  @classmethod
  def of(cls, model: Model, cfg: SamplerConfig, combined: bool = False,
         platform: str | None = None) -> PoolLayout:
    """The layout of `cfg`'s pool for `model` (its KV geometry: layers, kv heads, head dim) on
    a mesh of `platform` ("cpu", "gpu", "tpu"; it decides `bits`)."""
    return cls(model.n_layers, model.n_kv_heads, cfg.num_pages, cfg.page_size, model.head_dim,
               cfg.cache_dtype, combined, bits=needs_bits(cfg.cache_dtype, platform))

  @property
  def storage_dtype(self):
    """dtype of the pool arrays: `dtype`, or the unsigned integer of its width when `bits`."""
    if not self.bits:
      return jnp.dtype(self.dtype)
    return jnp.dtype({1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(self.dtype).itemsize])

  def values(self, pools):
    """The pool arrays as `dtype` values (a bitcast when `bits`; it copies the pool on CPU,
    so only kernels, which never run natively on CPU, use it)."""
    if not self.bits:
      return tuple(pools)
    return tuple(jax.lax.bitcast_convert_type(p, jnp.dtype(self.dtype)) for p in pools)

  def _to_storage(self, x):
    x = x.astype(self.dtype)
    return jax.lax.bitcast_convert_type(x, self.storage_dtype) if self.bits else x

  def _to_values(self, x):
    return jax.lax.bitcast_convert_type(x, jnp.dtype(self.dtype)) if self.bits else x

  @property
  def total_pages(self) -> int:
    """L * P: pages of all layers."""
    return self.num_layers * self.num_pages

  @property
  def shapes(self) -> tuple[tuple[int, ...], ...]:
    """Shape of each pool array (one array when combined, else keys then values)."""
    l, k, s, d = self.total_pages, self.num_kv_heads, self.page_size, self.head_dim
    return ((l, s, 2 * k, d),) if self.combined else ((k, l, s, d), (k, l, s, d))

  @property
  def axes(self) -> tuple[str, ...]:
    """Logical axes of each pool array."""
    return COMBINED_AXES if self.combined else SPLIT_AXES

  @property
  def nbytes(self) -> int:
    """Bytes of the whole pool (keys + values, all layers)."""
    return sum(int(np.prod(s)) for s in self.shapes) * jnp.dtype(self.dtype).itemsize

  @property
  def bytes_per_token(self) -> int:
    """KV bytes of one token position over all layers (keys + values)."""
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * jnp.dtype(
        self.dtype).itemsize

  def sharding(self, mesh: Mesh) -> NamedSharding:
    """NamedSharding of each pool array on `mesh` (kv heads over tp when K divides evenly; in
    the combined layout a shard then holds whole key/value head pairs)."""
    shape = list(self.shapes[0])
    shape[self.axes.index(sharding_lib.KV_HEADS)] = self.num_kv_heads
    return NamedSharding(mesh, sharding_lib.logical_to_spec(
        self.axes, tuple(shape), mesh, sharding_lib.CACHE_RULES, canonical=True))

  # --- device ops (jit-traceable; `pools` is the tuple of pool arrays) ------------------------
  def write(self, pools, layer, k_BTKD, v_BTKD, pages_BT, offsets_BT, valid_BT):
    """Scatters the new tokens' keys and values of `layer` into their pages, in place.

    Args:
      pools: tuple of pool arrays.
      layer: int32 scalar layer index.
      k_BTKD, v_BTKD: [B, T, K, D] keys (RoPE applied) and values.
      pages_BT: int32 [B, T] page (of this layer, in [0, P)) of each token.
      offsets_BT: int32 [B, T] offset in its page.
      valid_BT: bool [B, T]; invalid tokens write nothing.

    Returns:
      The updated pools.
    """
    index = jnp.where(valid_BT, layer * self.num_pages + pages_BT, self.total_pages)
    if self.combined:
      b, t, k, d = k_BTKD.shape
      kv = jnp.stack([k_BTKD, v_BTKD], axis=3).reshape(b, t, 2 * k, d)
      return (pools[0].at[index, offsets_BT].set(self._to_storage(kv), mode="drop"),)
    # Every axis but D is a scatter index (kv head too, not a window): with K as a window the
    # TPU compiler kept the carried pool page-major and copied it to the kernels' K-major layout
    # in every layer (two whole-pool copies per layer per step, issue #28); indexed this way it
    # keeps [K, L*P, S, D] row-major, the layout of the Pallas kernels (0 copies, checked on
    # the TPU-compiled decode in tests/test_aot.py).
    k_pool, v_pool = pools
    heads = jnp.arange(self.num_kv_heads, dtype=jnp.int32)[:, None, None]  # [K, 1, 1]
    at = (heads, index[None], offsets_BT[None])
    k_new = self._to_storage(jnp.moveaxis(k_BTKD, 2, 0))  # [K, B, T, D]
    v_new = self._to_storage(jnp.moveaxis(v_BTKD, 2, 0))
    return (k_pool.at[at].set(k_new, mode="drop"), v_pool.at[at].set(v_new, mode="drop"))

  def read_chunk(self, pools, layer, pages_BC):
    """Keys and values of C pages per row of `layer`: ([K, B, C*S, D], [K, B, C*S, D]) in
    `dtype`."""
    index = layer * self.num_pages + pages_BC
    b, c = pages_BC.shape
    k, s, d = self.num_kv_heads, self.page_size, self.head_dim
    if self.combined:
      kv = self._to_values(pools[0][index])  # [B, C, S, 2K, D]
      kv = kv.reshape(b, c * s, k, 2, d)
      return (jnp.transpose(kv[..., 0, :], (2, 0, 1, 3)),
              jnp.transpose(kv[..., 1, :], (2, 0, 1, 3)))
    return tuple(self._to_values(p[:, index]).reshape(k, b, c * s, d) for p in pools)

  def copy_pages(self, pools, src_N, dst_N):
    """Copies pages src -> dst in every layer (dst = P or more: skipped). Returns the pools."""
    out = []
    for p in pools:
      if self.combined:
        view = p.reshape((self.num_layers, self.num_pages) + p.shape[1:])
        view = view.at[:, dst_N].set(view[:, jnp.clip(src_N, 0, self.num_pages - 1)], mode="drop")
      else:
        view = p.reshape((p.shape[0], self.num_layers, self.num_pages) + p.shape[2:])
        view = view.at[:, :, dst_N].set(view[:, :, jnp.clip(src_N, 0, self.num_pages - 1)],
                                        mode="drop")
      out.append(view.reshape(p.shape))
    return tuple(out)


def needs_bits(dtype: str, platform: str | None) -> bool:
  """Whether a pool of `dtype` on `platform` is stored as bits (bfloat16 on CPU, see above)."""
  return platform == "cpu" and jnp.dtype(dtype) == jnp.bfloat16


@functools.partial(jax.jit, static_argnames=("layout", "sharding"))
def _zero_pools(layout: PoolLayout, sharding):
  return tuple(jax.lax.with_sharding_constraint(jnp.zeros(s, layout.storage_dtype), sharding)
               for s in layout.shapes)


def init_pool(layout: PoolLayout, mesh: Mesh):
  """Allocates the zeroed pool arrays directly in their sharding (no reshard).

  Returns:
    Tuple of pool arrays (see `PoolLayout.shapes`) of `layout.storage_dtype`, sharded by `layout.sharding(mesh)`.
  """
  return _zero_pools(layout, layout.sharding(mesh))


@functools.partial(jax.jit, static_argnames=("layout", "sharding"), donate_argnums=(0,))
def copy_pages(pools, src_N, dst_N, *, layout: PoolLayout, sharding):
  """Jitted `PoolLayout.copy_pages` on donated pools (in place): copy-on-write of shared pages.

  Args:
    pools: tuple of pool arrays (donated).
    src_N, dst_N: int32 [N] page ids in [0, P); dst >= P marks padding (nothing copied).
    layout, sharding: static.

  Returns:
    The updated pools.
  """
  out = layout.copy_pages(pools, src_N, dst_N)
  return tuple(jax.lax.with_sharding_constraint(p, sharding) for p in out)
