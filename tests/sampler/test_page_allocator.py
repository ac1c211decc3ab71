"""Page allocator, shared prompt pages and scheduler: reference counts under random operations."""

import math

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

from rlax_pipe.sampler.config import Request, SamplerConfig
from rlax_pipe.sampler.page_allocator import DoubleFreeError, PageAllocator
from rlax_pipe.sampler.prompt_sharing import PromptSharing
from rlax_pipe.sampler.scheduler import Scheduler, SequenceState, plan_prefill

NUM_PAGES, PAGE_SIZE = 24, 4
OPS = ("admit", "share", "grow", "finish", "preempt", "resume", "abort")
OPS_PER_EXAMPLE, EXAMPLES = 500, 24  # 12k operations in all


class AllocatorModel:
  """Drives the allocator and tracks who should hold how many tokens and which pages."""

  def __init__(self):
    self.alloc = PageAllocator(NUM_PAGES, PAGE_SIZE)
    self.running: dict[int, int] = {}  # seq id -> tokens it must hold
    self.shared: dict[int, tuple[int, ...]] = {}  # seq id -> pages it shares (its first ones)
    self.preempted: dict[int, int] = {}
    self.next_id = 0

  def ensure(self, seq, tokens):
    free_before, held_before = self.alloc.num_free, len(self.alloc.pages_of(seq))
    ok = self.alloc.ensure(seq, tokens)
    need = math.ceil(tokens / PAGE_SIZE)
    assert ok == (need - held_before <= free_before)
    if ok:
      assert len(self.alloc.pages_of(seq)) == max(need, held_before)
    else:  # all or nothing
      assert self.alloc.num_free == free_before and len(self.alloc.pages_of(seq)) == held_before
    return ok

  def _pick(self, pool, pick):
    return sorted(pool)[pick % len(pool)] if pool else None

  def apply(self, op, pick, tokens):
    if op in ("admit", "share"):
      seq, self.next_id = self.next_id, self.next_id + 1
      src = self._pick(self.running, pick) if op == "share" else None
      if src is not None:  # share the full pages of a running sequence, then grow privately
        full = self.alloc.pages_of(src)[:self.running[src] // PAGE_SIZE]
        refs = [self.alloc.refcount(p) for p in full]
        self.alloc.share(seq, full)
        assert [self.alloc.refcount(p) for p in full] == [r + 1 for r in refs]
        tokens += len(full) * PAGE_SIZE
        if not self.ensure(seq, tokens):
          if full:
            self.alloc.free(seq)
          assert not self.alloc.holds(seq)
          return
        self.shared[seq] = tuple(full)
      elif not self.ensure(seq, tokens):
        return
      self.running[seq] = tokens
      return
    pool = self.preempted if op == "resume" else self.running
    seq = self._pick(pool, pick)
    if seq is None:
      return
    if op == "grow" and self.ensure(seq, self.running[seq] + tokens):
      self.running[seq] += tokens
    elif op in ("finish", "abort"):
      held = len(self.alloc.pages_of(seq))
      assert self.alloc.free(seq) == held
      with pytest.raises(DoubleFreeError):
        self.alloc.free(seq)
      del self.running[seq]
      self.shared.pop(seq, None)
    elif op == "preempt":
      self.alloc.free(seq)
      self.shared.pop(seq, None)
      self.preempted[seq] = self.running.pop(seq)
    elif op == "resume" and self.ensure(seq, self.preempted[seq]):
      self.running[seq] = self.preempted.pop(seq)

  def check(self):
    self.alloc.check()  # counts = holders, free list = count 0, nothing leaked or doubled
    owners = self.alloc.owners()
    assert set(owners) == set(self.running)
    for seq, tokens in self.running.items():
      assert len(owners[seq]) * PAGE_SIZE >= tokens
      assert owners[seq][:len(self.shared.get(seq, ()))] == self.shared.get(seq, ())
    held = np.zeros(NUM_PAGES, int)
    for pages in owners.values():
      np.add.at(held, list(pages), 1)
    assert int((held == 0).sum()) == self.alloc.num_free


OPERATIONS = [0]


@hypothesis.settings(max_examples=EXAMPLES, deadline=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(ops=st.binary(min_size=2 * OPS_PER_EXAMPLE, max_size=2 * OPS_PER_EXAMPLE))
def _random_interleaving(ops):
  """Each op is a 16-bit code: kind = bits 0-2 (mod 7), pick = bits 3-8, tokens = bits 9-15."""
  m = AllocatorModel()
  for code in np.frombuffer(ops, np.uint16).tolist():
    OPERATIONS[0] += 1
    m.apply(OPS[(code & 7) % len(OPS)], (code >> 3) & 63, 1 + (code >> 9) % (3 * PAGE_SIZE))
    m.check()
  for _ in list(m.running):  # finishing everything returns the whole pool
    m.apply("finish", 0, 0)
  assert m.alloc.num_free == NUM_PAGES


def test_allocator_random_interleavings_10k_operations():
  OPERATIONS[0] = 0
  _random_interleaving()  # pylint: disable=no-value-for-parameter
  assert OPERATIONS[0] >= 10_000


def test_allocator_all_or_nothing_double_free_and_bad_shares():
  alloc = PageAllocator(num_pages=3, page_size=4)
  assert alloc.ensure(0, 8) and alloc.num_free == 1
  assert not alloc.ensure(1, 9)  # needs 3, only 1 free: nothing changes
  assert alloc.num_free == 1 and alloc.pages_of(1) == ()
  with pytest.raises(ValueError, match="width"):
    alloc.block_table(0, width=1)
  with pytest.raises(ValueError, match="free"):  # sharing needs a live page
    alloc.share(1, [alloc._free[0]])  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="twice"):
    alloc.share(0, alloc.pages_of(0)[:1])
  assert alloc.free(0) == 2
  with pytest.raises(DoubleFreeError, match="holds no pages"):
    alloc.free(0)
  with pytest.raises(DoubleFreeError):
    alloc.free(99)  # never allocated
  alloc.check()
  assert alloc.num_free == 3


def test_ensure_rolls_back_a_failure_midway():
  alloc = PageAllocator(num_pages=4, page_size=2)
  assert alloc.ensure("a", 2)
  state = alloc.state_dict()
  alloc._refs[alloc._free[-2]] = 5  # pylint: disable=protected-access  (corrupt the 2nd page taken)
  with pytest.raises(RuntimeError, match="free list"):
    alloc.ensure("a", 6)
  alloc._refs[alloc._free[-2]] = 0  # pylint: disable=protected-access
  assert alloc.state_dict() == state  # nothing taken, nothing granted
  alloc.check()


def test_free_of_an_already_free_page_raises():
  alloc = PageAllocator(num_pages=2, page_size=2)
  alloc.ensure("a", 2)
  page = alloc.pages_of("a")[0]
  alloc._pages["b"] = [page, alloc._free[0]]  # pylint: disable=protected-access
  with pytest.raises(DoubleFreeError, match="already free"):
    alloc.free("b")
  assert alloc.pages_of("b") == (page, alloc._free[0])  # pylint: disable=protected-access


# --- scheduler + shared prompt pages --------------------------------------------------------

CFG = SamplerConfig(num_slots=3, page_size=PAGE_SIZE, num_pages=10, max_seq_len=40,
                    min_prefill_bucket=8, prefill_rows=2)


def _seq(uid, prompt_len, group=None):
  req = Request(prompt_tokens=np.ones(prompt_len, np.int32), sample_id=uid)
  return SequenceState(uid=uid, request=req, prompt=req.prompt_tokens, max_new=100, budget=100,
                       tokens=[1] * prompt_len,
                       share_key=None if group is None else (group, prompt_len))


def _step(sched, alloc, r, done, version):
  resident_before = {s.uid: s.admit_order for s in sched.running()}
  preempted = sched.reserve_decode()
  victims = {s.uid for s in preempted}
  for s in preempted:  # LIFO: everything admitted after a victim is a victim too
    assert all(u in victims for u, o in resident_before.items() if o > resident_before[s.uid])
  assert list(sched.waiting)[:len(preempted)] == preempted
  if not preempted:
    sched.admit(lambda s: True)
  sched.look_ahead(3)
  for s in sched.running():
    pages = alloc.pages_of(s.uid)
    assert len(pages) * PAGE_SIZE >= len(s.tokens)
    entry = sched.sharing.entries.get(s.share_key)
    if s.num_cached and entry is not None and entry.version == version:
      assert pages[:len(entry.full_pages)] == entry.full_pages  # shared prompt pages
  for (src, dst) in sched.sharing.take_copies():  # copy on write of the partial page
    assert alloc.refcount(dst) == 1 and alloc.refcount(src) >= 1
  for bucket, rows in plan_prefill(sched.running(), CFG):
    assert len(rows) <= CFG.prefill_rows
    assert all(s.prefill_len - s.num_cached <= bucket for s in rows)
    for s in rows:
      s.num_cached = s.prefill_len
  for i, s in enumerate(sched.running()):  # one decode step
    assert not s.needs_prefill
    s.tokens.append(2)
    s.num_cached = len(s.tokens) - 1
    if (r >> i) % 3 == 0 or len(s.tokens) >= CFG.max_seq_len - 1:
      sched.finish(s)
      done.append(s)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(ops=st.lists(st.tuples(st.sampled_from(["submit", "step", "abort", "swap"]),
                                         st.integers(1, 14), st.integers(0, 2**16)),
                               min_size=1, max_size=120))
def test_scheduler_shares_preempts_lifo_aborts_and_conserves_pages(ops):
  alloc = PageAllocator(CFG.num_pages, CFG.page_size)
  version = [0]
  sched = Scheduler(CFG.num_slots, alloc, PromptSharing(alloc), version=lambda: version[0])
  seqs, done, aborted = [], [], []
  for op, n, r in ops:
    if op == "submit":  # groups of samples with the same prompt
      seqs.append(_seq(len(seqs), n, group=r % 3))
      sched.enqueue(seqs[-1])
    elif op == "abort":
      live = sched.running() + list(sched.waiting)
      if live:
        victim = live[r % len(live)]
        sched.remove(victim)
        aborted.append(victim)
        assert not alloc.holds(victim.uid)
    elif op == "swap":  # a weight swap drops entries of older versions; recompute drops pages
      version[0] += 1
      sched.sharing.invalidate(version[0])
      if r % 2:
        for s in sched.running():
          sched.drop_pages(s)
    else:
      _step(sched, alloc, r, done, version[0])
    alloc.check()
    uids = ([s.uid for s in sched.running()] + [s.uid for s in sched.waiting]
            + [s.uid for s in done + aborted])
    assert sorted(uids) == list(range(len(seqs)))  # nothing lost or duplicated
  for s in sched.drain():
    assert s.slot == -1
  assert not sched.sharing.entries and not sched.sharing.members  # last member drops an entry
  alloc.check()
  assert alloc.num_free == CFG.num_pages
