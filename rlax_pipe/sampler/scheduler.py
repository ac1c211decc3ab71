"""Continuous-batching scheduler of one replica: slots, waiting queue, pages, preemption.

Host-side only (no JAX). The replica calls, once per dispatch of K decode steps:
  1. `reserve_decode()`: every running sequence gets pages for the token it feeds next (a
     sequence whose pages were dropped by a recompute swap gets its whole prefix, shared with
     its group when possible); when the pool runs out, the most recently admitted running
     sequence is preempted (its pages freed, its tokens kept) and re-queued at the front of the
     waiting queue (LIFO victims, as vLLM).
  2. `admit(may_admit)`: waiting sequences fill free slots in FIFO order while the pool holds
     their prefix (prompt + tokens generated so far; a group's prompt pages are shared).
  3. `look_ahead(k)`: running sequences get pages for up to k more tokens where the pool allows,
     so a dispatch rarely stops at a page boundary.
  4. `plan_prefill(...)`: sequences whose KV is missing are grouped into prefill calls.
  5. after the dispatch, `finish(seq)` for sequences that stopped; `remove(seq)` aborts one.

State of one sequence between dispatches: `tokens` = prompt + generated; KV holds positions
[0, num_cached); the last token is "pending" (fed at position len(tokens) - 1). A running
sequence is ready to decode when num_cached == len(tokens) - 1.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Hashable, Iterable

import numpy as np

from rlax_pipe.sampler.config import Request, SamplerConfig
from rlax_pipe.sampler.page_allocator import PageAllocator, key_from_json, key_to_json
from rlax_pipe.sampler.prompt_sharing import PromptSharing


@dataclasses.dataclass(eq=False)
class SequenceState:
  """Host-side state of one request (mutable; owned by the engine).

  Attributes:
    uid: engine-internal unique id (page holder key).
    request: the submitted request.
    prompt: int32[P] prompt actually used (after any left truncation).
    max_new: completion budget in tokens, capped by max_seq_len.
    budget: the budget asked for (request or config default), before the cap; a sequence that
      stops at max_new < budget stopped on capacity, not on its budget.
    tokens: prompt + generated token ids.
    logprobs: behaviour log-prob of each generated token.
    versions: policy version of each generated token.
    routes: MoE models: per generated token, int [L_moe, k] the experts of the decode step
      that produced it (`rlax_pipe.router_replay`); empty for a dense model.
    t_submit, t_admit, t_first_token: clock readings in seconds (NaN until they happen;
      t_admit is the first admission).
    num_preemptions: times the sequence lost its pages.
    slot: decode slot, or -1 while waiting.
    num_cached: KV positions [0, num_cached) are valid in the sequence's pages.
    admit_order: admission counter of the current residency (larger = admitted later).
    share_key: group key for shared prompt pages (None = not shared).
    table_cols: block-table columns of this sequence the device already holds.
  """

  uid: int
  request: Request
  prompt: np.ndarray
  max_new: int
  tokens: list[int]
  budget: int = 0
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  routes: list = dataclasses.field(default_factory=list)  # MoE: [L_moe, k] per token
  t_submit: float = math.nan
  t_admit: float = math.nan
  t_first_token: float = math.nan
  num_preemptions: int = 0
  slot: int = -1
  num_cached: int = 0
  admit_order: int = -1
  share_key: Hashable | None = None
  table_cols: int = 0

  @property
  def num_generated(self) -> int:
    """Completion tokens so far."""
    return len(self.tokens) - len(self.prompt)

  @property
  def end(self) -> int:
    """Sequence length (prompt + completion) at which the sequence stops on length."""
    return len(self.prompt) + self.max_new

  @property
  def started(self) -> bool:
    """Whether the sequence has been admitted at least once."""
    return not math.isnan(self.t_admit)

  @property
  def prefill_len(self) -> int:
    """Tokens whose KV must be cached before decoding: all but the pending last token."""
    return len(self.tokens) - 1

  @property
  def needs_prefill(self) -> bool:
    """Whether some of the prefix's KV is missing (new, resumed, or recompute after a swap)."""
    return self.num_cached < self.prefill_len

  def to_dict(self) -> dict:
    """JSON-able copy (NaN times as None; table_cols is device bookkeeping, not saved)."""
    num = lambda x: None if math.isnan(x) else float(x)
    r = self.request
    return {
        "uid": self.uid, "max_new": self.max_new, "budget": self.budget,
        "tokens": [int(t) for t in self.tokens], "prompt": self.prompt.tolist(),
        "logprobs": [float(x) for x in self.logprobs], "versions": [int(v) for v in self.versions],
        "routes": [np.asarray(r).tolist() for r in self.routes],
        "t_submit": num(self.t_submit), "t_admit": num(self.t_admit),
        "t_first_token": num(self.t_first_token), "num_preemptions": self.num_preemptions,
        "slot": self.slot, "num_cached": self.num_cached, "admit_order": self.admit_order,
        "share_key": key_to_json(self.share_key),
        "request": {"prompt_tokens": r.prompt_tokens.tolist(), "sample_id": r.sample_id,
                    "group_id": r.group_id, "prompt_index": r.prompt_index,
                    "max_new_tokens": r.max_new_tokens},
    }

  @classmethod
  def from_dict(cls, d: dict) -> SequenceState:
    """Inverse of `to_dict`."""
    nan = lambda x: math.nan if x is None else x
    rq = dict(d["request"])
    rq["prompt_tokens"] = np.asarray(rq["prompt_tokens"], np.int32)
    return cls(
        uid=d["uid"], request=Request(**rq), prompt=np.asarray(d["prompt"], np.int32),
        max_new=d["max_new"], budget=d["budget"], tokens=list(d["tokens"]),
        logprobs=list(d["logprobs"]), versions=list(d["versions"]),
        routes=[np.asarray(r, np.int16) for r in d.get("routes", [])],
        t_submit=nan(d["t_submit"]), t_admit=nan(d["t_admit"]),
        t_first_token=nan(d["t_first_token"]), num_preemptions=d["num_preemptions"],
        slot=d["slot"], num_cached=d["num_cached"], admit_order=d["admit_order"],
        share_key=key_from_json(d["share_key"]))


