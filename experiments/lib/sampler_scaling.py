"""The sampler's scaling benchmark (`experiments/bench_sampler.py --suite=scaling`): does a step
cost follow the work (live tokens, sequences) and not the reservations (pool, table width)?

Every time is measured wall clock (`time.perf_counter`), warmed (compiles apart), as a median
over >= 20 dispatches in one process; bytes and temporaries are read from the compiled program
(`cost_analysis()`, `memory_analysis()`); counts come from the engine's own counters.

Keys of `run_scaling` (issue #10 point 7), with the goal each is compared against in the notes:
  pool_scaling_ratio       decode step time, 16x pool / 1x pool, same batch and live tokens
  pool_bytes_ratio         XLA cost analysis bytes accessed of the same two programs
  width_scaling_ratio      decode step time, 16x block-table width / 1x, same live tokens
  decode_temp_over_pool    compiled temporary bytes of the decode dispatch / pool bytes
  host_syncs_per_token     blocking device-to-host reads per generated token
  host_us_per_token        host work per generated token at 256 slots, 8k max length
  prefill_tokens_per_group_ratio  prefill tokens of a group of 8 with / without shared pages
  replica_tokens_per_step_ratio   sequences advanced per decode step, 2 data replicas / 1
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import model
from rlax_pipe.config import ModelConfig
from rlax_pipe.model import as_model
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.sampler import device_loop, page_pool
from rlax_pipe.sampler.config import Request, SamplerConfig
from rlax_pipe.sampler.engine import SamplerEngine

# Tiny model: the ratios are about the sampler's mechanics, not the model.
TINY = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   d_ff=128, max_seq_len=8192)


@dataclasses.dataclass(frozen=True)
class DecodePoint:
  """One decode-dispatch measurement: median step time, compiled bytes and temporaries."""

  step_s: float
  bytes_accessed: float
  temp_bytes: int
  pool_bytes: int


class _DecodeProgram:
  """A compiled `decode_dispatch` with every slot at `live_tokens` tokens (reset per call)."""

  def __init__(self, model_cfg: ModelConfig, *, slots: int, live_tokens: int, num_pages: int,
               width_pages: int, page_size: int, steps: int, seed: int):
    need = -(-(live_tokens + steps) // page_size)
    if need > width_pages or slots * need > num_pages:
      raise ValueError(f"decode_point: {slots} slots x {need} pages do not fit W={width_pages}, "
                       f"P={num_pages}.")
    mesh = page_pool.default_mesh()
    rep = page_pool.replicated(mesh)
    self.layout = page_pool.PoolLayout(
        model_cfg.n_layers, model_cfg.n_kv_heads, num_pages, page_size, model_cfg.head_dim,
        model_cfg.param_dtype, bits=page_pool.needs_bits(model_cfg.param_dtype,
                                                         mesh.devices.flat[0].platform))
    self.steps = steps
    self.params = jax.jit(model.init_params, static_argnums=0)(model_cfg, jax.random.key(seed))
    self.pools = page_pool.init_pool(self.layout, mesh)
    rng = np.random.default_rng(seed)
    tables = np.zeros((slots, width_pages), np.int32)
    # The same live pages (ids below slots * need, shuffled) whatever the pool size or table
    # width: the pairs differ only in reserved, unused pages / columns.
    tables[:, :need] = rng.permutation(slots * need).reshape(slots, need)
    self.tables = jax.device_put(tables, rep)
    self.state = jax.device_put(device_loop.SlotState.zeros(slots, jax.random.key(seed)), rep)
    upd = np.zeros((device_loop.UPDATE_ROWS, slots), np.int32)
    upd[0], upd[1], upd[2], upd[3] = 1, 1, live_tokens - 1, 1
    upd[4], upd[5] = live_tokens + 10 * steps, need * page_size
    self.upd, self.flag = jax.device_put((upd, np.int32(0)), rep)
    self.compiled = device_loop.decode_dispatch.lower(
        self.params, self.pools, self.tables, self.state, self.upd, self.flag,
        model=as_model(model_cfg), sampling=SamplingConfig(), layout=self.layout, impl="reference",
        chunk_pages=max(1, 256 // page_size), mesh=None, interpret=False, stop_ids=(),
        steps=steps, sharding=self.layout.sharding(mesh), replicated=rep).compile()

  def time_step(self) -> float:
    """Seconds per decode step of one dispatch (K steps, blocking)."""
    t0 = time.perf_counter()
    self.pools, _, ints, _ = self.compiled(self.params, self.pools, self.tables, self.state,
                                           self.upd, self.flag)
    jax.block_until_ready(ints)
    return (time.perf_counter() - t0) / self.steps

  def point(self, times: list[float]) -> DecodePoint:
    cost = self.compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per computation
      cost = cost[0] if cost else {}
    return DecodePoint(float(np.median(times)), float(cost.get("bytes accessed", np.nan)),
                       int(self.compiled.memory_analysis().temp_size_in_bytes),
                       self.layout.nbytes)


def decode_points(model_cfg: ModelConfig, configs: dict[str, dict], *, slots: int,
                  live_tokens: int, page_size: int = 16, steps: int = 8, repeats: int = 40,
                  seed: int = 0) -> dict[str, DecodePoint]:
  """Times several decode-dispatch configurations, interleaved (one dispatch of each in turn,
  so that load on a shared machine hits them alike), `repeats` timed rounds after 3 warm ones.

  Args:
    model_cfg: the model (random weights).
    configs: name -> {"num_pages": P, "width_pages": W}.
    slots: B, all active; live_tokens: tokens each slot holds when a dispatch starts.
    page_size: S; steps: K decode steps per dispatch; repeats: timed rounds (>= 20).
    seed: PRNG seed of weights and page choice.

  Returns:
    name -> `DecodePoint` (step_s = median over rounds of dispatch time / K).

  Raises:
    ValueError: if a pool cannot hold the live tokens plus a dispatch's growth.
  """
  programs = {name: _DecodeProgram(model_cfg, slots=slots, live_tokens=live_tokens,
                                   page_size=page_size, steps=steps, seed=seed, **c)
              for name, c in configs.items()}
  times = {name: [] for name in programs}
  for i in range(repeats + 3):
    for name, prog in programs.items():
      t = prog.time_step()
      if i >= 3:
        times[name].append(t)
  return {name: prog.point(times[name]) for name, prog in programs.items()}


def _requests(n: int, rng, prompt: tuple[int, int], budget: tuple[int, int], vocab: int,
              group_size: int = 1) -> list[Request]:
  out = []
  for g in range(n // group_size):
    tokens = rng.integers(4, vocab, int(rng.integers(prompt[0], prompt[1] + 1)))
    for j in range(group_size):
      out.append(Request(prompt_tokens=tokens.astype(np.int32), sample_id=len(out), group_id=g,
                         max_new_tokens=int(rng.integers(budget[0], budget[1] + 1))))
  return out


def host_cost(model_cfg: ModelConfig, *, slots: int = 256, max_seq_len: int = 8192,
              num_requests: int = 512, seed: int = 0) -> dict:
  """Host work and read-backs per generated token, engine at `slots` slots and `max_seq_len`.

  Returns:
    {host_us_per_token, host_syncs_per_token, host_syncs_per_decode_step, generated_tokens,
     dispatches, decode_steps}.
  """
  cfg = SamplerConfig(num_slots=slots, page_size=16, num_pages=slots * 16 + 256,
                      max_seq_len=max_seq_len, max_new_tokens=256, min_prefill_bucket=64,
                      prefill_rows=16, attention_impl="reference")
  params = model.init_params(model_cfg, jax.random.key(seed))
  engine = SamplerEngine(model_cfg, cfg, params)
  requests = _requests(num_requests, np.random.default_rng(seed), (16, 48), (64, 192),
                       model_cfg.vocab_size)
  engine.warmup(max(len(r.prompt_tokens) for r in requests))
  for r in requests:
    engine.submit(r)
  engine.run_to_completion()
  s = engine.stats()
  return {"host_us_per_token": 1e6 * s.host_s / s.generated_tokens,
          "host_syncs_per_token": s.host_syncs / s.generated_tokens,
          "host_syncs_per_decode_step": s.host_syncs / s.decode_steps,
          "host_generated_tokens": s.generated_tokens, "host_dispatches": s.dispatches,
          "host_decode_steps": s.decode_steps, "host_device_call_s": s.device_call_s,
          "host_s": s.host_s}


def prefill_sharing(model_cfg: ModelConfig, *, group_size: int = 8, prompt_len: int = 64,
                    seed: int = 0) -> dict:
  """Prefill tokens computed for one group of `group_size` with / without shared prompt pages.

  Returns:
    {prefill_tokens_per_group_ratio, prefill_tokens_shared, prefill_tokens_unshared,
     shared_logprob_max_abs_diff (same draws, shared vs not: the prefix KV is the same)}.
  """
  tokens = {}
  logps = {}
  for share in (True, False):
    cfg = SamplerConfig(num_slots=group_size, page_size=16, num_pages=256, max_seq_len=256,
                        max_new_tokens=32, min_prefill_bucket=32, prefill_rows=4,
                        share_prompt_pages=share, attention_impl="reference", seed=seed)
    engine = SamplerEngine(model_cfg, cfg, model.init_params(model_cfg, jax.random.key(seed)))
    prompt = np.random.default_rng(seed).integers(4, model_cfg.vocab_size, prompt_len)
    for i in range(group_size):
      engine.submit(Request(prompt_tokens=prompt.astype(np.int32), sample_id=i, group_id=0))
    out = sorted(engine.run_to_completion(), key=lambda r: r.sample_id)
    tokens[share] = engine.stats().prefill_tokens
    logps[share] = np.concatenate([r.behavior_logprobs for r in out])
  n = min(len(logps[True]), len(logps[False]))
  return {"prefill_tokens_per_group_ratio": tokens[True] / tokens[False],
          "prefill_tokens_shared": tokens[True], "prefill_tokens_unshared": tokens[False],
          "shared_logprob_max_abs_diff": float(np.abs(logps[True][:n] - logps[False][:n]).max())}


def replica_throughput(model_cfg: ModelConfig, *, slots: int = 8, num_requests: int = 256,
                       seed: int = 0) -> dict:
  """Distinct sequences advanced per decode step with 2 data replicas vs 1 (needs 2 devices).

  Returns:
    {replica_tokens_per_step_ratio, tokens_per_step_1, tokens_per_step_2, replica_overlap}
    (overlap = samples decoded by both replicas: must be 0), or a "replica_skipped" reason.
  """
  devices = jax.devices()
  if len(devices) < 2:
    return {"replica_tokens_per_step_ratio": None,
            "replica_skipped": f"needs 2 devices, found {len(devices)}"}
  cfg = SamplerConfig(num_slots=slots, page_size=16, num_pages=slots * 24, max_seq_len=384,
                      max_new_tokens=128, min_prefill_bucket=32, prefill_rows=4,
                      attention_impl="reference")
  params = model.init_params(model_cfg, jax.random.key(seed))
  requests = _requests(num_requests, np.random.default_rng(seed), (8, 24), (64, 128),
                       model_cfg.vocab_size)
  per_step, overlap = {}, 0
  for n in (1, 2):
    mesh = jax.sharding.Mesh(np.asarray(devices[:n]).reshape(n, 1), ("data", "tp"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
    placed = jax.device_put(params, page_pool.replicated(mesh))
    engine = SamplerEngine(model_cfg, cfg, placed, mesh=mesh)
    engine.warmup(max(len(r.prompt_tokens) for r in requests))
    for r in requests:
      engine.submit(r)
    seen = [set() for _ in engine.replicas]
    while engine.has_work:
      engine.step()
      for i, r in enumerate(engine.replicas):
        seen[i].update(s.request.sample_id for s in r.sched.running())
    if n == 2:
      overlap = len(seen[0] & seen[1])
    s = engine.stats()
    per_step[n] = s.generated_tokens / s.decode_steps
  return {"replica_tokens_per_step_ratio": per_step[2] / per_step[1],
          "tokens_per_step_1": per_step[1], "tokens_per_step_2": per_step[2],
          "replica_overlap": overlap}


def run_scaling(model_cfg: ModelConfig = TINY, *, slots: int = 16, live_tokens: int = 256,
                num_pages: int = 512, width_pages: int = 32, scale: int = 16) -> dict:
  """Every point-7 measurement; see the module docstring for the keys.

  Args:
    model_cfg: the model of the decode and host measurements.
    slots, live_tokens: batch and live tokens per slot of the pool/width pairs.
    num_pages, width_pages: the 1x pool and the 1x block-table width.
    scale: the factor between the pairs (16 in the issue).
  """
  points = decode_points(model_cfg, {
      "small": dict(num_pages=num_pages, width_pages=width_pages),
      "big_pool": dict(num_pages=scale * num_pages, width_pages=width_pages),
      "wide": dict(num_pages=num_pages, width_pages=scale * width_pages)},
                         slots=slots, live_tokens=live_tokens)
  small, big_pool, wide = points["small"], points["big_pool"], points["wide"]
  out = {
      "pool_scaling_ratio": big_pool.step_s / small.step_s,
      "pool_bytes_ratio": big_pool.bytes_accessed / small.bytes_accessed,
      "width_scaling_ratio": wide.step_s / small.step_s,
      "decode_temp_over_pool": big_pool.temp_bytes / big_pool.pool_bytes,
      "decode_step_ms": {"small": 1e3 * small.step_s, "big_pool": 1e3 * big_pool.step_s,
                         "wide_table": 1e3 * wide.step_s},
      "bytes_accessed_mb": {"small": small.bytes_accessed / 1e6,
                            "big_pool": big_pool.bytes_accessed / 1e6},
      "pool_mb": {"small": small.pool_bytes / 1e6, "big_pool": big_pool.pool_bytes / 1e6},
      "decode_temp_mb": {"small": small.temp_bytes / 1e6, "big_pool": big_pool.temp_bytes / 1e6},
  }
  out.update(host_cost(model_cfg))
  out.update(prefill_sharing(model_cfg))
  out.update(replica_throughput(model_cfg))
  return out


def kernel_checks(seed: int = 0) -> dict:
  """Each Pallas kernel of this platform vs the jnp reference on random paged K/V.

  On GPU / TPU the kernels run natively at preset-like shapes (8 kv heads, head dim 128 and 64,
  page 16, bf16 pool); on CPU the decode kernels run in Pallas interpret mode at tiny shapes
  and the ragged TPU path through JAX's reference kernel (the interpreter fails on it).

  Returns:
    {"kernel_<impl>_<shape>_max_abs_err": float, ...} and "kernel_platform".
  """
  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
  from rlax_pipe.sampler import kernels
  from rlax_pipe.sampler import paged_attention as pa

  platform = jax.devices()[0].platform
  native = {"gpu": ("pallas_gpu",), "tpu": ("pallas_tpu", "pallas_tpu_ragged")}.get(platform)
  impls = native or ("pallas_gpu", "pallas_tpu", "pallas_tpu_ragged")
  shapes = ((8, 2, 128), (8, 4, 64)) if native else ((2, 2, 16),)  # (kv heads, group, head dim)
  dtype = jnp.bfloat16 if native else jnp.float32
  out = {"kernel_platform": platform}
  rng = np.random.default_rng(seed)
  for kvh, group, dim in shapes:
    for impl in impls:
      layout = page_pool.PoolLayout(2, kvh, 64, 16, dim, jnp.dtype(dtype).name,
                                    combined=impl == "pallas_tpu_ragged")
      pools = tuple(jnp.asarray(rng.normal(size=s), dtype) for s in layout.shapes)
      lengths = np.array([1, 17, 100, 250])
      tables = np.zeros((4, 16), np.int32)
      perm, used = rng.permutation(64), 0
      for b, n in enumerate(lengths):
        k = -(-n // 16)
        tables[b, :k] = perm[used:used + k]
        used += k
      t = 1
      pos = jnp.asarray((lengths - 1)[:, None], jnp.int32)
      valid = jnp.ones((4, t), bool)
      q = jnp.asarray(rng.normal(size=(4, t, kvh * group, dim)), dtype)
      ref = pa.paged_attention_reference(q.astype(jnp.float32),
                                         tuple(p.astype(jnp.float32) for p in pools), layout,
                                         jnp.int32(1), jnp.asarray(tables), pos, valid,
                                         chunk_pages=4)
      ragged_ref = rpa.ref_ragged_paged_attention if not native else None
      got = kernels.attend(impl, q, pools, layout, jnp.int32(1), jnp.asarray(tables), pos, valid,
                           mesh=None, interpret=not native, ragged_kernel=ragged_ref)
      err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)))
      out[f"kernel_{impl}_K{kvh}G{group}D{dim}_max_abs_err"] = err
  return out
