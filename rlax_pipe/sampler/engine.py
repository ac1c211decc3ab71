"""`SamplerEngine`: continuous-batching generation over paged KV, K decode steps per dispatch.

A host-side shell over pure jitted programs (`device_loop`):
- prefill: computes the KV of whole prefixes (prompt + tokens generated so far, minus the
  pending last token; from a cached shared prompt on when a group shares it) and writes it into
  the sequences' pages; at admission, after a preemption, and under kv_policy="recompute" after
  a weight swap;
- decode dispatch: up to K = `decode_steps_per_dispatch` decode steps of every active slot in a
  device `while_loop`, drawing tokens through `rlax_pipe.logprobs.sample` (the same logit
  processing the learner scores with) and recording their behaviour log-probs (fp32).
Block tables, positions, active flags, stop lengths and the PRNG key live on the device; the
host sends what it changed and reads back once per dispatch. Every generated token is stamped
with the version of the weights its dispatch ran with; a weight swap handed over at any time
(from any thread, the caller never waits) lands at the next dispatch boundary, i.e. at most K
decode steps later. Shapes never depend on which requests run, so after `warmup()` admissions,
finishes, preemptions and weight swaps (same shapes/shardings) do not compile.

Data replicas: the sampler mesh's "data" axis means disjoint slot sets. The engine runs one
`EngineReplica` (own slots, own page pool) per data index on that index's "tp" sub-mesh,
dispatches them all before reading any back. New requests wait in one engine-level FIFO and are
handed to the replica with the most free slots when it has room (so replicas stay balanced);
every sample of a group goes to its group's replica (so the group shares its prompt pages).
`num_slots` and `num_pages` are per replica.

Stopping (`Rollout.finish_reason`): "eos" on any id of the stop set (`SamplerConfig.eos_id`;
kept as the completion's last token, nothing after it is sampled), "length" at the request's
completion budget, "capacity" when prompt + completion reaches max_seq_len first, "aborted" by
`abort` / `abort_all`.

Multi-turn episodes (`Request.multi_turn`, driven by `rlax_pipe.envs`): a turn that ends on a
stop id is returned by `step` as a Rollout with finish_reason "eos" (the episode so far) while
the sequence waits, parked: its slot is free for others, its pages are kept. The caller then
either appends the environment's tokens with `continue_sequence` (a prefill continuation onto the
existing pages: only the new tokens are prefilled, counted in `continued_tokens`; decoding goes
on from there) or ends the episode with `end_sequence`. kv_policy keeps its meaning across the
wait: "keep" continues on the parked KV, "recompute" drops a parked sequence's pages when the
weights change so that its prefix is prefilled under the new ones. Under page pressure parked
sequences give their pages back first (their prefix is prefilled again when they continue).
`abort`, `abort_all`, `unfinished`, `state_dict` / `load_state_dict` include parked sequences.

Weights arrive as `WeightUpdate` messages and the engine owns them from then on (`weights`): a
donated version's arrays are deleted once a newer version replaced it and no dispatch still
uses it. An update is applied at the next step boundary, i.e. at once when the engine is between
steps (replicas switch at their next dispatch).

Timings come from an injectable `clock` (seconds), so a pipeline can drive a virtual clock.
Threading: `update_weights` may be called from any thread (it never waits for a running step);
everything else (`submit`, `step`, `state_dict`, ...) from one thread, the engine's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from rlax_pipe import sharding as sharding_lib
from rlax_pipe.model import ModelLike, as_model
from rlax_pipe.sampler import (
    device_loop, engine_state, episodes, page_pool, rollouts, weight_check)
from rlax_pipe.sampler.config import Request, SamplerConfig
from rlax_pipe.sampler.paged_cache import reference_only_reason, resolve_impl
from rlax_pipe.sampler.replica import EngineReplica
from rlax_pipe.sampler.scheduler import SequenceState
from rlax_pipe.sampler.weights import EngineWeights
from rlax_pipe.types import Rollout, WeightUpdate

# on_span(component, kind, start_s, end_s, slots_active, slots_total)
SpanHook = Callable[[str, str, float, float, int, int], None]


@dataclasses.dataclass(frozen=True)
class SamplerStats:
  """Counters since construction (summed over replicas).

  Attributes:
    decode_steps: decode steps run (a dispatch of n steps counts n). Replicas decode
      concurrently on their own devices, so this is the most steps any replica has run (the
      critical path); generated_tokens / decode_steps = sequences advanced per decode step.
    dispatches: decode dispatches read back (all replicas).
    host_syncs: blocking device-to-host reads (at most one per engine step).
    host_s: seconds of host work in `step`: its wall time minus the blocking reads and minus
      the calls of jitted device programs and uploads (`device_call_s`; on CPU such a call may
      run the program inline). Scheduling, page bookkeeping, packing updates, appending tokens.
    device_call_s: seconds inside calls of jitted device programs and uploads.
    prefill_calls: jitted prefill calls made.
    prefill_tokens: real (unpadded) tokens prefilled, recomputation included.
    recomputed_tokens: prefill tokens spent rebuilding KV of already-started sequences (after a
      preemption, or a kv_policy="recompute" weight swap).
    continued_tokens: prefill tokens appended to a multi-turn episode's KV by
      `continue_sequence` (environment tokens, plus the model's stop token of the turn before).
    shared_prompt_copies: partial prompt pages copied for samples sharing a group's prompt.
    generated_tokens: tokens produced by decode steps.
    live_token_steps: sum over decode steps of the tokens held in KV by the active slots (what
      a step's attention reads; a feature of the measured cost model, `rlax_pipe.costs`).
    finished, aborted: rollouts returned by `step` / `abort` / `abort_all`.
    preemptions: times a running sequence lost its pages.
    parked_evictions: times a parked episode (waiting on its environment) lost its pages.
    weight_updates: weight swaps applied.
    slot_occupancy: generated tokens / (decode_steps * slots of all replicas).
    kv_utilization: mean over decode steps of tokens held in KV / pool capacity (P * S).
    kv_page_fill: mean over decode steps of tokens held in KV / capacity of allocated pages
      (look-ahead pages included).
  """

  decode_steps: int = 0
  dispatches: int = 0
  host_syncs: int = 0
  host_s: float = 0.0
  device_call_s: float = 0.0
  prefill_calls: int = 0
  prefill_tokens: int = 0
  recomputed_tokens: int = 0
  continued_tokens: int = 0
  parked_evictions: int = 0
  shared_prompt_copies: int = 0
  generated_tokens: int = 0
  live_token_steps: int = 0
  finished: int = 0
  aborted: int = 0
  preemptions: int = 0
  weight_updates: int = 0
  slot_occupancy: float = 0.0
  kv_utilization: float = 0.0
  kv_page_fill: float = 0.0


_REPLICA_COUNTS = ("prefill_calls", "prefill_tokens", "recomputed_tokens", "preemptions",
                   "shared_prompt_copies", "continued_tokens")


class SamplerEngine(weight_check.CheckedWeights, engine_state.SamplingKeys,
                    episodes.ParkedEpisodes):
  """Paged-KV continuous-batching sampler (see module docstring).

  Args:
    model: the model (`rlax_pipe.model.Model`, or a `ModelConfig` of the built-in one).
    cfg: sampler configuration (slots and pages per data replica).
    params: initial weights, already placed on `mesh` (jax arrays), or a `WeightUpdate` (its
      version is used and its ownership passes to the engine).
    version: policy version of `params` (ignored for a `WeightUpdate`).
    mesh: sampler mesh; None = one device. Axes "data" (replicas) and "tp" (the pool's kv
      heads; kernels run under shard_map over it).
    clock: seconds; defaults to `time.perf_counter` (pass a virtual clock to replay runs).
    on_span: optional hook `on_span(component, kind, start, end, slots_active, slots_total)`
      called with component "sampler" and kind "prefill" / "decode" (the engine then waits for
      each prefill to finish so spans are accurate).
    admit_filter: optional admission control `admit_filter(request) -> bool`, asked before a
      waiting request is started (e.g. the staleness `block` policy). Preempted sequences
      resume without asking. Also settable later as the `admit_filter` attribute.
    interpret_kernels: run a Pallas `attention_impl` in interpret mode on any platform (tests).

  Raises:
    ValueError: if cfg.max_seq_len exceeds the model's, a stop id is outside the vocabulary, or
      a Pallas kernel is requested on a platform that cannot run it.

  Example:
    engine = SamplerEngine(model, SamplerConfig(eos_id=2), params)
    engine.submit(Request(prompt_tokens=np.array([1, 5, 7]), sample_id=0))
    rollouts = engine.run_to_completion()
  """

  def __init__(self, model: ModelLike, cfg: SamplerConfig, params: Any, *, version: int = 0,
               mesh=None, clock: Callable[[], float] = time.perf_counter,
               on_span: SpanHook | None = None,
               admit_filter: Callable[[Request], bool] | None = None,
               interpret_kernels: bool = False):
    model = as_model(model)
    if cfg.max_seq_len > model.max_seq_len:
      raise ValueError(f"SamplerConfig.max_seq_len={cfg.max_seq_len} exceeds the model's "
                       f"max_seq_len={model.max_seq_len}.")
    bad = [i for i in cfg.stop_ids if i >= model.vocab_size]
    if bad:
      raise ValueError(f"SamplerConfig.eos_id: stop ids {bad} are outside the vocabulary "
                       f"[0, {model.vocab_size}).")
    excluded = cfg.sampling.excluded_ids
    if any(i >= model.vocab_size for i in excluded) or set(excluded) & set(cfg.stop_ids):
      raise ValueError(f"SamplerConfig.sampling.excluded_ids={excluded} must be ids in [0, "
                       f"{model.vocab_size}) and hold no stop id (stop ids: {cfg.stop_ids}); "
                       "an excluded id is never sampled.")
    self.model, self.cfg = model, cfg
    self.mesh = page_pool.default_mesh() if mesh is None else mesh
    self.clock, self.on_span, self.admit_filter = clock, on_span, admit_filter
    reason = reference_only_reason(model)
    self.impl = cfg.attention_impl if (
        interpret_kernels and cfg.attention_impl != "auto" and reason is None) else (
        resolve_impl(cfg.attention_impl, self.mesh, model.head_dim, reference_reason=reason))
    self.meshes = sharding_lib.replica_meshes(self.mesh)
    keys = jax.random.split(jax.random.key(cfg.seed), len(self.meshes))
    self.replicas = [EngineReplica(model, cfg, m, self.impl, interpret_kernels, keys[i])
                     for i, m in enumerate(self.meshes)]
    if not isinstance(params, WeightUpdate):
      params = WeightUpdate(int(version), params)
    masks = [device_loop.head_mask_program(model, r.replicated) for r in self.replicas]
    self.weights = EngineWeights(params, self.meshes, head_mask=(
        None if masks[0] is None else lambda view, i: masks[i](view)))
    for r in self.replicas:
      r.version = params.version
    self._step_lock = threading.Lock()  # held while a step (or a state read) runs
    self.book = engine_state.EngineBook()  # queue, counters, group placement, buffered rollouts
    self._weight_check = weight_check.WeightCheck()  # running weights vs the learner's
    self._weight_check.expect(self.weights.running)

  # --- public state -------------------------------------------------------------------------
  @property
  def version(self) -> int:
    """Version of the weights the engine runs (a pending update not yet applied excluded)."""
    return self.weights.version

  @property
  def latest_version(self) -> int:
    """Newest version handed to the engine: the pending update's, else the running one's."""
    return self.weights.latest_version

  @property
  def num_active(self) -> int:
    """Sequences holding a decode slot (all replicas)."""
    return sum(r.sched.num_active for r in self.replicas)

  @property
  def num_waiting(self) -> int:
    """Sequences waiting for a slot (new, filtered out by admission control, or preempted)."""
    return len(self.book.queue) + sum(len(r.sched.waiting) for r in self.replicas)

  @property
  def num_slots(self) -> int:
    """Decode slots of all replicas."""
    return self.cfg.num_slots * len(self.replicas)

  @property
  def has_work(self) -> bool:
    """Whether any request needs decoding (a pending weight swap alone is not work, nor are
    parked episodes: they wait for `continue_sequence`)."""
    return self.num_active > 0 or self.num_waiting > 0

  def stats(self) -> SamplerStats:
    """Counters and time averages (see `SamplerStats`)."""
    steps = max(self.book.counts["decode_steps"], 1)
    counts = dict(self.book.counts)
    for name in _REPLICA_COUNTS:
      counts[name] = sum(r.counts.get(name, 0) for r in self.replicas)
    counts["parked_evictions"] = sum(r.sched.parked_evictions for r in self.replicas)
    return SamplerStats(
        **counts, host_s=self.book.host_s,
        device_call_s=sum(r.device_call_s for r in self.replicas),
        slot_occupancy=counts["generated_tokens"] / (steps * self.num_slots),
        **{k: v / steps for k, v in self.book.sums.items()})

  # --- requests -----------------------------------------------------------------------------
  def submit(self, request: Request) -> None:
    """Queues a request (on the replica of its group, else the least loaded one).

    Raises:
      ValueError: prompt longer than max_seq_len - 1 (over-long prompts are filtered or
        truncated, keeping BOS and the head, before sampling: `rlax_pipe.grading`), token ids
        outside the vocabulary, or a request whose longest sequence needs more pages than the
        pool has (the message names both numbers and the fix).
    """
    cfg, prompt = self.cfg, request.prompt_tokens
    limit = cfg.max_seq_len - 1
    if len(prompt) > limit:
      raise ValueError(
          f"request {request.sample_id}: prompt has {len(prompt)} tokens but max_seq_len="
          f"{cfg.max_seq_len} allows at most {limit} (one position is kept for the "
          "completion); shorten it, raise max_seq_len, or filter / truncate it before "
          "sampling (GradingConfig.prompt_policy 'filter' or 'truncate', which keeps BOS and "
          "the head and reserves a completion budget).")
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
    key = (int(request.group_id), hashlib.blake2b(prompt.tobytes(), digest_size=8).hexdigest())
    seq = SequenceState(uid=self.book.new_uid(), request=request, prompt=prompt, max_new=max_new,
                        budget=budget, tokens=prompt.tolist(), t_submit=self.clock(),
                        share_key=key)
    self.book.queue.append(seq)
    if len(self.replicas) == 1:
      self._distribute()

  def _distribute(self) -> None:
    """Hands queued requests (FIFO) to replicas: a group's replica if it has one, else the
    replica with the most free slots, while some replica has a free slot for it."""
    while self.book.queue:
      seq = self.book.queue[0]
      entry = self.book.group_replica.get(seq.share_key)
      if entry is None:
        room = [r.cfg.num_slots - r.sched.num_active - len(r.sched.waiting)
                for r in self.replicas]
        best = int(np.argmax(room))
        if room[best] <= 0 and len(self.replicas) > 1:
          return
        entry = self.book.group_replica[seq.share_key] = [best, 0]
      entry[1] += 1
      self.replicas[entry[0]].sched.enqueue(self.book.queue.popleft())

  def _forget(self, seq: SequenceState) -> None:
    entry = self.book.group_replica.get(seq.share_key)
    if entry is not None:
      entry[1] -= 1
      if entry[1] <= 0:
        del self.book.group_replica[seq.share_key]

  def update_weights(self, update: WeightUpdate) -> None:
    """Takes ownership of newer weights; they run from the next dispatch boundary on.

    Thread-safe and non-blocking. Between steps the swap happens at once (a donated older
    version is deleted once no dispatch in flight uses it); during a step (another thread) it
    stays pending until the next step starts. If several arrive before a swap, the newest wins
    (an equal version replaces the pending one; a superseded donated update is deleted). Running
    sequences continue (kv_policy "keep": on their existing KV; "recompute": after re-prefilling
    their prefix with the new weights).

    Raises:
      ValueError: if the version is not newer than the running one or older than the pending
        one, or the weights differ in tree, shape, dtype or sharding from the running ones (that
        would recompile).
    """
    self.weights.update_weights(update)
    if self._step_lock.acquire(blocking=False):  # between steps: swap now
      try:
        self._apply_pending_weights()
      finally:
        self._step_lock.release()

  def abort(self, sample_id: int) -> Rollout | None:
    """Stops one request (running or waiting) and returns its Rollout with finish_reason
    "aborted" (tokens so far), or None if no unfinished request has that sample_id."""
    with self._step_lock:
      return self._abort(sample_id)

  def _abort(self, sample_id: int) -> Rollout | None:
    self._settle()
    for seq in self.book.queue:
      if seq.request.sample_id == sample_id:
        self.book.queue.remove(seq)
        self.book.counts["aborted"] += 1
        return self._rollout(seq, "aborted", self.clock())
    for r in self.replicas:
      for seq in r.sched.running() + list(r.sched.waiting) + list(r.sched.parked.values()):
        if seq.request.sample_id == sample_id:
          r.sched.remove(seq)
          self._forget(seq)
          self.book.counts["aborted"] += 1
          return self._rollout(seq, "aborted", self.clock())
    return None

  def unfinished(self) -> dict[int, int | None]:
    """Every unfinished request (queued, waiting or running; dispatches in flight count as
    running): sample_id -> policy version of its first generated token (None before it has
    one). For the rollout worker's lost-sample check and in-flight staleness aborts."""
    with self._step_lock:
      seqs = list(self.book.queue)
      for r in self.replicas:
        seqs += r.sched.running() + list(r.sched.waiting) + list(r.sched.parked.values())
      return {s.request.sample_id: (s.versions[0] if s.versions else None) for s in seqs}

  def abort_all(self) -> list[Rollout]:
    """Stops everything; returns a Rollout with finish_reason "aborted" for every unfinished
    request (running ones with their tokens so far, waiting ones possibly empty), after any
    rollouts that finished in dispatches still in flight (with their own finish reasons)."""
    with self._step_lock:
      return self._abort_all()

  def _abort_all(self) -> list[Rollout]:
    self._settle()
    now = self.clock()
    out, self.book.buffer = self.book.buffer, []
    for r in self.replicas:
      for seq in r.sched.drain():
        self._forget(seq)
        out.append(self._rollout(seq, "aborted", now))
    out.extend(self._rollout(seq, "aborted", now) for seq in self.book.queue)
    self.book.queue.clear()
    self.book.counts["aborted"] += sum(1 for x in out if x.finish_reason == "aborted")
    return out

  # --- stepping -----------------------------------------------------------------------------
  def step(self) -> list[Rollout]:
    """One engine step: swap weights if pending; every replica without a dispatch in flight
    reserves pages (preempting if short), admits waiting requests, prefills and dispatches up to
    K decode steps; then ONE blocking read-back: the oldest dispatch in flight.

    With one replica that is the dispatch just launched. With several, replicas run
    concurrently: each is read back in turn (round robin, deterministic) and relaunched at once,
    so none waits for the others' dispatches.

    Returns:
      Rollouts that finished in this step (plus any collected by `settle`).
    """
    with self._step_lock:
      return self._step()

  def _step(self) -> list[Rollout]:
    t_start, waited = time.perf_counter(), 0.0
    calls_before = sum(r.device_call_s for r in self.replicas)
    self._apply_pending_weights()
    start = self.clock()
    calls = sum(r.counts["prefill_calls"] for r in self.replicas)
    self._distribute()
    idle = [(r, p, m) for r, p, m in zip(self.replicas, self.weights.views, self.weights.masks)
            if r.inflight is None]
    for r, params, _ in idle:
      self._adopt_version(r)
      r.prepare(self._may_admit, start, params)
    if self.on_span is not None and sum(r.counts["prefill_calls"] for r in self.replicas) > calls:
      t0 = time.perf_counter()
      jax.block_until_ready([r.pools for r in self.replicas])
      waited += time.perf_counter() - t0
      self.on_span("sampler", "prefill", start, self.clock(), self.num_active, self.num_slots)
      start = self.clock()
    for r, params, mask in idle:
      r.inflight = r.launch(params, self.cfg.sampling, queued=len(self.book.queue), nonfinite_V=mask)
      if r.inflight is not None:
        r.inflight.order, self.book.launches = self.book.launches, self.book.launches + 1
        # the weight check reads what this dispatch was given, not what the engine stores
        self._weight_check.observe(self.replicas.index(r), r.inflight.version,
                                   r.inflight.params)
    finished, self.book.buffer = self.book.buffer, []
    flying = [r for r in self.replicas if r.inflight is not None]
    if flying:
      oldest = min(flying, key=lambda r: r.inflight.order)
      waited += self._collect([oldest], finished, start)
    self._add_host_time(t_start, waited, calls_before)
    return finished

  def settle(self) -> None:
    """Reads back every dispatch in flight (their finished rollouts are returned by the next
    `step`), so that the host state is complete: before a snapshot, an abort or a warm-up."""
    with self._step_lock:
      self._settle()

  def _settle(self) -> None:
    flying = sorted((r for r in self.replicas if r.inflight is not None),
                    key=lambda r: r.inflight.order)
    if flying:
      self._collect(flying, self.book.buffer, self.clock())

  def _collect(self, replicas: list[EngineReplica], finished: list[Rollout], start: float
               ) -> float:
    """One blocking read of `replicas`' dispatches; appends finished rollouts. Returns the
    seconds spent waiting for the device."""
    t0 = time.perf_counter()
    results = jax.device_get([(r.inflight.ints, r.inflight.logps, r.inflight.routes)
                              for r in replicas])
    waited = time.perf_counter() - t0
    now = self.clock()
    tokens = n_done = live_steps = 0
    for r, (ints, logps, routes) in zip(replicas, results):
      launched, r.inflight = r.inflight, None
      done, st = r.collect(launched, ints, logps, now, routes)
      r.steps_total += st["steps"]
      tokens += st["tokens"]
      live_steps += round(st["live_token_steps"])
      self.book.sums["kv_utilization"] += st["live_token_steps"] / (
          self.cfg.num_pages * self.cfg.page_size * len(self.replicas))
      self.book.sums["kv_page_fill"] += st["live_token_steps"] / (
          st["used_tokens"] * len(self.replicas))
      n_done += sum(seq.uid not in r.sched.parked for seq, _ in done)
      for seq, reason in done:
        if seq.uid not in r.sched.parked:  # a parked episode stays on its replica
          self._forget(seq)
        finished.append(self._rollout(seq, reason, now))
      if self.on_span is not None:
        self.on_span("sampler", "decode", start, now, st["tokens"] // max(st["steps"], 1),
                     self.num_slots)
    c = self.book.counts
    c["decode_steps"] = max(r.steps_total for r in self.replicas)
    c["dispatches"] += len(replicas)
    c["host_syncs"] += 1
    c["generated_tokens"] += tokens
    c["live_token_steps"] += live_steps
    c["finished"] += n_done
    self._release_retired()
    self._weight_check.finish()
    return waited

  def _add_host_time(self, t_start: float, waited: float, calls_before: float) -> None:
    calls = sum(r.device_call_s for r in self.replicas) - calls_before
    self.book.host_s += time.perf_counter() - t_start - waited - calls

  def run_to_completion(self, max_steps: int | None = None) -> list[Rollout]:
    """Steps until no work is left (or `max_steps` engine steps); returns rollouts in
    finishing order.

    Raises:
      RuntimeError: if nothing runs and admission control refuses every waiting request (the
        loop would never end).
    """
    out = []
    for _ in itertools.repeat(None) if max_steps is None else range(max_steps):
      if not self.has_work:
        break
      dispatches = self.book.counts["dispatches"]
      out.extend(self.step())
      if self.book.counts["dispatches"] == dispatches:  # nothing admitted, nothing running
        raise RuntimeError(f"run_to_completion: admit_filter refuses all {self.num_waiting} "
                           "waiting requests and nothing is running.")
    return out

  def warmup(self, max_prefill_len: int | None = None) -> None:
    """Compiles every program a run can call, on all-padding inputs (no writes, no tokens).

    Raises:
      RuntimeError: if sequences are already running.

    Args:
      max_prefill_len: compile only the prefill buckets up to the one holding this many tokens
        (e.g. the longest prompt); None = every bucket, so nothing (not even the long re-prefill
        of a preempted sequence) compiles later.
    """
    with self._step_lock:
      self._warmup(max_prefill_len)

  def _warmup(self, max_prefill_len: int | None) -> None:
    from rlax_pipe.sampler import warmup as warmup_lib  # pylint: disable=import-outside-toplevel
    if self.num_active or any(r.inflight is not None for r in self.replicas):
      raise RuntimeError("warmup: call it before sequences are running (it dispatches idle "
                         "decode steps).")
    for r, params, mask in zip(self.replicas, self.weights.views, self.weights.masks):
      warmup_lib.compile_replica(r, params, self.cfg, max_prefill_len, nonfinite_V=mask)

  # --- state ---------------------------------------------------------------------------------
  def state_dict(self) -> dict:
    """The engine's whole state, for an exact resume: JSON-able values and numpy arrays
    (`engine_state`). Dispatches in flight are read back first; rollouts they finished stay
    buffered (in the state too) and are returned by the next `step`."""
    with self._step_lock:
      self._settle()
      return engine_state.state_dict(self)

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict` (same model, sampler config and mesh); weights are copied onto
    this engine's shardings and owned by it.

    Raises:
      ValueError: if the replica count, a pool shape, the slot count or the parameter count
        differ.
    """
    with self._step_lock:
      self._settle()
      engine_state.load_state_dict(self, state)

  # --- internals ----------------------------------------------------------------------------
  def _may_admit(self, seq: SequenceState) -> bool:
    return seq.started or self.admit_filter is None or bool(self.admit_filter(seq.request))

  def _apply_pending_weights(self) -> None:
    """Swaps in the pending update (caller holds the step lock); its dispatches are checked."""
    self._weight_check.finish()  # started at an earlier step: its result is there by now
    if self.weights.pending is not None:  # the outgoing version, where no dispatch ran it
      self._check_undispatched()
    if self.weights.swap():
      self.book.counts["weight_updates"] += 1
      self._weight_check.expect(self.weights.running)
    self._release_retired()

  def _release_retired(self) -> None:
    self.weights.release_retired(r.inflight.version for r in self.replicas
                                 if r.inflight is not None)

  def _adopt_version(self, r: EngineReplica) -> None:
    """A replica between dispatches switches to the engine's version: prompt entries of older
    weights are dropped, and under kv_policy="recompute" running sequences lose their pages
    (their prefix is prefilled again with the new weights before the next dispatch)."""
    version = self.weights.version
    if r.version == version:
      return
    r.version = version
    r.sharing.invalidate(version)
    if self.cfg.kv_policy == "recompute":
      for seq in r.sched.running():
        r.sched.drop_pages(seq)
      r.sched.release_idle_pages()

  def _rollout(self, seq: SequenceState, reason: str, now: float) -> Rollout:
    return rollouts.make_rollout(self.model, seq, reason, now)
