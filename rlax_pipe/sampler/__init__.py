"""Paged-KV continuous-batching sampler: page pool, allocator, scheduler, engine, baseline.

Public surface:
  SamplerConfig, Request            configuration and the request message
  SamplerEngine, SamplerStats       the engine (`submit`, `step`, `update_weights`, `abort_all`)
  PagedKVCache                      the paged implementation of the model's KV-cache interface
  PageAllocator                     host-side page ownership and block tables
  paged_attention_reference         pure-jnp paged attention (every backend)
  static_generate                   module: static-batch dense-KV baseline (`static_generate`)
  benchmark                         module: paged vs static on a long-tailed workload
"""

from rlax_pipe.sampler import benchmark, static_generate
from rlax_pipe.sampler.config import Request, SamplerConfig
from rlax_pipe.sampler.engine import SamplerEngine, SamplerStats
from rlax_pipe.sampler.page_allocator import PageAllocator
from rlax_pipe.sampler.paged_attention import paged_attention_reference
from rlax_pipe.sampler.paged_cache import PagedKVCache

__all__ = [
    "PageAllocator", "PagedKVCache", "Request", "SamplerConfig", "SamplerEngine", "SamplerStats",
    "benchmark", "paged_attention_reference", "static_generate",
]
