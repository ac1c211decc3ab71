"""Static-batch generation over a dense KV cache: the baseline the paged engine is measured against.

This is how most JAX RL samplers generate (e.g. tunix's native sampler): a fixed batch of B
prompts, one dense cache [layers, B, max_seq_len, K, D] reserved per row, a prefill, then a
`lax.while_loop` of [B, 1] decode steps that runs until the LAST row of the batch is done. Rows
that finish early keep computing padding, and the next batch starts only when the whole batch
returns. Tokens are drawn through `rlax_pipe.logprobs.sample`, exactly like the engine.

Letters: B batch rows, T prompt width, N output width (max_seq_len), V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe.model import Model, ModelLike, as_model
from rlax_pipe.model.kv_cache import DenseKVCache
from rlax_pipe.sampler import device_loop
from rlax_pipe.sampler.config import Request, normalize_stop_ids
from rlax_pipe.types import Rollout


@functools.partial(jax.jit, static_argnames=("model", "sampling", "max_seq_len", "stop_ids",
                                             "cache_dtype"))
def generate_batch(params, prompts_BT, prompt_lens_B, budgets_B, rng, *, model: Model,
                   sampling: logprobs_lib.SamplingConfig, max_seq_len: int,
                   stop_ids: tuple[int, ...], cache_dtype: str):
  """Generates for one static batch until every row is done.

  Args:
    params: model parameters.
    prompts_BT: int32 [B, T] prompts, right-padded (T < max_seq_len).
    prompt_lens_B: int32 [B] prompt lengths (>= 1).
    budgets_B: int32 [B] completion budgets (0 = padding row, done from the start).
    rng: PRNG key.
    model, sampling, max_seq_len, stop_ids (tuple of token ids), cache_dtype: static.

  Returns:
    dict with tokens int32 [B, N], logprobs float32 [B, N] (N = max_seq_len; row b valid up to
    lengths[b]), lengths int32 [B], finish_step int32 [B] (decode step, 1-based, at which the row
    finished), num_steps int32 [] (decode steps the batch ran).
  """
  b, t = prompts_BT.shape
  n = max_seq_len
  cache = DenseKVCache.init(model.n_layers, b, max_seq_len, model.n_kv_heads,
                            model.head_dim, jnp.dtype(cache_dtype))
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
  _, cache = model.forward(params, prompts_BT, positions, cache=cache,
                           valid_BT=positions < (prompt_lens_B - 1)[:, None])
  last = prompt_lens_B - 1
  pending = jnp.take_along_axis(prompts_BT, last[:, None], axis=1)[:, 0]
  rows = jnp.arange(b)
  nonfinite = device_loop.head_nonfinite_ids(model, params)  # once, outside the loop
  state = dict(step=jnp.int32(0), cache=cache, pending=pending, pos=last,
               done=budgets_B <= 0, count=jnp.zeros(b, jnp.int32),
               tokens=jnp.zeros((b, n), jnp.int32), logprobs=jnp.zeros((b, n), jnp.float32),
               finish_step=jnp.zeros(b, jnp.int32), rng=rng)

  def cond(s):
    return jnp.logical_not(jnp.all(s["done"])) & (s["step"] < n)

  def body(s):
    live = jnp.logical_not(s["done"])
    logits, cache = model.forward(params, s["pending"][:, None], s["pos"][:, None],
                                  cache=s["cache"], valid_BT=live[:, None])
    rng, draw = jax.random.split(s["rng"])
    tok, logp = logprobs_lib.sample(draw, logits[:, 0], sampling, nonfinite)
    col = jnp.where(live, s["count"], n)  # out of bounds -> dropped
    count = s["count"] + live.astype(jnp.int32)
    done = s["done"] | (count >= budgets_B) | (s["pos"] + 2 >= max_seq_len)
    for sid in stop_ids:
      done = done | (live & (tok == sid))
    step = s["step"] + 1
    return dict(step=step, cache=cache, pending=tok, pos=s["pos"] + live.astype(jnp.int32),
                done=done, count=count,
                tokens=s["tokens"].at[rows, col].set(tok, mode="drop"),
                logprobs=s["logprobs"].at[rows, col].set(logp, mode="drop"),
                finish_step=jnp.where(done & live, step, s["finish_step"]), rng=rng)

  s = jax.lax.while_loop(cond, body, state)
  return dict(tokens=s["tokens"], logprobs=s["logprobs"], lengths=s["count"],
              finish_step=s["finish_step"], num_steps=s["step"])


def _finish_reason(tokens: np.ndarray, stop_ids: tuple[int, ...], n: int, cap: int,
                   budget: int) -> str:
  if n and int(tokens[n - 1]) in stop_ids:
    return "eos"
  return "length" if cap >= budget else "capacity"


@dataclasses.dataclass(frozen=True)
class StaticStats:
  """What the static baseline did.

  Attributes:
    batches: static batches run.
    decode_steps: decode steps summed over batches (each [B, 1]).
    wall_s: clock time from the first batch's start to the last batch's end.
    slot_occupancy: mean over decode steps of still-generating rows / B.
    kv_utilization: mean over decode steps of KV tokens of still-generating rows / reserved
      cache tokens (B * max_seq_len).
    done_times: float64 [num requests] clock time at which each sample's last token was made,
      interpolated within its batch from its finish step (samples are delivered only at the end
      of their batch: `Rollout.t_finish`).
  """

  batches: int
  decode_steps: int
  wall_s: float
  slot_occupancy: float
  kv_utilization: float
  done_times: np.ndarray


def static_generate(params, model: ModelLike, requests: Sequence[Request], *,
                    batch_size: int, max_seq_len: int, max_new_tokens: int,
                    sampling: logprobs_lib.SamplingConfig, eos_id=None,
                    cache_dtype: str = "float32", seed: int = 0, version: int = 0,
                    clock: Callable[[], float] = time.perf_counter):
  """Runs `requests` in consecutive static batches of `batch_size` (submission order).

  Args:
    params: model parameters.
    model: the model (`rlax_pipe.model.Model`, or a `ModelConfig` of the built-in one).
    requests: prompts with optional per-request budgets (capped by max_seq_len).
    batch_size: rows per static batch (the last batch is padded).
    max_seq_len: dense cache length per row (prompt + completion).
    max_new_tokens: budget for requests that give none.
    sampling: sampling configuration.
    eos_id: the stop set: a token id, a sequence of ids, or None.
    cache_dtype: dense cache dtype.
    seed: PRNG seed.
    version: policy version stamped on every token.
    clock: seconds.

  Returns:
    (rollouts in request order, `StaticStats`).

  Raises:
    ValueError: if a prompt is longer than max_seq_len - 1.
  """
  longest = max(len(r.prompt_tokens) for r in requests)
  if longest > max_seq_len - 1:
    raise ValueError(f"static_generate: a prompt has {longest} tokens; max_seq_len={max_seq_len} "
                     f"allows at most {max_seq_len - 1}.")
  width = 1 << (longest - 1).bit_length()
  stop_ids = normalize_stop_ids(eos_id)
  rng = jax.random.key(seed)
  rollouts, done_times = [], []
  steps = occupancy = kv_util = 0.0
  start = clock()
  for i in range(0, len(requests), batch_size):
    batch = list(requests[i:i + batch_size])
    prompts = np.zeros((batch_size, width), np.int32)
    lens = np.ones(batch_size, np.int32)
    budgets = np.zeros(batch_size, np.int32)
    for row, r in enumerate(batch):
      p = r.prompt_tokens
      prompts[row, :len(p)], lens[row] = p, len(p)
      budget = max_new_tokens if r.max_new_tokens is None else r.max_new_tokens
      budgets[row] = min(budget, max_seq_len - len(p))
    rng, key = jax.random.split(rng)
    t0 = clock()
    out = jax.device_get(generate_batch(
        params, prompts, lens, budgets, key, model=as_model(model), sampling=sampling,
        max_seq_len=max_seq_len, stop_ids=stop_ids, cache_dtype=cache_dtype))
    t1 = clock()
    n_steps = int(out["num_steps"])
    finish = out["finish_step"]
    s_idx = np.arange(1, n_steps + 1)[:, None]  # [steps, 1]
    generating = s_idx <= finish[None, :]  # [steps, B]
    steps += n_steps
    occupancy += generating.sum() / batch_size
    kv_util += (generating * (lens[None, :] - 1 + s_idx)).sum() / (batch_size * max_seq_len)
    for row, r in enumerate(batch):
      n = int(out["lengths"][row])
      done_t = t0 + (t1 - t0) * finish[row] / max(n_steps, 1)
      done_times.append(done_t)
      rollouts.append(Rollout(
          sample_id=r.sample_id, group_id=r.group_id, prompt_tokens=r.prompt_tokens.copy(),
          completion_tokens=out["tokens"][row, :n].astype(np.int32),
          behavior_logprobs=out["logprobs"][row, :n].astype(np.float32),
          policy_versions=np.full(n, version, np.int32),
          finish_reason=_finish_reason(out["tokens"][row, :n], stop_ids, n, budgets[row],
                                       r.max_new_tokens or max_new_tokens),
          t_admit=t0, t_first_token=t0 + (t1 - t0) / max(n_steps, 1), t_finish=t1,
          prompt_index=r.prompt_index))
  n_steps_total = max(steps, 1)
  stats = StaticStats(batches=-(-len(requests) // batch_size), decode_steps=int(steps),
                      wall_s=clock() - start, slot_occupancy=occupancy / n_steps_total,
                      kv_utilization=kv_util / n_steps_total,
                      done_times=np.asarray(done_times, np.float64))
  return rollouts, stats
