"""One data replica of the sampler: its slots, page pool, scheduler and device-resident state.

`SamplerEngine` owns one `EngineReplica` per index of the sampler mesh's "data" axis; each runs
on its own devices (the "tp" sub-mesh) with its own pool, so replicas decode disjoint sequences.
Per engine step a replica:

1. `prepare`: reserves pages (preempting if short), admits waiting sequences (sharing a group's
   prompt pages), grants look-ahead pages for the next K tokens, zeroes fresh pages when a
   kernel is in use, copies shared partial pages, prefills, and packs what the host changed
   (a slot-update matrix and block-table deltas) for the device;
2. `launch`: dispatches up to K decode steps (`device_loop.decode_dispatch`, asynchronous);
3. `collect`: ONE read-back (tokens, log-probs, counts), appends tokens, finds finished ones.

Host work per dispatch is O(slots changed + tokens generated): block tables are never rebuilt.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np

from rlax_pipe import host_rules
from rlax_pipe.model import Model
from rlax_pipe.sampler import device_loop
from rlax_pipe.sampler import page_pool
from rlax_pipe.sampler.config import SamplerConfig
from rlax_pipe.sampler.page_allocator import PageAllocator
from rlax_pipe.sampler.paged_cache import uses_combined_layout
from rlax_pipe.sampler.prompt_sharing import PromptSharing
from rlax_pipe.sampler.scheduler import Scheduler, SequenceState, plan_prefill

FLAG_ROW = device_loop.UPDATE_ROWS  # extra row of the update matrix: [0] = refill_at


def pow2_bucket(n: int, lo: int) -> int:
  """Smallest power of two >= max(n, lo)."""
  return max(lo, 1 << max(n - 1, 0).bit_length())


@functools.partial(jax.jit, static_argnames=("shape", "sharding"))
def _zeros(shape, sharding):
  return jax.lax.with_sharding_constraint(jnp.zeros(shape, jnp.int32), sharding)


@dataclasses.dataclass
class Launched:
  """A dispatch in flight: its device results and what the host needs to read them."""

  ints: Any
  logps: Any
  slots: list
  version: int
  lengths: np.ndarray  # sequence length of each slot at launch (0 = empty)
  used_tokens: int  # capacity of the pages in use at launch
  order: int = 0  # launch counter of the engine (the oldest dispatch is read back first)
  routes: Any = None  # MoE: int16 [K, B, L_moe, k] device routes of the dispatch, else None
  params: Any = None  # the weights passed to the compiled dispatch (the engine's weight check)


class EngineReplica:
  """Slots, pool and device state of one data replica (see module docstring).

  Args:
    model: the model; cfg: sampler configuration.
    mesh: this replica's mesh (a "tp" axis).
    impl: resolved attention implementation.
    interpret: run Pallas kernels in interpret mode (CPU tests).
    rng: this replica's sampling PRNG key.
  """

  def __init__(self, model: Model, cfg: SamplerConfig, mesh: Mesh, impl: str,
               interpret: bool, rng: jax.Array):
    self.model, self.cfg, self.mesh, self.impl, self.interpret = (
        model, cfg, mesh, impl, interpret)
    self.layout = page_pool.PoolLayout.of(model, cfg, combined=uses_combined_layout(impl),
                                          platform=mesh.devices.flat[0].platform)
    self.pool_sharding = self.layout.sharding(mesh)
    self.replicated = page_pool.replicated(mesh)
    self.pools = page_pool.init_pool(self.layout, mesh)
    self.width = cfg.table_width
    self.tables = _zeros((cfg.num_slots, self.width), self.replicated)
    self.state = jax.device_put(device_loop.SlotState.zeros(cfg.num_slots, rng), self.replicated)
    self.version = 0
    self.alloc = PageAllocator(cfg.num_pages, cfg.page_size, track_fresh=impl != "reference")
    self.sharing = PromptSharing(self.alloc, cfg.share_prompt_pages)
    self.sched = Scheduler(cfg.num_slots, self.alloc, self.sharing, version=lambda: self.version)
    self.counts = dict(prefill_calls=0, prefill_tokens=0, recomputed_tokens=0, preemptions=0,
                       shared_prompt_copies=0, continued_tokens=0)
    self.device_call_s = 0.0  # seconds inside jitted-program calls and uploads (see `_call`)
    self.inflight: Launched | None = None  # the dispatch launched and not yet read back
    self.steps_total = 0  # decode steps this replica ran
    self.mark_all_dirty()

  def _call(self, fn, *args, **kwargs):
    """Calls a device program (or upload) and adds its duration to `device_call_s`: on CPU a
    jitted call may run the program inline, so that time is device work, not host work."""
    t0 = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      self.device_call_s += time.perf_counter() - t0

  @property
  def static(self) -> dict:
    """Static arguments shared by the jitted device programs."""
    return dict(layout=self.layout, impl=self.impl, chunk_pages=self.cfg.chunk_pages,
                mesh=self.mesh if self.mesh.size > 1 else None, interpret=self.interpret)

  def mark_all_dirty(self) -> None:
    """Re-sends every slot and its whole block-table row at the next dispatch (after restore)."""
    self.sched.dirty.update(range(self.cfg.num_slots))
    for seq in self.sched.running():
      seq.table_cols = 0

  # --- host preparation -------------------------------------------------------------------
  def prepare(self, may_admit: Callable[[SequenceState], bool], now: float, params) -> list:
    """Pages, admission, look-ahead and prefill before a dispatch. Returns the preempted."""
    sched = self.sched
    preempted = sched.reserve_decode()
    self.counts["preemptions"] += len(preempted)
    if not preempted:  # under page pressure, let running sequences drain first
      for seq in sched.admit(may_admit):
        if not seq.started:
          seq.t_admit = now
    sched.look_ahead(self.cfg.decode_steps_per_dispatch)
    self._prefill(params)
    return preempted

  def _run_copies(self) -> None:
    copies = self.sharing.take_copies()
    if not copies:
      return
    n = pow2_bucket(len(copies), 8)
    src = np.zeros(n, np.int32)
    dst = np.full(n, self.cfg.num_pages, np.int32)
    src[:len(copies)], dst[:len(copies)] = zip(*copies)
    self.pools = self._call(
        lambda: page_pool.copy_pages(self.pools, *jax.device_put((src, dst), self.replicated),
                                     layout=self.layout, sharding=self.pool_sharding))
    self.counts["shared_prompt_copies"] += len(copies)

  def _zero_fresh(self) -> None:
    fresh = self.alloc.take_fresh()
    if not fresh:
      return
    n = pow2_bucket(len(fresh), 16)
    pages = np.full(n, self.cfg.num_pages, np.int32)
    pages[:len(fresh)] = fresh
    self.pools = self._call(
        lambda: device_loop.zero_pages(self.pools, jax.device_put(pages, self.replicated),
                                       layout=self.layout, sharding=self.pool_sharding))

  def _prefill(self, params) -> None:
    cfg = self.cfg
    self._zero_fresh()
    copied = False
    for bucket, rows in plan_prefill(self.sched.running(), cfg):
      if not copied and rows[0].num_cached > 0:
        self._run_copies()
        copied = True
      tokens = np.zeros((cfg.prefill_rows, bucket), np.int32)
      starts = np.zeros(cfg.prefill_rows, np.int32)
      lengths = np.zeros(cfg.prefill_rows, np.int32)
      tables = np.zeros((cfg.prefill_rows, self.width), np.int32)
      for r, seq in enumerate(rows):
        start, n = seq.num_cached, seq.prefill_len - seq.num_cached
        tokens[r, :n], starts[r], lengths[r] = seq.tokens[start:start + n], start, n
        tables[r] = self.alloc.block_table(seq.uid, self.width)
        self.counts["prefill_tokens"] += n
        if seq.num_generated > 0:  # below the KV computed before: recomputed; above: new context
          continued = max(0, start + n - max(seq.computed, start))
          self.counts["recomputed_tokens"] += n - continued
          self.counts["continued_tokens"] += continued
        seq.num_cached = seq.prefill_len
        seq.computed = max(seq.computed, seq.num_cached)
      self.pools = self._call(lambda: device_loop.prefill_step(
          params, self.pools, *jax.device_put((tables, tokens, starts, lengths), self.replicated),
          model=self.model, sharding=self.pool_sharding, **self.static))
      self.counts["prefill_calls"] += 1
    if not copied:
      self._run_copies()

  def _updates(self, queued: int = 0) -> tuple[np.ndarray, tuple | None]:
    """Slot-update matrix [UPDATE_ROWS + 1, B] and block-table deltas of the slots whose
    sequence changed (dirty) or whose pages grew since the device last saw them."""
    b, size = self.cfg.num_slots, self.cfg.page_size
    upd = np.zeros((FLAG_ROW + 1, b), np.int32)
    slots, cols, pages = [], [], []
    grown = {i for i, s in enumerate(self.sched.slots)
             if s is not None and self.alloc.num_pages_of(s.uid) != s.table_cols}
    for i in self.sched.dirty | grown:
      seq = self.sched.slots[i]
      upd[0, i] = 1
      if seq is None:
        continue
      held = self.alloc.pages_of(seq.uid)
      upd[1:6, i] = (seq.tokens[-1], len(seq.tokens) - 1, 1, seq.end, len(held) * size)
      new = held[seq.table_cols:]
      if new:
        slots.extend([i] * len(new))
        cols.extend(range(seq.table_cols, len(held)))
        pages.extend(new)
        seq.table_cols = len(held)
    self.sched.dirty.clear()
    waiting = len(self.sched.waiting) + queued
    upd[FLAG_ROW, 0] = host_rules.refill_at(waiting, b)  # refill freed slots in batches
    if not slots:
      return upd, None
    n = pow2_bucket(len(slots), 64)
    deltas = np.full((3, n), b, np.int32)
    deltas[:, :len(slots)] = (slots, cols, pages)
    return upd, tuple(deltas)

  # --- device dispatch --------------------------------------------------------------------
  def launch(self, params, model_sampling, queued: int = 0, nonfinite_V=None
             ) -> Launched | None:
    """Dispatches up to K decode steps for the running slots (asynchronous).

    Args:
      params: this replica's weights.
      model_sampling: the sampling configuration.
      queued: requests waiting at the engine level (not yet on a replica); with this replica's
        own waiting ones they decide how many finishes end the dispatch early.
      nonfinite_V: bool [V] ids never sampled (non-finite output-head columns of these params,
        computed once per version: `EngineWeights.masks`); None = computed in the dispatch.
    """
    slots = list(self.sched.slots)
    if all(s is None for s in slots):
      return None
    upd, deltas = self._updates(queued)
    if deltas is not None:
      self.tables = self._call(lambda: device_loop.write_tables(
          self.tables, *jax.device_put(deltas, self.replicated), replicated=self.replicated))
    self.pools, self.state, ints, logps, routes = self._call(lambda: device_loop.decode_dispatch(
        params, self.pools, self.tables, self.state,
        *jax.device_put((upd[:FLAG_ROW], upd[FLAG_ROW, 0]), self.replicated), nonfinite_V,
        model=self.model, sampling=model_sampling, stop_ids=self.cfg.stop_ids,
        steps=self.cfg.decode_steps_per_dispatch, sharding=self.pool_sharding,
        replicated=self.replicated, **self.static))
    lengths = np.array([0 if s is None else len(s.tokens) for s in slots], np.int64)
    used = max(self.alloc.num_used, 1) * self.cfg.page_size
    return Launched(ints, logps, slots, self.version, lengths, used, params=params,
                    routes=routes)

  def collect(self, launched: Launched, ints: np.ndarray, logps: np.ndarray, now: float,
              routes: np.ndarray | None = None) -> tuple[list[tuple[SequenceState, str]], dict]:
    """Appends a dispatch's tokens (read back by the caller in one transfer), and with an MoE
    model their routes [K, B, L_moe, k] (`rlax_pipe.router_replay`).

    Returns:
      ([(sequence, finish reason)] of the sequences that stopped, per-dispatch counters).
    """
    k = self.cfg.decode_steps_per_dispatch
    steps, count = int(ints[k + 1, 0]), ints[k]
    stop_set = set(self.cfg.stop_ids)
    finished = []
    for i in np.flatnonzero(count):
      seq, c = launched.slots[i], int(count[i])
      first = seq.num_generated == 0
      seq.tokens.extend(ints[:c, i].tolist())
      seq.logprobs.extend(logps[:c, i].tolist())
      if routes is not None:
        seq.routes.extend(routes[:c, i])
      seq.versions.extend([launched.version] * c)
      seq.mask.extend([1] * c)
      seq.num_cached = len(seq.tokens) - 1
      seq.computed = max(seq.computed, seq.num_cached)
      if first:
        seq.t_first_token = now
      reason = finish_reason(seq, stop_set)
      if reason is not None:
        if reason == "eos" and seq.request.multi_turn:
          self.sched.park(seq)  # its environment answers; the pages stay
        else:
          self.sched.finish(seq)
        finished.append((seq, reason))
    live = launched.lengths.astype(np.float64)
    c = count.astype(np.float64)
    live_token_steps = float(np.sum(c * live + c * (c - 1) / 2))
    stats = dict(steps=steps, tokens=int(count.sum()), live_token_steps=live_token_steps,
                 used_tokens=launched.used_tokens)
    return finished, stats


def finish_reason(seq: SequenceState, stop_set: set[int]) -> str | None:
  """Why a sequence stopped after its latest tokens, or None if it goes on.

  "eos": its last token is in the stop set; "length": it reached its completion budget;
  "capacity": it reached max_seq_len before its budget.
  """
  if seq.num_generated > 0 and seq.tokens[-1] in stop_set:
    return "eos"
  if len(seq.tokens) >= seq.end:
    return "length" if seq.max_new >= seq.budget else "capacity"
  return None
