"""Shared prompt pages for the samples of one prompt group (host side).

The G samples of a GRPO group have the same prompt. The first sample granted pages (the
"leader") prefills the prompt; a group entry then takes a reference on the pages that hold the
prompt's KV (positions [0, P0), P0 = prompt length - 1: the last prompt token is fed by the first
decode step). Every later sample of the group shares the entry's *full* pages and gets a private
copy of its partial last page (copy on write: the sample writes its own tokens from position P0
on, inside that page). So a group of G prefills P0 tokens once instead of G times and holds
ceil(P0 / S) + (G - 1) * (pages past the shared ones) pages instead of G * ceil(P0 / S).

An entry is a cache: under page pressure the scheduler evicts entries (`evict`) before it
preempts anyone, so entries never keep the pool from serving a lone sequence.

Exactness: an entry is used only while the engine runs the weight version that computed it
(a swap drops older entries), so a shared prefix is always the KV the current weights would
compute. An entry lives until the last sample of its group finishes or is aborted.

Writing rule: full shared pages are never written after the leader's prefill; the leader keeps
writing its partial page at positions >= P0, which the copies never read (each sample writes a
position before any query reads it).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Hashable

from rlax_pipe.sampler.page_allocator import PageAllocator, key_from_json, key_to_json


@dataclasses.dataclass
class PromptEntry:
  """The shared prompt KV of one group.

  Attributes:
    holder: allocator holder key of the entry's references.
    num_tokens: P0, prompt positions whose KV the pages hold.
    full_pages: pages entirely inside [0, P0) (shared by reference).
    partial_page: the page holding positions [S * len(full_pages), P0), copied per sample; None
      when P0 is a multiple of S.
    version: weight version that computed the KV.
  """

  holder: Hashable
  num_tokens: int
  full_pages: tuple[int, ...]
  partial_page: int | None
  version: int


class PromptSharing:
  """Group entries, member counts and the page copies they ask for.

  Args:
    allocator: the replica's page allocator.
    enabled: False = every sample prefills its own prompt (the baseline).
  """

  def __init__(self, allocator: PageAllocator, enabled: bool = True):
    self.allocator = allocator
    self.enabled = enabled
    self.entries: dict[Hashable, PromptEntry] = {}
    self.members: collections.Counter = collections.Counter()
    self.pending_copies: list[tuple[int, int]] = []  # (src page, dst page), run before prefill

  def register(self, key: Hashable | None) -> None:
    """A sample of group `key` was queued."""
    if key is not None:
      self.members[key] += 1

  def unregister(self, key: Hashable | None) -> None:
    """A sample of group `key` finished or was aborted; the last one drops the entry."""
    if key is None:
      return
    self.members[key] -= 1
    if self.members[key] <= 0:
      del self.members[key]
      self._drop(key)

  def invalidate(self, version: int) -> None:
    """Drops entries computed by weights other than `version` (after a swap)."""
    for key in [k for k, e in self.entries.items() if e.version != version]:
      self._drop(key)

  def evict(self, keep: Hashable | None = None) -> bool:
    """Drops every entry but `keep`'s (a cache under page pressure); True if any was dropped.

    Pages that running samples still share stay with them; only the entries' references go.
    """
    keys = [k for k in self.entries if k != keep]
    for key in keys:
      self._drop(key)
    return bool(keys)

  def _drop(self, key: Hashable) -> None:
    entry = self.entries.pop(key, None)
    if entry is not None:
      self.allocator.free(entry.holder)

  def grant(self, uid: Hashable, key: Hashable | None, prompt_kv: int, num_tokens: int,
            version: int) -> int | None:
    """Gives holder `uid` (holding nothing) pages for `num_tokens` tokens, sharing when it can.

    Args:
      uid: the sample's holder key.
      key: its group key (None = never shared).
      prompt_kv: P0, prompt positions whose KV a prefill computes (prompt length - 1).
      num_tokens: tokens the sample must hold (>= P0).
      version: the running weight version.

    Returns:
      None when the pool cannot hold it (nothing changed); else the number of leading positions
      whose KV is already valid (P0 when shared, else 0).
    """
    alloc, size = self.allocator, self.allocator.page_size
    entry = self.entries.get(key) if self.enabled and key is not None else None
    if entry is not None and entry.version == version:
      alloc.share(uid, entry.full_pages)
      if not alloc.ensure(uid, num_tokens):
        if alloc.holds(uid):  # give back the shared references (none if no page was full)
          alloc.free(uid)
        return None
      if entry.partial_page is not None:
        self.pending_copies.append((entry.partial_page, alloc.pages_of(uid)[len(entry.full_pages)]))
      return entry.num_tokens
    if not alloc.ensure(uid, num_tokens):
      return None
    if self.enabled and key is not None and prompt_kv >= 1:
      self._drop(key)  # an entry of an older version
      pages = alloc.pages_of(uid)[:alloc.pages_for(prompt_kv)]
      holder = ("prompt", key)
      alloc.share(holder, pages)
      n_full = prompt_kv // size
      self.entries[key] = PromptEntry(holder, prompt_kv, pages[:n_full],
                                      pages[n_full] if prompt_kv % size else None, version)
    return 0

  def state_dict(self) -> dict:
    """JSON-able entries and member counts (pending copies must have been run)."""
    return {"entries": [[key_to_json(k), key_to_json(e.holder), e.num_tokens,
                         list(e.full_pages), e.partial_page, e.version]
                        for k, e in self.entries.items()],
            "members": [[key_to_json(k), n] for k, n in self.members.items()]}

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict` (the allocator holds the entries' references)."""
    self.entries = {key_from_json(k): PromptEntry(key_from_json(h), n, tuple(f), p, v)
                    for k, h, n, f, p, v in state["entries"]}
    self.members.clear()
    self.members.update({key_from_json(k): n for k, n in state["members"]})
    self.pending_copies = []

  def take_copies(self) -> list[tuple[int, int]]:
    """The page copies asked for since the last call (and forgets them)."""
    out, self.pending_copies = self.pending_copies, []
    return out