class Scheduler:
  """Slots + waiting queue + page reservation over a `PageAllocator` and `PromptSharing`.

  Args:
    num_slots: decode slots B.
    allocator: the page allocator of the replica's pool.
    sharing: the replica's shared prompt pages.
    version: callable giving the running weight version (entries are per version).
  """

  def __init__(self, num_slots: int, allocator: PageAllocator, sharing: PromptSharing,
               version: Callable[[], int] = lambda: 0):
    self.allocator = allocator
    self.sharing = sharing
    self.version = version
    self.slots: list[SequenceState | None] = [None] * num_slots
    self.waiting: collections.deque[SequenceState] = collections.deque()
    self.dirty: set[int] = set()  # slots whose device state must be re-sent
    self._admit_counter = 0

  @property
  def num_active(self) -> int:
    """Occupied slots."""
    return sum(s is not None for s in self.slots)

  def state_dict(self) -> dict:
    """JSON-able slots, waiting queue and admission counter (allocator and prompt sharing save
    their own)."""
    return {"slots": [None if s is None else s.to_dict() for s in self.slots],
            "waiting": [s.to_dict() for s in self.waiting],
            "admit_counter": self._admit_counter}

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict` of a scheduler with the same number of slots; every slot is
    marked dirty (the device state is re-sent in full).

    Raises:
      ValueError: if the slot count differs.
    """
    if len(state["slots"]) != len(self.slots):
      raise ValueError(f"scheduler state has {len(state['slots'])} slots, this scheduler "
                       f"{len(self.slots)}.")
    self.slots = [None if d is None else SequenceState.from_dict(d) for d in state["slots"]]
    self.waiting.clear()
    self.waiting.extend(SequenceState.from_dict(d) for d in state["waiting"])
    self._admit_counter = int(state["admit_counter"])
    self.dirty.update(range(len(self.slots)))

  def running(self) -> list[SequenceState]:
    """Running sequences in slot order."""
    return [s for s in self.slots if s is not None]

  def enqueue(self, seq: SequenceState) -> None:
    """Appends a new sequence to the waiting queue."""
    self.sharing.register(seq.share_key)
    self.waiting.append(seq)

  def _release(self, seq: SequenceState) -> None:
    if self.allocator.holds(seq.uid):
      self.allocator.free(seq.uid)
    seq.num_cached, seq.table_cols = 0, 0

  def _grant(self, seq: SequenceState) -> bool:
    """Pages for the sequence's whole prefix (it holds none); shares its group's prompt.
    Evicts other groups' prompt entries before giving up."""
    for _ in range(2):
      cached = self.sharing.grant(seq.uid, seq.share_key, len(seq.prompt) - 1, len(seq.tokens),
                                  self.version())
      if cached is not None:
        seq.num_cached, seq.table_cols = cached, 0
        return True
      if not self.sharing.evict(keep=seq.share_key):
        break
    return False

  def _fits(self, seq: SequenceState) -> bool:
    held = self.allocator.num_pages_of(seq.uid)
    if not held:
      return self._grant(seq)
    if held * self.allocator.page_size >= len(seq.tokens):  # the common case: nothing to do
      return True
    if self.allocator.ensure(seq.uid, len(seq.tokens)):
      return True
    return self.sharing.evict() and self.allocator.ensure(seq.uid, len(seq.tokens))

  def _preempt(self, seq: SequenceState) -> None:
    self._release(seq)
    self.dirty.add(seq.slot)
    self.slots[seq.slot] = None
    seq.slot, seq.admit_order = -1, -1
    seq.num_preemptions += 1

  def drop_pages(self, seq: SequenceState) -> None:
    """Releases a running sequence's pages but keeps its slot (kv_policy="recompute" swap):
    the next `reserve_decode` grants them again and the prefix is prefilled anew."""
    self._release(seq)
    self.dirty.add(seq.slot)

  def reserve_decode(self) -> list[SequenceState]:
    """Gives every running sequence pages for its pending token, preempting when short.

    Oldest residents are served first; a shortage preempts the latest-admitted running sequence
    (possibly the one being served), until the request fits. A lone sequence always fits (the
    engine rejects requests larger than the pool), so the oldest resident always progresses.

    Returns:
      The preempted sequences (now at the front of the waiting queue, oldest first).
    """
    preempted = []
    for seq in sorted(self.running(), key=lambda s: s.admit_order):
      while seq.slot >= 0 and not self._fits(seq):
        victim = max(self.running(), key=lambda s: s.admit_order)
        preempted.append((victim.admit_order, victim))
        self._preempt(victim)
    preempted.sort(key=lambda x: x[0])
    self.waiting.extendleft(seq for _, seq in reversed(preempted))
    return [seq for _, seq in preempted]

  def admit(self, may_admit: Callable[[SequenceState], bool] | None = None
            ) -> list[SequenceState]:
    """Moves waiting sequences into free slots, FIFO, while the pool holds their prefix.

    Args:
      may_admit: admission control; sequences it rejects stay waiting in place (later ones may
        still be admitted). None admits everything.

    Returns:
      The admitted sequences (slot set, pages granted for len(tokens) tokens).
    """
    free = [i for i, s in enumerate(self.slots) if s is None]
    admitted, skipped = [], []
    while free and self.waiting:
      seq = self.waiting.popleft()
      if may_admit is not None and not may_admit(seq):
        skipped.append(seq)
        continue
      if not self._grant(seq):
        self.waiting.appendleft(seq)
        break
      seq.slot = free.pop(0)
      seq.admit_order, self._admit_counter = self._admit_counter, self._admit_counter + 1
      self.slots[seq.slot] = seq
      self.dirty.add(seq.slot)
      admitted.append(seq)
    self.waiting.extendleft(reversed(skipped))
    return admitted

  def look_ahead(self, steps: int) -> None:
    """Grants running sequences pages for up to `steps` more fed tokens (never preempts)."""
    alloc, size = self.allocator, self.allocator.page_size
    for seq in sorted(self.running(), key=lambda s: s.admit_order):
      target = min(len(seq.tokens) - 1 + steps, len(seq.prompt) + seq.max_new - 1)
      held = alloc.num_pages_of(seq.uid)
      if held * size >= target:
        continue
      extra = min(-(-target // size) - held, alloc.num_free)
      if extra > 0:
        alloc.ensure(seq.uid, (held + extra) * size)

  def finish(self, seq: SequenceState) -> None:
    """Frees the slot and pages of a running sequence that stopped."""
    self._release(seq)
    self.dirty.add(seq.slot)
    self.slots[seq.slot] = None
    seq.slot = -1
    self.sharing.unregister(seq.share_key)

  def remove(self, seq: SequenceState) -> None:
    """Aborts one sequence, running or waiting (its pages and slot are freed)."""
    if seq.slot >= 0:
      self.finish(seq)
      return
    self.waiting.remove(seq)
    self._release(seq)
    self.sharing.unregister(seq.share_key)

  def drain(self) -> list[SequenceState]:
    """Removes every running and waiting sequence (pages freed); running ones first."""
    out = self.running()
    for seq in out:
      self.finish(seq)
    for seq in self.waiting:
      self._release(seq)
      self.sharing.unregister(seq.share_key)
    out.extend(self.waiting)
    self.waiting.clear()
    return out


def plan_prefill(seqs: Iterable[SequenceState], cfg: SamplerConfig
                 ) -> list[tuple[int, list[SequenceState]]]:
  """Groups sequences that need a prefill into calls of at most `cfg.prefill_rows` rows.

  A row prefills positions [num_cached, len(tokens) - 1). Rows starting at 0 come first (they
  may be the prompt a group shares), then rows that continue a cached prefix; within each part
  rows are sorted by length so that each call's bucket wastes little padding.

  Returns:
    [(bucket, rows)], rows non-empty, len(rows) <= cfg.prefill_rows.
  """
  todo = [s for s in seqs if s.needs_prefill]
  calls = []
  for part in ([s for s in todo if s.num_cached == 0], [s for s in todo if s.num_cached > 0]):
    part.sort(key=lambda s: s.prefill_len - s.num_cached)
    for i in range(0, len(part), cfg.prefill_rows):
      rows = part[i:i + cfg.prefill_rows]
      calls.append((cfg.bucket_for(rows[-1].prefill_len - rows[-1].num_cached), rows))
  return calls


def refill_at(waiting: int, num_slots: int) -> int:
  """Finishes that end a decode dispatch early: min(waiting requests, ceil(num_slots / 8)), so
  freed slots are refilled in batches and a dispatch is not cut short by every single finish
  (0 when nothing waits: the dispatch runs its K steps or until every slot is done). The
  engine's rule, shared with the simulator (`rlax_pipe.sim.simulator`)."""
  return min(waiting, -(-num_slots // 8))
