"""Paged-KV continuous-batching sampler: page pool, allocator, scheduler, engine, baseline.

Public surface:
  SamplerConfig, Request            configuration and the request message
  SamplerEngine, SamplerStats       the engine (`submit`, `step`, `update_weights`, `abort`,
                                    `abort_all`); one replica per "data" index of its mesh
  PagedKVCache                      the paged implementation of the model's KV-cache interface
  PoolLayout                        layout, sharding and in-place ops of the KV page pool
  PageAllocator                     host-side reference-counted pages and block tables
  paged_attention_reference         pure-jnp, length-aware paged attention (every backend)
  kernels                           module: JAX's Pallas paged-attention kernels (GPU, TPU)
  static_generate                   module: static-batch dense-KV baseline (`static_generate`)
"""

from rlax_pipe.sampler import kernels, static_generate
from rlax_pipe.sampler.config import Request, SamplerConfig
from rlax_pipe.sampler.engine import SamplerEngine, SamplerStats
from rlax_pipe.sampler.page_allocator import PageAllocator
from rlax_pipe.sampler.page_pool import PoolLayout
from rlax_pipe.sampler.paged_attention import paged_attention_reference
from rlax_pipe.sampler.paged_cache import PagedKVCache

__all__ = [
    "PageAllocator", "PagedKVCache", "PoolLayout", "Request", "SamplerConfig", "SamplerEngine",
    "SamplerStats", "kernels", "paged_attention_reference", "static_generate",
]
