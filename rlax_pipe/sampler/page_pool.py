"""The device-side KV page pool and its sharding on the sampler mesh.

Layout: keys and values are each one array [layers, K, P, S, D] (layers, kv heads, pages, page
size, head dim). Heads come before pages because that is the page layout both JAX Pallas paged
attention kernels (GPU and TPU: [K, P, S, D] per layer) read, so the accelerated path needs no
per-step transpose of the pool.

Sharding: the cache names logical axes only; `rlax_pipe.sharding.CACHE_RULES` maps them to
mesh axes (kv heads over "tp" when they divide evenly; pages stay whole, see there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from rlax_pipe import sharding as sharding_lib
from rlax_pipe.model import Model
from rlax_pipe.sampler.config import SamplerConfig
from rlax_pipe.sharding import replicated  # pylint: disable=unused-import (engine uses it)

CACHE_AXES: tuple[str, ...] = (
    sharding_lib.LAYERS, sharding_lib.KV_HEADS, sharding_lib.PAGES, sharding_lib.PAGE_SIZE,
    sharding_lib.HEAD_DIM)


def default_mesh() -> Mesh:
  """A one-device sampler mesh (first default device) with a single "tp" axis of size 1."""
  return sharding_lib.make_mesh(jax.devices()[:1], {sharding_lib.TP: 1})


def pool_shape(model: Model, cfg: SamplerConfig) -> tuple[int, int, int, int, int]:
  """Shape of the key (and of the value) pool: (layers, K, P, S, D)."""
  return (model.n_layers, model.n_kv_heads, cfg.num_pages, cfg.page_size,
          model.head_dim)


def pool_sharding(model: Model, cfg: SamplerConfig, mesh: Mesh) -> NamedSharding:
  """NamedSharding of the key/value pools on `mesh` (kv heads over tp when divisible)."""
  return NamedSharding(mesh, sharding_lib.logical_to_spec(
      CACHE_AXES, pool_shape(model, cfg), mesh, sharding_lib.CACHE_RULES, canonical=True))


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding"))
def _zero_pools(shape, dtype, sharding):
  zeros = jnp.zeros(shape, dtype)
  return (jax.lax.with_sharding_constraint(zeros, sharding),
          jax.lax.with_sharding_constraint(zeros, sharding))


def init_pool(model: Model, cfg: SamplerConfig, mesh: Mesh):
  """Allocates zeroed key and value pools directly in their sharding (no reshard).

  Returns:
    (k_pages, v_pages), each [layers, K, P, S, D] in `cfg.cache_dtype`, sharded by
    `pool_sharding`.
  """
  return _zero_pools(pool_shape(model, cfg), jnp.dtype(cfg.cache_dtype),
                     pool_sharding(model, cfg, mesh))
