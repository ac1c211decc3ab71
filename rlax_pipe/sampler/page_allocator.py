"""Host-side page allocator: reference-counted KV pages, their holders, and the block tables.

The device pool (`page_pool`) holds P pages of S tokens per layer. A sequence holding n tokens
owns ceil(n / S) pages, in order: its block-table row lists them, so token position p of the
sequence lives in page `block_table[p // S]` at offset `p % S`. Pages are granted as sequences
grow and released when they finish, are preempted or aborted.

Pages are reference-counted so that the samples of one prompt group can share the prompt's full
pages (`share`): a page returns to the free list when its last holder releases it. A holder is
any hashable key: a sequence, or a group's prompt entry that keeps the prompt's pages alive until
every sample of the group has been admitted. Writing rule (kept by the scheduler): a shared page
is never written below the shared prefix length; positions at or beyond it are written by at
most one holder and read only by that holder.

Errors are loud: `ensure` is all-or-nothing (a failure, including one raised midway, leaves the
state exactly as it was), freeing a holder that holds nothing raises (double free), and releasing
a page whose count is already zero raises. Everything here is numpy / Python on the host (as in
vLLM and sglang-jax); block-table changes travel to the device as small deltas.
"""

from __future__ import annotations

from typing import Hashable, Iterable

import numpy as np


class DoubleFreeError(ValueError):
  """A holder or page was released twice."""


