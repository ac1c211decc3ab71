"""Compiles every device program a replica can call, on inputs that change nothing.

After `compile_replica`, admissions, finishes, preemptions, shared-prompt copies and weight swaps
(same shapes and shardings) do not compile: every shape a run can produce is one of the buckets
compiled here (prefill lengths, block-table delta counts, page-copy and page-zeroing counts).
"""

from __future__ import annotations

import jax
import numpy as np

from rlax_pipe.sampler import device_loop
from rlax_pipe.sampler import page_pool
from rlax_pipe.sampler.config import SamplerConfig
from rlax_pipe.sampler.replica import FLAG_ROW, EngineReplica, pow2_bucket


def _powers(lo: int, hi: int) -> list[int]:
  out, n = [], lo
  while n <= pow2_bucket(hi, lo):
    out.append(n)
    n *= 2
  return out


def compile_replica(r: EngineReplica, params, cfg: SamplerConfig,
                    max_prefill_len: int | None = None, nonfinite_V=None) -> None:
  """Runs each program of replica `r` once on padding (see module docstring).

  Args:
    r: the replica (its pools and state are threaded through, unchanged in content).
    params: the replica's weights.
    cfg: sampler configuration.
    max_prefill_len: compile prefill buckets up to the one holding this many tokens; None = all.
    nonfinite_V: what the engine's dispatches get beside `params` (`EngineWeights.masks`), so
      the decode variant compiled here is the one they run.
  """
  rep, b, w = r.replicated, cfg.num_slots, r.width
  top = cfg.max_seq_len if max_prefill_len is None else cfg.bucket_for(max_prefill_len)
  for bucket in (x for x in cfg.prefill_buckets if x <= top):
    rows = cfg.prefill_rows
    args = jax.device_put((np.zeros((rows, w), np.int32), np.zeros((rows, bucket), np.int32),
                           np.zeros(rows, np.int32), np.zeros(rows, np.int32)), rep)
    r.pools = device_loop.prefill_step(params, r.pools, *args, model=r.model,
                                       sharding=r.pool_sharding, **r.static)
  for n in _powers(64, b * w):
    deltas = np.full((3, n), b, np.int32)
    r.tables = device_loop.write_tables(r.tables, *jax.device_put(tuple(deltas), rep),
                                        replicated=rep)
  for n in _powers(8, b):
    src, dst = np.zeros(n, np.int32), np.full(n, cfg.num_pages, np.int32)
    r.pools = page_pool.copy_pages(r.pools, *jax.device_put((src, dst), rep), layout=r.layout,
                                   sharding=r.pool_sharding)
  if r.impl != "reference":
    for n in _powers(16, cfg.num_pages):
      pages = jax.device_put(np.full(n, cfg.num_pages, np.int32), rep)
      r.pools = device_loop.zero_pages(r.pools, pages, layout=r.layout, sharding=r.pool_sharding)
  upd = np.zeros((FLAG_ROW, b), np.int32)  # nothing changed: every slot stays idle, 0 steps
  r.pools, r.state, ints, _, _ = device_loop.decode_dispatch(
      params, r.pools, r.tables, r.state, jax.device_put(upd, rep),
      jax.device_put(np.int32(0), rep), nonfinite_V, model=r.model, sampling=cfg.sampling,
      stop_ids=cfg.stop_ids, steps=cfg.decode_steps_per_dispatch, sharding=r.pool_sharding,
      replicated=rep, **r.static)
  jax.block_until_ready(ints)
