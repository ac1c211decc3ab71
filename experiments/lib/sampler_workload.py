"""Paged continuous batching vs a static dense-KV batch on a long-tailed workload
(`experiments/bench_sampler.py`, the default suite).

Both samplers get the same model, weights, prompts and per-request completion budgets. EOS is
disabled, so every request generates exactly its budget and both produce the same number of
useful tokens; budgets are heavy-tailed (most requests short, a small fraction very long), which
is the shape of RL completions that makes synchronous batches wait on stragglers.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from rlax_pipe.model import as_model
from rlax_pipe.config import ModelConfig
from rlax_pipe.sampler.config import Request, SamplerConfig
from rlax_pipe.sampler.engine import SamplerEngine
from rlax_pipe.sampler.static_generate import static_generate


# Small enough that a CPU run takes well under two minutes; long enough for 320-token tails.
MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=1,
                    head_dim=16, d_ff=192, max_seq_len=352)
SAMPLER = SamplerConfig(num_slots=32, page_size=16, num_pages=192, max_seq_len=352,
                        min_prefill_bucket=32, prefill_rows=4)


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
  """Heavy-tailed generation workload.

  Attributes:
    num_requests: number of requests (>= 1).
    prompt_min, prompt_max: prompt length range in tokens, uniform, inclusive (>= 1).
    short_min, short_max: budget range of ordinary requests in tokens, uniform, inclusive.
    long_frac: fraction of requests drawn from the long range, in [0, 1].
    long_min, long_max: budget range of long requests in tokens, uniform, inclusive.
    seed: numpy seed of the workload.
  """

  num_requests: int = 1024
  prompt_min: int = 4
  prompt_max: int = 24
  short_min: int = 8
  short_max: int = 32
  long_frac: float = 0.02
  long_min: int = 256
  long_max: int = 320
  seed: int = 0

  def __post_init__(self):
    if self.num_requests < 1 or not 1 <= self.prompt_min <= self.prompt_max:
      raise ValueError(f"WorkloadConfig: bad num_requests/prompt range in {self}.")
    if not 1 <= self.short_min <= self.short_max or not 1 <= self.long_min <= self.long_max:
      raise ValueError(f"WorkloadConfig: bad budget ranges in {self}.")
    if not 0 <= self.long_frac <= 1:
      raise ValueError(f"WorkloadConfig.long_frac={self.long_frac} must be in [0, 1].")


def make_workload(cfg: WorkloadConfig, vocab_size: int) -> list[Request]:
  """Random prompts and heavy-tailed budgets (long requests at random positions)."""
  rng = np.random.default_rng(cfg.seed)
  long = rng.random(cfg.num_requests) < cfg.long_frac
  budgets = np.where(long, rng.integers(cfg.long_min, cfg.long_max + 1, cfg.num_requests),
                     rng.integers(cfg.short_min, cfg.short_max + 1, cfg.num_requests))
  lengths = rng.integers(cfg.prompt_min, cfg.prompt_max + 1, cfg.num_requests)
  return [Request(prompt_tokens=rng.integers(0, vocab_size, n).astype(np.int32), sample_id=i,
                  group_id=i, prompt_index=i, max_new_tokens=int(b))
          for i, (n, b) in enumerate(zip(lengths, budgets))]


def _quantile_time(times: np.ndarray, start: float, q: float) -> float:
  return float(np.quantile(np.asarray(times) - start, q))


def run(model_cfg: ModelConfig, sampler_cfg: SamplerConfig, workload: WorkloadConfig,
        param_seed: int = 0) -> dict:
  """Runs both samplers on the same workload; compile time is excluded from both.

  Returns:
    Flat dict of metrics: useful_tokens, useful_tokens_per_s_{paged,static}, speedup (static
    batch = num_slots, which reserves num_slots * max_seq_len KV tokens), the same against a
    static batch with the SAME KV memory as the paged pool (num_pages * page_size // max_seq_len
    rows: static_same_memory_batch, useful_tokens_per_s_static_same_memory,
    speedup_vs_static_same_memory),
    slot_occupancy_{paged,static}, kv_utilization_{paged,static} (time-averaged KV tokens of
    unfinished sequences / reserved cache tokens: the whole page pool, resp. B * max_seq_len),
    p99_over_p50_latency (paged, per-sample t_finish - t_admit), p99_over_p50_latency_static
    (sample done time - batch start), time_to_99pct_samples_s / time_to_all_samples_s (static:
    when 99% resp. all samples had their last token), the same two for paged, wall times,
    decode steps and their ratio (the speedup scheduling alone would give at equal step cost),
    ms per decode step (paged includes its prefills), preemptions.
  """
  params = as_model(model_cfg).init_params(jax.random.key(param_seed))
  requests = make_workload(workload, model_cfg.vocab_size)
  useful = sum(min(r.max_new_tokens, sampler_cfg.max_seq_len - len(r.prompt_tokens))
               for r in requests)

  engine = SamplerEngine(model_cfg, sampler_cfg, params)
  engine.warmup(max(len(r.prompt_tokens) for r in requests))
  for r in requests:
    engine.submit(r)
  paged_start = time.perf_counter()
  paged = engine.run_to_completion()
  paged_wall = time.perf_counter() - paged_start
  stats = engine.stats()
  assert sum(r.num_completion_tokens for r in paged) == useful, "paged token count mismatch"
  paged_done = np.array([r.t_finish for r in paged])
  latency = np.array([r.t_finish - r.t_admit for r in paged])

  static_kwargs = dict(max_seq_len=sampler_cfg.max_seq_len,
                       max_new_tokens=sampler_cfg.max_new_tokens, sampling=sampler_cfg.sampling,
                       eos_id=sampler_cfg.eos_id, cache_dtype=sampler_cfg.cache_dtype)
  # Same KV memory as the paged pool: as many dense rows of max_seq_len as the pool's tokens.
  same_memory_batch = max(1, sampler_cfg.num_pages * sampler_cfg.page_size
                          // sampler_cfg.max_seq_len)
  # Compile outside the timing: same prompt width (set by the longest prompt), any budget.
  longest = max(requests, key=lambda r: len(r.prompt_tokens))
  for batch in (sampler_cfg.num_slots, same_memory_batch):
    static_generate(params, model_cfg, [dataclasses.replace(longest, max_new_tokens=1)],
                    batch_size=batch, **static_kwargs)
  start = time.perf_counter()
  static, sstats = static_generate(params, model_cfg, requests, batch_size=sampler_cfg.num_slots,
                                   **static_kwargs)
  assert sum(r.num_completion_tokens for r in static) == useful, "static token count mismatch"
  batch_start = np.array([r.t_admit for r in static])
  static_latency = sstats.done_times - batch_start
  same, same_stats = static_generate(params, model_cfg, requests, batch_size=same_memory_batch,
                                     **static_kwargs)
  assert sum(r.num_completion_tokens for r in same) == useful, "static token count mismatch"

  def ratio(x):
    return float(np.quantile(x, 0.99) / np.quantile(x, 0.5))

  return {
      "useful_tokens": int(useful),
      "useful_tokens_per_s_paged": useful / paged_wall,
      "useful_tokens_per_s_static": useful / sstats.wall_s,
      "speedup": sstats.wall_s / paged_wall,
      # A static baseline holding the same KV memory as the paged pool (fewer, full-length rows):
      "static_same_memory_batch": same_memory_batch,
      "useful_tokens_per_s_static_same_memory": useful / same_stats.wall_s,
      "speedup_vs_static_same_memory": same_stats.wall_s / paged_wall,
      "kv_tokens_paged_pool": sampler_cfg.num_pages * sampler_cfg.page_size,
      "kv_tokens_static_same_memory": same_memory_batch * sampler_cfg.max_seq_len,
      "kv_tokens_static": sampler_cfg.num_slots * sampler_cfg.max_seq_len,
      "slot_occupancy_paged": stats.slot_occupancy,
      "slot_occupancy_static": sstats.slot_occupancy,
      "kv_utilization_paged": stats.kv_utilization,
      "kv_utilization_static": sstats.kv_utilization,
      "kv_page_fill_paged": stats.kv_page_fill,
      "p99_over_p50_latency": ratio(latency),
      "p99_over_p50_latency_static": ratio(static_latency),
      "time_to_99pct_samples_s": _quantile_time(sstats.done_times, start, 0.99),
      "time_to_all_samples_s": float(sstats.done_times.max() - start),
      "time_to_99pct_samples_s_paged": _quantile_time(paged_done, paged_start, 0.99),
      "time_to_all_samples_s_paged": float(paged_done.max() - paged_start),
      "wall_s_paged": paged_wall,
      "wall_s_static": sstats.wall_s,
      "decode_steps_paged": stats.decode_steps,
      "decode_steps_static": sstats.decode_steps,
      # Scheduling alone (same per-step cost) would give this speedup:
      "decode_step_ratio": sstats.decode_steps / max(stats.decode_steps, 1),
      "ms_per_step_paged": 1e3 * paged_wall / max(stats.decode_steps, 1),
      "ms_per_step_static": 1e3 * sstats.wall_s / max(sstats.decode_steps, 1),
      "prefill_calls_paged": stats.prefill_calls,
      "preemptions_paged": stats.preemptions,
      "num_requests": len(requests),
      "long_requests": int(sum(r.max_new_tokens >= workload.long_min for r in requests)),
  }