class PageAllocator:
  """Ownership of `num_pages` reference-counted pages of `page_size` tokens.

  Invariants (checked by `check`): a page's reference count equals the number of times it is
  listed by holders; a page is on the free list exactly when its count is 0; free + in-use =
  num_pages; no holder lists a page twice.

  Example:
    alloc = PageAllocator(num_pages=8, page_size=4)
    alloc.ensure(7, num_tokens=5)       # -> True, holder 7 now owns 2 pages
    alloc.share(8, alloc.pages_of(7)[:1])  # holder 8 shares the first page (count 2)
    alloc.block_table(7, width=3)       # -> int32[3], e.g. [0, 1, 0] (padding = 0)
    alloc.free(7)                       # -> 2 released references; page 0 stays with 8
    alloc.free(7)                       # raises DoubleFreeError
  """

  def __init__(self, num_pages: int, page_size: int, track_fresh: bool = False):
    if num_pages < 1 or page_size < 1:
      raise ValueError(f"PageAllocator needs num_pages >= 1 and page_size >= 1, got {num_pages}, "
                       f"{page_size}.")
    self.num_pages = num_pages
    self.page_size = page_size
    # A stack: freed pages are reused first, so block tables become non-contiguous quickly.
    self._free: list[int] = list(range(num_pages - 1, -1, -1))
    self._refs = np.zeros(num_pages, np.int64)
    self._pages: dict[Hashable, list[int]] = {}
    self._track_fresh = track_fresh
    self._fresh: list[int] = []

  def take_fresh(self) -> list[int]:
    """Pages taken from the free list since the last call (only with track_fresh=True): the
    engine zeroes them before use when a kernel reads whole compute blocks."""
    out, self._fresh = self._fresh, []
    return out

  @property
  def num_free(self) -> int:
    """Pages with reference count 0."""
    return len(self._free)

  @property
  def num_used(self) -> int:
    """Pages held by at least one holder."""
    return self.num_pages - len(self._free)

  def pages_for(self, num_tokens: int) -> int:
    """Pages that hold `num_tokens` tokens: ceil(num_tokens / page_size)."""
    return -(-num_tokens // self.page_size)

  def pages_of(self, holder: Hashable) -> tuple[int, ...]:
    """Pages listed by `holder`, in sequence order (empty if it holds none)."""
    return tuple(self._pages.get(holder, ()))

  def num_pages_of(self, holder: Hashable) -> int:
    """len(pages_of(holder)) without building a tuple."""
    return len(self._pages.get(holder, ()))

  def holds(self, holder: Hashable) -> bool:
    """Whether `holder` holds at least one page."""
    return holder in self._pages

  def refcount(self, page: int) -> int:
    """Holders of `page` (0 = free)."""
    return int(self._refs[page])

  def owners(self) -> dict[Hashable, tuple[int, ...]]:
    """Every holder -> its pages."""
    return {s: tuple(p) for s, p in self._pages.items()}

  def ensure(self, holder: Hashable, num_tokens: int) -> bool:
    """Grows `holder` with fresh (private) pages to hold `num_tokens` tokens.

    All or nothing: when the free pages do not suffice, or anything raises midway, nothing
    changes (pages taken are put back). Never shrinks a holder.

    Args:
      holder: hashable key naming the sequence (or entry).
      num_tokens: tokens the holder must be able to hold (>= 0).

    Returns:
      True when the holder now lists >= ceil(num_tokens / page_size) pages.

    Raises:
      ValueError: on a negative num_tokens.
    """
    if num_tokens < 0:
      raise ValueError(f"ensure: num_tokens={num_tokens} must be >= 0 (holder {holder!r}).")
    owned = self._pages.get(holder, [])
    extra = self.pages_for(num_tokens) - len(owned)
    if extra <= 0:
      return True
    if extra > len(self._free):
      return False
    free_before = list(self._free)
    taken: list[int] = []
    try:
      for _ in range(extra):
        page = self._free.pop()
        if self._refs[page] != 0:
          raise RuntimeError(f"page {page} is on the free list with {self._refs[page]} holders.")
        taken.append(page)
      self._refs[taken] += 1
      self._pages[holder] = owned + taken
      if self._track_fresh:
        self._fresh.extend(taken)
    except BaseException:
      self._refs[taken] = 0
      self._free = free_before
      if owned:
        self._pages[holder] = owned
      else:
        self._pages.pop(holder, None)
      raise
    return True

  def share(self, holder: Hashable, pages: Iterable[int]) -> None:
    """Appends existing in-use pages to `holder`'s list, taking one reference on each.

    Args:
      holder: the receiving holder (typically one that holds nothing yet).
      pages: pages currently held by someone (reference count >= 1).

    Raises:
      ValueError: if a page is free (sharing needs a live page) or already listed by `holder`.
    """
    pages = [int(p) for p in pages]
    if not pages:
      return
    owned = self._pages.get(holder, [])
    dead = [p for p in pages if self._refs[p] == 0]
    if dead:
      raise ValueError(f"share: pages {dead} are free; only pages in use can be shared.")
    if set(pages) & set(owned) or len(set(pages)) != len(pages):
      raise ValueError(f"share: holder {holder!r} would list a page twice ({pages} + {owned}).")
    self._refs[pages] += 1
    self._pages[holder] = owned + pages

  def free(self, holder: Hashable) -> int:
    """Releases every page reference of `holder`; pages whose count reaches 0 become free.

    Returns:
      Number of references released (= pages the holder listed).

    Raises:
      DoubleFreeError: if `holder` holds nothing (never allocated, or already freed), or a page
        of it is already free (corrupted state).
    """
    pages = self._pages.pop(holder, None)
    if pages is None:
      raise DoubleFreeError(f"free: holder {holder!r} holds no pages (freed twice, or never "
                            "allocated).")
    already = [p for p in pages if self._refs[p] <= 0]
    if already:
      self._pages[holder] = pages
      raise DoubleFreeError(f"free: pages {already} of holder {holder!r} are already free.")
    self._refs[pages] -= 1
    self._free.extend(p for p in reversed(pages) if self._refs[p] == 0)
    return len(pages)

  def block_table(self, holder: Hashable, width: int, pad: int = 0) -> np.ndarray:
    """int32[width] row: the holder's pages in order, then `pad`.

    Raises:
      ValueError: if the holder lists more than `width` pages.
    """
    pages = self._pages.get(holder, [])
    if len(pages) > width:
      raise ValueError(f"holder {holder!r} owns {len(pages)} pages, more than the block-table "
                       f"width {width}.")
    row = np.full(width, pad, np.int32)
    row[:len(pages)] = pages
    return row

  def state_dict(self) -> dict:
    """JSON-able state (holders must be ints or strings, or tuples of them)."""
    return {"free": list(map(int, self._free)),
            "holders": [[key_to_json(k), list(map(int, v))] for k, v in self._pages.items()]}

  def load_state_dict(self, state: dict) -> None:
    """Restores `state_dict()` output and checks the invariants."""
    self._free = [int(p) for p in state["free"]]
    self._pages = {key_from_json(k): [int(p) for p in v] for k, v in state["holders"]}
    self._refs[:] = 0
    for pages in self._pages.values():
      np.add.at(self._refs, pages, 1)
    self.check()

  def check(self) -> None:
    """Verifies the invariants; raises AssertionError naming the first violation."""
    assert len(set(self._free)) == len(self._free), "a page is on the free list twice"
    counts = np.zeros(self.num_pages, np.int64)
    for holder, pages in self._pages.items():
      assert pages, f"holder {holder!r} is listed with no pages"
      assert len(set(pages)) == len(pages), f"holder {holder!r} lists a page twice"
      np.add.at(counts, pages, 1)
    assert np.array_equal(counts, self._refs), (
        f"reference counts disagree with the holders at pages "
        f"{np.nonzero(counts != self._refs)[0].tolist()}")
    free = np.zeros(self.num_pages, bool)
    free[self._free] = True
    assert np.array_equal(free, counts == 0), (
        f"pages {np.nonzero(free != (counts == 0))[0].tolist()} are leaked or both free and held")


def key_to_json(key):
  """A holder key (int, str or nested tuples of them) as JSON (tuples become lists)."""
  return list(map(key_to_json, key)) if isinstance(key, tuple) else key


def key_from_json(key):
  """Inverse of `key_to_json` (lists become tuples)."""
  return tuple(map(key_from_json, key)) if isinstance(key, list) else key
