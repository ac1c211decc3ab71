"""Host-side page allocator: which sequence owns which KV pages, and the block tables.

The device pool (`page_pool`) is a flat array of P pages of S tokens. A sequence holding n tokens
owns ceil(n / S) pages, in order: its block table row lists them, so token position p of the
sequence lives in page `block_table[p // S]` at offset `p % S`. Pages are granted as sequences
grow and returned when they finish or are preempted. Allocation is all-or-nothing per request, so
a failed grow leaves the state unchanged and the scheduler can preempt and retry.

Everything here is numpy / Python on the host (as in vLLM and sglang-jax); the block tables are
shipped to the device each step.
"""

from __future__ import annotations

import numpy as np


class PageAllocator:
  """Ownership of `num_pages` pages of `page_size` tokens.

  Invariants (checked by `check`): every page is either free or owned by exactly one sequence;
  free + owned = num_pages; a sequence owns exactly the pages in its block table, without
  repeats.

  Example:
    alloc = PageAllocator(num_pages=8, page_size=4)
    alloc.ensure(seq_id=7, num_tokens=5)   # -> True, seq 7 now owns 2 pages
    alloc.block_table(7, width=3)          # -> int32[3], e.g. [0, 1, 0] (padding = 0)
    alloc.free(7)                          # -> 2
  """

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 1 or page_size < 1:
      raise ValueError(f"PageAllocator needs num_pages >= 1 and page_size >= 1, got {num_pages}, "
                       f"{page_size}.")
    self.num_pages = num_pages
    self.page_size = page_size
    # A stack: freed pages are reused first, so block tables become non-contiguous quickly.
    self._free: list[int] = list(range(num_pages - 1, -1, -1))
    self._owner = np.full(num_pages, -1, np.int64)
    self._pages: dict[int, list[int]] = {}

  @property
  def num_free(self) -> int:
    """Pages not owned by any sequence."""
    return len(self._free)

  @property
  def num_used(self) -> int:
    """Pages owned by some sequence."""
    return self.num_pages - len(self._free)

  def pages_for(self, num_tokens: int) -> int:
    """Pages that hold `num_tokens` tokens."""
    return -(-num_tokens // self.page_size)

  def pages_of(self, seq_id: int) -> tuple[int, ...]:
    """Pages owned by `seq_id`, in sequence order (empty if it owns none)."""
    return tuple(self._pages.get(seq_id, ()))

  def owners(self) -> dict[int, tuple[int, ...]]:
    """Every sequence that owns pages -> its pages."""
    return {s: tuple(p) for s, p in self._pages.items()}

  def ensure(self, seq_id: int, num_tokens: int) -> bool:
    """Grows `seq_id` to hold `num_tokens` tokens (positions 0..num_tokens-1).

    All or nothing: when the free pages do not suffice, nothing changes and False is returned.
    Never shrinks a sequence.

    Args:
      seq_id: any integer >= 0 naming the sequence.
      num_tokens: tokens the sequence must be able to hold (>= 0).

    Returns:
      True when the sequence now owns >= ceil(num_tokens / page_size) pages.

    Raises:
      ValueError: on a negative seq_id or num_tokens.
    """
    if seq_id < 0 or num_tokens < 0:
      raise ValueError(f"ensure: seq_id={seq_id} and num_tokens={num_tokens} must be >= 0.")
    owned = self._pages.get(seq_id, [])
    extra = self.pages_for(num_tokens) - len(owned)
    if extra <= 0:
      return True
    if extra > len(self._free):
      return False
    new = [self._free.pop() for _ in range(extra)]
    self._owner[new] = seq_id
    self._pages[seq_id] = owned + new
    return True

  def free(self, seq_id: int) -> int:
    """Returns every page of `seq_id` to the pool; returns how many (0 if it owned none)."""
    pages = self._pages.pop(seq_id, [])
    self._owner[pages] = -1
    self._free.extend(reversed(pages))
    return len(pages)

  def block_table(self, seq_id: int, width: int, pad: int = 0) -> np.ndarray:
    """int32[width] row: the sequence's pages in order, then `pad`.

    Raises:
      ValueError: if the sequence owns more than `width` pages.
    """
    pages = self._pages.get(seq_id, [])
    if len(pages) > width:
      raise ValueError(f"sequence {seq_id} owns {len(pages)} pages, more than the block-table "
                       f"width {width}.")
    row = np.full(width, pad, np.int32)
    row[:len(pages)] = pages
    return row

  def state_dict(self) -> dict:
    """JSON-able ownership state: the free stack (in order) and each sequence's pages."""
    return {"free": [int(p) for p in self._free],
            "pages": {str(s): [int(p) for p in pages] for s, pages in self._pages.items()}}

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict` of an allocator with the same pool.

    Raises:
      AssertionError: if the state violates the invariants (leaked or doubly owned pages).
    """
    self._free = [int(p) for p in state["free"]]
    self._pages = {int(s): [int(p) for p in pages] for s, pages in state["pages"].items()}
    self._owner[:] = -1
    for seq_id, pages in self._pages.items():
      self._owner[pages] = seq_id
    self.check()

  def check(self) -> None:
    """Verifies the invariants; raises AssertionError naming the first violation."""
    free = np.asarray(self._free, np.int64)
    assert len(set(self._free)) == len(self._free), "a page is on the free list twice"
    assert np.all(self._owner[free] == -1), "a free page has an owner"
    seen = np.zeros(self.num_pages, np.int64)
    seen[free] += 1
    for seq_id, pages in self._pages.items():
      assert pages, f"sequence {seq_id} is listed with no pages"
      assert np.all(self._owner[pages] == seq_id), f"owner table disagrees for sequence {seq_id}"
      np.add.at(seen, pages, 1)
    assert np.all(seen <= 1), f"pages {np.nonzero(seen > 1)[0].tolist()} owned twice"
    assert np.all(seen == 1), f"pages {np.nonzero(seen == 0)[0].tolist()} leaked"
