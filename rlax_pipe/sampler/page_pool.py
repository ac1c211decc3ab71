"""The device-side KV page pool and its sharding on the sampler mesh.

Layout: keys and values are each one array [layers, K, P, S, D] (layers, kv heads, pages, page
size, head dim). Heads come before pages because that is the page layout both JAX Pallas paged
attention kernels (GPU and TPU: [K, P, S, D] per layer) read, so the accelerated path needs no
per-step transpose of the pool.

Sharding: the cache names logical axes only; `CACHE_RULES` maps them to sampler-mesh axes. Only
kv_heads is split (over "tp", when it divides evenly): a block table indexes pages of the whole
pool, so splitting pages over devices would turn every gather into a cross-device gather. A
data-parallel sampler runs one engine (one pool) per data replica instead.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
import numpy as np

from rlax_pipe.config import ModelConfig
from rlax_pipe.sampler.config import SamplerConfig

CACHE_AXES: tuple[str, ...] = ("layers", "kv_heads", "pages", "page_size", "head_dim")

# Logical axis -> mesh axes it may be split over; axes not listed are replicated. Same format as
# the shared rules tables of rlax_pipe.pipeline.meshes, so this can switch to them later.
CACHE_RULES: Mapping[str, tuple[str, ...]] = {"kv_heads": ("tp",)}


def default_mesh() -> Mesh:
  """A one-device sampler mesh (first default device) with a single "tp" axis of size 1."""
  return Mesh(np.asarray(jax.devices()[:1], dtype=object), ("tp",), axis_types=(AxisType.Auto,))


def logical_spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh,
                 rules: Mapping[str, tuple[str, ...]] = CACHE_RULES) -> PartitionSpec:
  """PartitionSpec for one array: dim i is split over the mesh axes of `rules[axes[i]]`.

  A mesh axis is used when it exists in `mesh`, is not used by an earlier dim, and its size
  (times the axes already chosen for this dim) divides the dim; otherwise the dim stays whole.

  Args:
    axes: logical axis name per dim.
    shape: array shape, same rank.
    mesh: sampler mesh.
    rules: logical name -> ordered mesh axes.

  Returns:
    A `PartitionSpec` (trailing replicated dims dropped).

  Raises:
    ValueError: on a rank mismatch.
  """
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {axes} do not match shape {shape}.")
  used: set[str] = set()
  entries = []
  for name, size in zip(axes, shape):
    chosen, prod = [], 1
    for a in rules.get(name, ()):
      if a in mesh.shape and a not in used and size % (prod * mesh.shape[a]) == 0:
        chosen.append(a)
        prod *= mesh.shape[a]
    used.update(chosen)
    entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  while entries and entries[-1] is None:  # canonical form, as jit reports output shardings
    entries.pop()
  return PartitionSpec(*entries)


def pool_shape(model_cfg: ModelConfig, cfg: SamplerConfig) -> tuple[int, int, int, int, int]:
  """Shape of the key (and of the value) pool: (layers, K, P, S, D)."""
  return (model_cfg.n_layers, model_cfg.n_kv_heads, cfg.num_pages, cfg.page_size,
          model_cfg.head_dim)


def pool_sharding(model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh) -> NamedSharding:
  """NamedSharding of the key/value pools on `mesh` (kv heads over tp when divisible)."""
  return NamedSharding(mesh, logical_spec(CACHE_AXES, pool_shape(model_cfg, cfg), mesh))


def replicated(mesh: Mesh) -> NamedSharding:
  """Fully replicated sharding on `mesh` (block tables, slot inputs, sampled tokens)."""
  return NamedSharding(mesh, PartitionSpec())


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding"))
def _zero_pools(shape, dtype, sharding):
  zeros = jnp.zeros(shape, dtype)
  return (jax.lax.with_sharding_constraint(zeros, sharding),
          jax.lax.with_sharding_constraint(zeros, sharding))


def init_pool(model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh):
  """Allocates zeroed key and value pools directly in their sharding (no reshard).

  Returns:
    (k_pages, v_pages), each [layers, K, P, S, D] in `cfg.cache_dtype`, sharded by
    `pool_sharding`.
  """
  return _zero_pools(pool_shape(model_cfg, cfg), jnp.dtype(cfg.cache_dtype),
                     pool_sharding(model_cfg, cfg, mesh))


def pool_bytes(model_cfg: ModelConfig, cfg: SamplerConfig) -> int:
  """Bytes reserved by the key + value pools."""
  return 2 * int(np.prod(pool_shape(model_cfg, cfg))) * jnp.dtype(cfg.cache_dtype).itemsize
