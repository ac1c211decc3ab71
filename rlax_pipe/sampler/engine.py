"""`SamplerEngine`: continuous-batching generation over the paged KV cache.

A thin host-side shell over two pure jitted programs:
- `prefill_step` [prefill_rows, bucket]: computes the KV of whole prefixes (prompt + tokens
  generated so far, minus the pending last token) and writes it into the sequences' pages; used
  at admission, after a preemption, and under kv_policy="recompute" after a weight swap.
- `decode_step` [num_slots, 1]: feeds every active slot's pending token, writes its KV, and draws
  the next token through `rlax_pipe.logprobs.sample` (the same logit processing the learner
  scores with), returning the token and its behaviour log-prob (fp32).
Every generated token is produced by a decode step and stamped with the version of the weights
that step ran with. Shapes never depend on which requests are running, so after `warmup()`
admits, finishes, preemptions and weight swaps (same shapes/shardings) do not compile.

Stopping: on `eos_id` (kept as the completion's last token; an EOS drawn first gives the
one-token completion [EOS] with finish_reason "eos", returned like any other), on the request's
budget, or when prompt + completion reaches max_seq_len ("length").

Timings come from an injectable `clock` (seconds), so a pipeline can drive a virtual clock.

Weights arrive as `WeightUpdate` messages and the engine owns them from then on: a donated
version's arrays are deleted when a newer version replaces it. An update is applied at the next
step boundary, i.e. at once when the engine is between steps.

Threading: `update_weights` may be called from any thread (it never waits for a running step);
everything else (`submit`, `step`, `state_dict`, ...) from one thread, the engine's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe.model import Model, ModelLike, as_model
from rlax_pipe.sampler import page_pool
from rlax_pipe.sampler.config import Request, SamplerConfig
from rlax_pipe.sampler.page_allocator import PageAllocator
from rlax_pipe.sampler.paged_cache import PagedKVCache, resolve_impl
from rlax_pipe.sampler.scheduler import Scheduler, SequenceState, plan_prefill
from rlax_pipe.types import Rollout, WeightUpdate

# on_span(component, kind, start_s, end_s, slots_active, slots_total)
SpanHook = Callable[[str, str, float, float, int, int], None]


def _constrain(tree, sharding):
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


@functools.partial(jax.jit, static_argnames=("model", "pool_sharding"),
                   donate_argnames=("k_pages", "v_pages"))
def prefill_step(params, k_pages, v_pages, block_tables_RW, tokens_RT, lengths_R, *,
                 model: Model, pool_sharding):
  """Writes the KV of positions [0, lengths[r]) of each row into its pages.

  Args:
    params: model parameters.
    k_pages, v_pages: [layers, K, P, S, D] pools (donated).
    block_tables_RW: int32 [R, W] pages of each row.
    tokens_RT: int32 [R, T] prefix tokens from position 0 (T = bucket; padding beyond lengths).
    lengths_R: int32 [R] real tokens per row (0 = padding row, writes nothing).
    model: the model (static).
    pool_sharding: sharding of the pools (static; pins the outputs' layout).

  Returns:
    (k_pages, v_pages) updated. The logits are not computed (dead code).
  """
  r, t = tokens_RT.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (r, t))
  valid = positions < lengths_R[:, None]
  # A prefill starts at position 0, so only the pages under the bucket are read or written.
  pages = -(-t // k_pages.shape[3])
  cache = PagedKVCache(k=k_pages, v=v_pages, block_tables=block_tables_RW[:, :pages])
  _, cache = model.forward(params, tokens_RT, positions, cache=cache, valid_BT=valid)
  return _constrain((cache.k, cache.v), pool_sharding)


@functools.partial(jax.jit, static_argnames=("model", "sampling", "impl", "pool_sharding"),
                   donate_argnames=("k_pages", "v_pages", "rng"))
def decode_step(params, k_pages, v_pages, slots_BX, rng, *, model: Model,
                sampling: logprobs_lib.SamplingConfig, impl: str, pool_sharding):
  """One decode step for every slot: feed the pending token, write its KV, draw the next token.

  Args:
    params: model parameters.
    k_pages, v_pages: [layers, K, P, S, D] pools (donated).
    slots_BX: int32 [B, 3 + W], one host-to-device transfer per step; per slot: the pending
      token, its position, active (1) or not (0; writes nothing, outputs ignored), then the
      block-table row [W].
    rng: PRNG key (donated); split once per step.
    model, sampling, impl, pool_sharding: static.

  Returns:
    (next_tokens int32 [B], behaviour log-probs float32 [B], k_pages, v_pages, rng).
  """
  tokens_B1, positions_B1, active_B1 = slots_BX[:, 0:1], slots_BX[:, 1:2], slots_BX[:, 2:3] > 0
  cache = PagedKVCache(k=k_pages, v=v_pages, block_tables=slots_BX[:, 3:], impl=impl)
  logits, cache = model.forward(params, tokens_B1, positions_B1, cache=cache,
                                valid_BT=active_B1)
  rng, draw = jax.random.split(rng)
  tokens, logps = logprobs_lib.sample(draw, logits[:, 0], sampling)
  k, v = _constrain((cache.k, cache.v), pool_sharding)
  replicated = page_pool.replicated(pool_sharding.mesh)
  return tokens, logps, k, v, jax.lax.with_sharding_constraint(rng, replicated)


@dataclasses.dataclass(frozen=True)
class SamplerStats:
  """Counters since construction.

  Attributes:
    decode_steps, prefill_calls: jitted calls made.
    prefill_tokens: real (unpadded) tokens prefilled, recomputation included.
    recomputed_tokens: prefill tokens spent rebuilding KV of already-started sequences (after a
      preemption, or a kv_policy="recompute" weight swap).
    generated_tokens: tokens produced by decode steps.
    live_token_steps: sum over decode steps of the tokens held in KV by the active slots (what
      a step's attention reads; a feature of the measured cost model).
    finished, aborted: rollouts returned by `step` / `abort_all`.
    preemptions: times a running sequence lost its pages.
    weight_updates: weight swaps applied.
    slot_occupancy: mean over decode steps of active slots / num_slots.
    kv_utilization: mean over decode steps of tokens held in KV / pool capacity (P * S).
    kv_page_fill: mean over decode steps of tokens held in KV / capacity of allocated pages.
  """

  decode_steps: int = 0
  prefill_calls: int = 0
  prefill_tokens: int = 0
  recomputed_tokens: int = 0
  generated_tokens: int = 0
  live_token_steps: int = 0
  finished: int = 0
  aborted: int = 0
  preemptions: int = 0
  weight_updates: int = 0
  slot_occupancy: float = 0.0
  kv_utilization: float = 0.0
  kv_page_fill: float = 0.0


_AVERAGES = ("slot_occupancy", "kv_utilization", "kv_page_fill")


def _release(update: WeightUpdate | None, keep: Any = None) -> None:
  """Deletes the arrays of a donated update that are not also in `keep`."""
  if update is None or not update.donated:
    return
  kept = {id(x) for x in jax.tree.leaves(keep)}
  for x in jax.tree.leaves(update.params):
    if isinstance(x, jax.Array) and id(x) not in kept and not x.is_deleted():
      x.delete()


def _host_leaves(tree: Any) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _place_like(like: Any, leaves: list[np.ndarray]) -> Any:
  flat, treedef = jax.tree.flatten(like)
  if len(leaves) != len(flat):
    raise ValueError(f"sampler state holds {len(leaves)} parameter arrays, the running params "
                     f"{len(flat)}.")
  return jax.tree.unflatten(treedef, [jax.device_put(np.asarray(a), x.sharding)
                                      for a, x in zip(leaves, flat)])


def _check_same_layout(old, new):
  old_leaves, old_def = jax.tree_util.tree_flatten_with_path(old)
  new_leaves, new_def = jax.tree_util.tree_flatten_with_path(new)
  if old_def != new_def:
    raise ValueError(f"update_weights: parameter tree differs from the current one:\n{new_def}\n"
                     f"vs\n{old_def}")
  for (path, a), (_, b) in zip(old_leaves, new_leaves):
    name = jax.tree_util.keystr(path)
    if not isinstance(b, jax.Array):
      raise ValueError(f"update_weights: {name} is a {type(b).__name__}, not a jax.Array; place "
                       "the weights on the sampler mesh first (weight channel).")
    if a.shape != b.shape or a.dtype != b.dtype or a.sharding != b.sharding:
      raise ValueError(f"update_weights: {name} is {b.shape} {b.dtype} {b.sharding}, the running "
                       f"weights are {a.shape} {a.dtype} {a.sharding}; a different layout would "
                       "recompile the decode step.")


class SamplerEngine:
  """Paged-KV continuous-batching sampler.

  Args:
    model: the model (`rlax_pipe.model.Model`, or a `ModelConfig` of the built-in one).
    cfg: sampler configuration.
    params: initial weights, already placed on `mesh` (jax arrays), or a `WeightUpdate` (its
      version is used and its ownership passes to the engine).
    version: policy version of `params` (ignored for a `WeightUpdate`).
    mesh: sampler mesh; None = one device. The page pool is sharded over its "tp" axis by kv head.
    clock: seconds; defaults to `time.perf_counter` (pass a virtual clock to replay runs).
    on_span: optional hook `on_span(component, kind, start, end, slots_active, slots_total)`
      called with component "sampler" and kind "prefill" / "decode" (the engine then waits for
      each prefill to finish so spans are accurate).
    admit_filter: optional admission control `admit_filter(request) -> bool`, asked before a
      waiting request is started (e.g. the staleness `block` policy). Preempted sequences
      resume without asking. Also settable later as the `admit_filter` attribute.

  Raises:
    ValueError: if cfg.max_seq_len exceeds the model's, eos_id is outside the vocabulary, or
      "pallas_gpu" is requested off a one-device GPU mesh.

  Example:
    engine = SamplerEngine(model, SamplerConfig(eos_id=2), params)
    engine.submit(Request(prompt_tokens=np.array([1, 5, 7]), sample_id=0))
    rollouts = engine.run_to_completion()
  """

  def __init__(self, model: ModelLike, cfg: SamplerConfig, params: Any, *, version: int = 0,
               mesh=None, clock: Callable[[], float] = time.perf_counter,
               on_span: SpanHook | None = None,
               admit_filter: Callable[[Request], bool] | None = None):
    model = as_model(model)
    if cfg.max_seq_len > model.max_seq_len:
      raise ValueError(f"SamplerConfig.max_seq_len={cfg.max_seq_len} exceeds the model's "
                       f"max_seq_len={model.max_seq_len}.")
    if cfg.eos_id is not None and cfg.eos_id >= model.vocab_size:
      raise ValueError(f"SamplerConfig.eos_id={cfg.eos_id} is outside the vocabulary "
                       f"[0, {model.vocab_size}).")
    self.model, self.cfg = model, cfg
    self.mesh = page_pool.default_mesh() if mesh is None else mesh
    self.impl = resolve_impl(cfg.attention_impl, self.mesh)
    self.clock, self.on_span, self.admit_filter = clock, on_span, admit_filter
    self._pool_sharding = page_pool.pool_sharding(model, cfg, self.mesh)
    self._replicated = page_pool.replicated(self.mesh)
    self._k, self._v = page_pool.init_pool(model, cfg, self.mesh)
    self._rng = jax.device_put(jax.random.key(cfg.seed), self._replicated)
    if not isinstance(params, WeightUpdate):
      params = WeightUpdate(int(version), params)
    _check_same_layout(params.params, params.params)
    self._running: WeightUpdate = params
    self._pending: WeightUpdate | None = None
    self._lock = threading.Lock()        # guards _running / _pending
    self._step_lock = threading.Lock()   # held while a step (or a state read) runs
    self._alloc = PageAllocator(cfg.num_pages, cfg.page_size)
    self._sched = Scheduler(cfg.num_slots, self._alloc)
    self._uids = itertools.count()
    self._sums = dict.fromkeys(_AVERAGES, 0.0)
    self._counts = {f.name: 0 for f in dataclasses.fields(SamplerStats)
                    if f.name not in _AVERAGES}

  # --- public state -------------------------------------------------------------------------
  @property
  def _params(self) -> Any:
    return self._running.params

  @property
  def _version(self) -> int:
    return self._running.version

  @property
  def version(self) -> int:
    """Version of the weights the engine runs (a pending update not yet applied excluded)."""
    return self._running.version

  @property
  def latest_version(self) -> int:
    """Newest version handed to the engine: the pending update's, else the running one's."""
    with self._lock:
      return (self._running if self._pending is None else self._pending).version

  @property
  def num_active(self) -> int:
    """Sequences holding a decode slot."""
    return self._sched.num_active

  @property
  def num_waiting(self) -> int:
    """Sequences waiting for a slot (new, filtered out by admission control, or preempted)."""
    return len(self._sched.waiting)

  @property
  def has_work(self) -> bool:
    """Whether any request is unfinished (a pending weight swap alone is not work)."""
    return self.num_active > 0 or self.num_waiting > 0

  def stats(self) -> SamplerStats:
    """Counters and time averages (see `SamplerStats`)."""
    steps = max(self._counts["decode_steps"], 1)
    return SamplerStats(**self._counts, **{k: v / steps for k, v in self._sums.items()})

  # --- requests -----------------------------------------------------------------------------
  def submit(self, request: Request) -> None:
    """Queues a request.

    Raises:
      ValueError: prompt longer than max_seq_len - 1 (with overlong_prompt="error"), token ids
        outside the vocabulary, or a request whose longest sequence needs more pages than the
        pool has (the message names both numbers and the fix).
    """
    cfg, prompt = self.cfg, request.prompt_tokens
    limit = cfg.max_seq_len - 1
    if len(prompt) > limit:
      if cfg.overlong_prompt == "error":
        raise ValueError(
            f"request {request.sample_id}: prompt has {len(prompt)} tokens but max_seq_len="
            f"{cfg.max_seq_len} allows at most {limit} (one position is kept for the "
            "completion); shorten it, raise max_seq_len, or set overlong_prompt='truncate_left'.")
      prompt = prompt[-limit:]
    if prompt.min() < 0 or prompt.max() >= self.model.vocab_size:
      raise ValueError(f"request {request.sample_id}: token ids must be in [0, "
                       f"{self.model.vocab_size}), got [{prompt.min()}, {prompt.max()}].")
    budget = cfg.max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
    max_new = min(budget, cfg.max_seq_len - len(prompt))
    longest = len(prompt) + max_new - 1  # the last token is never fed back
    if cfg.pages_for(longest) > cfg.num_pages:
      raise ValueError(
          f"request {request.sample_id}: may hold {longest} tokens in KV = "
          f"{cfg.pages_for(longest)} pages of {cfg.page_size}, but the pool has only "
          f"{cfg.num_pages} pages; increase SamplerConfig.num_pages to at least "
          f"{cfg.pages_for(longest)} (or lower max_new_tokens / max_seq_len).")
    self._sched.enqueue(SequenceState(uid=next(self._uids), request=request, prompt=prompt,
                                      max_new=max_new, tokens=prompt.tolist(),
                                      t_submit=self.clock()))

  def update_weights(self, update: WeightUpdate) -> None:
    """Takes ownership of newer weights; they run from the next step boundary on.

    Thread-safe and non-blocking. Between steps the swap happens at once (and a donated older
    version is deleted); during a step (another thread) it waits for that step to end. If
    several arrive before a swap, the newest wins (an equal version replaces the pending one;
    a superseded donated update is deleted). Running sequences continue (kv_policy "keep": on
    their existing KV; "recompute": after re-prefilling their prefix).

    Raises:
      ValueError: if the version is not newer than the running one or older than the pending
        one, or the weights differ in tree, shape, dtype or sharding from the running ones (that
        would recompile).
    """
    _check_same_layout(self._params, update.params)
    with self._lock:
      pending = None if self._pending is None else self._pending.version
      if update.version <= self._running.version or (
          pending is not None and update.version < pending):
        raise ValueError(f"update_weights: version {update.version} is not newer than the "
                         f"running version {self._running.version} (pending: {pending}).")
      superseded, self._pending = self._pending, update
    _release(superseded, keep=update.params)
    if self._step_lock.acquire(blocking=False):  # between steps: swap now
      try:
        self._apply_pending_weights()
      finally:
        self._step_lock.release()

  def unfinished(self) -> dict[int, int | None]:
    """Every unfinished request (running or waiting): sample_id -> policy version of its first
    generated token (None before it has one)."""
    seqs = self._sched.running() + list(self._sched.waiting)
    return {s.request.sample_id: (s.versions[0] if s.versions else None) for s in seqs}

  def abort_all(self) -> list[Rollout]:
    """Stops everything; returns a Rollout with finish_reason "aborted" for every unfinished
    request (running ones with their tokens so far, waiting ones possibly empty)."""
    now = self.clock()
    out = [self._rollout(seq, "aborted", now) for seq in self._sched.drain()]
    self._counts["aborted"] += len(out)
    return out

  # --- stepping -----------------------------------------------------------------------------
  def step(self) -> list[Rollout]:
    """One scheduler iteration: swap weights if pending, reserve pages (preempting if short),
    admit waiting requests, prefill, then ONE decode step for all active slots.

    Returns:
      Rollouts that finished in this step.
    """
    with self._step_lock:
      return self._step()

  def _step(self) -> list[Rollout]:
    self._apply_pending_weights()
    preempted = self._sched.reserve_decode()
    self._counts["preemptions"] += len(preempted)
    if not preempted:  # under page pressure, let running sequences drain first
      for seq in self._sched.admit(self._may_admit):
        if not seq.started:
          seq.t_admit = self.clock()
    self._prefill()
    if self.num_active == 0:
      return []
    return self._decode()

  def run_to_completion(self, max_steps: int | None = None) -> list[Rollout]:
    """Steps until no work is left (or `max_steps`); returns rollouts in finishing order.

    Raises:
      RuntimeError: if nothing runs and admission control refuses every waiting request (the
        loop would never end).
    """
    out = []
    for _ in itertools.repeat(None) if max_steps is None else range(max_steps):
      if not self.has_work:
        break
      decodes = self._counts["decode_steps"]
      out.extend(self.step())
      if self._counts["decode_steps"] == decodes:  # nothing admitted, nothing running
        raise RuntimeError(f"run_to_completion: admit_filter refuses all {self.num_waiting} "
                           "waiting requests and nothing is running.")
    return out

  def warmup(self, max_prefill_len: int | None = None) -> None:
    """Compiles the decode step and the prefill buckets on all-padding inputs (no writes).

    Args:
      max_prefill_len: compile only the buckets up to the one holding this many tokens (e.g. the
        longest prompt); None = every bucket, so nothing (not even the long re-prefill of a
        preempted sequence) compiles later.
    """
    with self._step_lock:
      self._warmup(max_prefill_len)

  def _warmup(self, max_prefill_len: int | None) -> None:
    cfg, w = self.cfg, self.cfg.pages_per_seq
    top = cfg.max_seq_len if max_prefill_len is None else cfg.bucket_for(max_prefill_len)
    for bucket in (b for b in cfg.prefill_buckets if b <= top):
      zeros = np.zeros((cfg.prefill_rows, bucket), np.int32)
      args = jax.device_put((np.zeros((cfg.prefill_rows, w), np.int32), zeros,
                             np.zeros(cfg.prefill_rows, np.int32)), self._replicated)
      self._k, self._v = prefill_step(self._params, self._k, self._v, *args,
                                      model=self.model, pool_sharding=self._pool_sharding)
    slots = jax.device_put(np.zeros((cfg.num_slots, 3 + w), np.int32), self._replicated)
    rng = jax.device_put(jax.random.key(0), self._replicated)
    _, _, self._k, self._v, _ = self._decode_call(slots, rng)
    jax.block_until_ready(self._k)

  # --- state ---------------------------------------------------------------------------------
  def state_dict(self) -> dict:
    """The engine's whole state, for an exact resume: JSON-able values and numpy arrays.

    Keys: version, params (host arrays of the running weights, in leaf order), pending (None, or
    the version and params of an update not yet swapped in), k / v (KV pools), rng (PRNG key
    data), scheduler (`Scheduler.state_dict`), allocator (`PageAllocator.state_dict`), next_uid,
    sums, counts. Restoring it into an engine built with the same model, sampler config and
    mesh reproduces its future exactly: same tokens, log-probs, versions and timings.
    """
    with self._step_lock:
      with self._lock:
        running, pending = self._running, self._pending
      next_uid = next(self._uids)
      self._uids = itertools.count(next_uid)
      return {
          "version": running.version, "params": _host_leaves(running.params),
          "pending": None if pending is None else {
              "version": pending.version, "params": _host_leaves(pending.params)},
          "k": np.asarray(jax.device_get(self._k)), "v": np.asarray(jax.device_get(self._v)),
          "rng": np.asarray(jax.random.key_data(self._rng)),
          "scheduler": self._sched.state_dict(), "allocator": self._alloc.state_dict(),
          "next_uid": next_uid, "sums": dict(self._sums), "counts": dict(self._counts)}

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict` (same model, sampler config and mesh); weights are copied onto
    this engine's shardings and owned by it.

    Raises:
      ValueError: if the pool shape, the slot count or the parameter count differ.
    """
    if tuple(np.shape(state["k"])) != self._k.shape:
      raise ValueError(f"sampler state does not fit this engine: pool {np.shape(state['k'])} "
                       f"vs {self._k.shape}.")
    with self._step_lock:
      self._sched.load_state_dict(state["scheduler"])
      self._alloc.load_state_dict(state["allocator"])
      like = self._running.params
      running = WeightUpdate(int(state["version"]), _place_like(like, state["params"]), True)
      pending = state.get("pending")
      if pending is not None:
        pending = WeightUpdate(int(pending["version"]), _place_like(like, pending["params"]),
                               True)
      with self._lock:
        old, self._running, self._pending = self._running, running, pending
      _release(old)
      self._k = jax.device_put(state["k"], self._k.sharding)
      self._v = jax.device_put(state["v"], self._v.sharding)
      self._rng = jax.device_put(jax.random.wrap_key_data(state["rng"]), self._rng.sharding)
      self._uids = itertools.count(int(state["next_uid"]))
      self._sums = {k: float(v) for k, v in state["sums"].items()}
      self._counts.update({k: int(v) for k, v in state["counts"].items()})

  # --- internals ----------------------------------------------------------------------------
  def _may_admit(self, seq: SequenceState) -> bool:
    return seq.started or self.admit_filter is None or bool(self.admit_filter(seq.request))

  def _apply_pending_weights(self) -> None:
    """Swaps in the pending update (caller holds the step lock); releases the old version."""
    with self._lock:
      pending, self._pending = self._pending, None
      if pending is None:
        return
      old, self._running = self._running, pending
    _release(old, keep=pending.params)
    self._counts["weight_updates"] += 1
    if self.cfg.kv_policy == "recompute":
      for seq in self._sched.running():
        seq.num_cached = 0

  def _block_table(self, seq: SequenceState, out_row: np.ndarray) -> None:
    pages = self._alloc.pages_of(seq.uid)
    out_row[:len(pages)] = pages

  def _prefill(self) -> None:
    cfg, w = self.cfg, self.cfg.pages_per_seq
    calls = plan_prefill(self._sched.running(), cfg)
    if not calls:
      return
    start = self.clock()
    for bucket, rows in calls:
      tokens = np.zeros((cfg.prefill_rows, bucket), np.int32)
      lengths = np.zeros(cfg.prefill_rows, np.int32)
      tables = np.zeros((cfg.prefill_rows, w), np.int32)
      for r, seq in enumerate(rows):
        n = seq.prefill_len
        tokens[r, :n], lengths[r] = seq.tokens[:n], n
        self._block_table(seq, tables[r])
        self._counts["prefill_tokens"] += n
        if seq.num_generated > 0:
          self._counts["recomputed_tokens"] += n
        seq.num_cached = n
      args = jax.device_put((tables, tokens, lengths), self._replicated)
      self._k, self._v = prefill_step(self._params, self._k, self._v, *args,
                                      model=self.model, pool_sharding=self._pool_sharding)
      self._counts["prefill_calls"] += 1
    if self.on_span is not None:
      jax.block_until_ready(self._k)
      self.on_span("sampler", "prefill", start, self.clock(), self.num_active, cfg.num_slots)

  def _decode_call(self, slots_BX, rng):
    return decode_step(self._params, self._k, self._v, slots_BX, rng,
                       model=self.model, sampling=self.cfg.sampling, impl=self.impl,
                       pool_sharding=self._pool_sharding)

  def _decode(self) -> list[Rollout]:
    cfg, b = self.cfg, self.cfg.num_slots
    start = self.clock()
    slots = list(self._sched.slots)
    inputs = np.zeros((b, 3 + cfg.pages_per_seq), np.int32)
    live = 0
    for i, seq in enumerate(slots):
      if seq is not None:
        inputs[i, :3] = seq.tokens[-1], len(seq.tokens) - 1, 1
        self._block_table(seq, inputs[i, 3:])
        live += len(seq.tokens)
    n_active = b - slots.count(None)
    new_tokens, logps, self._k, self._v, self._rng = self._decode_call(
        jax.device_put(inputs, self._replicated), self._rng)
    new_tokens, logps = jax.device_get((new_tokens, logps))
    now, version = self.clock(), self._version
    self._counts["decode_steps"] += 1
    self._counts["generated_tokens"] += n_active
    self._counts["live_token_steps"] += live
    self._sums["slot_occupancy"] += n_active / b
    self._sums["kv_utilization"] += live / (cfg.num_pages * cfg.page_size)
    self._sums["kv_page_fill"] += live / max(self._alloc.num_used * cfg.page_size, 1)
    finished = []
    for i, seq in enumerate(slots):
      if seq is None:
        continue
      token = int(new_tokens[i])
      seq.tokens.append(token)
      seq.logprobs.append(float(logps[i]))
      seq.versions.append(version)
      seq.num_cached = len(seq.tokens) - 1
      if seq.num_generated == 1:
        seq.t_first_token = now
      reason = None
      if cfg.eos_id is not None and token == cfg.eos_id:
        reason = "eos"
      elif seq.num_generated >= seq.max_new or len(seq.tokens) >= cfg.max_seq_len:
        reason = "length"
      if reason is not None:
        self._sched.finish(seq)
        finished.append(self._rollout(seq, reason, now))
    self._counts["finished"] += len(finished)
    if self.on_span is not None:
      self.on_span("sampler", "decode", start, now, n_active, b)
    return finished

  def _rollout(self, seq: SequenceState, reason: str, now: float) -> Rollout:
    r = seq.request
    return Rollout(
        sample_id=r.sample_id, group_id=r.group_id, prompt_tokens=seq.prompt.copy(),
        completion_tokens=np.asarray(seq.tokens[len(seq.prompt):], np.int32),
        behavior_logprobs=np.asarray(seq.logprobs, np.float32),
        policy_versions=np.asarray(seq.versions, np.int32), finish_reason=reason,
        t_admit=seq.t_admit, t_first_token=seq.t_first_token, t_finish=now,
        num_preemptions=seq.num_preemptions, prompt_index=r.prompt_index)
