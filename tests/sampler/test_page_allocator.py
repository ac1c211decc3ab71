"""Page allocator and scheduler: ownership invariants under random admit/grow/finish/preempt."""

import math

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

from rlax_pipe.sampler.config import Request, SamplerConfig
from rlax_pipe.sampler.page_allocator import PageAllocator
from rlax_pipe.sampler.scheduler import Scheduler, SequenceState, plan_prefill

NUM_PAGES, PAGE_SIZE = 24, 4


OPS = ("admit", "grow", "finish", "preempt", "resume")
OPS_PER_EXAMPLE, EXAMPLES = 500, 24  # 12k operations in all


class AllocatorModel:
  """Drives the allocator and tracks who should hold how many tokens."""

  def __init__(self):
    self.alloc = PageAllocator(NUM_PAGES, PAGE_SIZE)
    self.running: dict[int, int] = {}  # seq id -> tokens it must hold
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

  def apply(self, op, pick, tokens):
    if op == "admit":
      seq, self.next_id = self.next_id, self.next_id + 1
      if self.ensure(seq, tokens):
        self.running[seq] = tokens
      return
    pool = self.preempted if op == "resume" else self.running
    if not pool:
      return
    seq = sorted(pool)[pick % len(pool)]
    if op == "grow" and self.ensure(seq, self.running[seq] + tokens):
      self.running[seq] += tokens
    elif op == "finish":
      held = len(self.alloc.pages_of(seq))
      assert self.alloc.free(seq) == held
      del self.running[seq]
    elif op == "preempt":
      self.alloc.free(seq)
      self.preempted[seq] = self.running.pop(seq)
    elif op == "resume" and self.ensure(seq, self.preempted[seq]):
      self.running[seq] = self.preempted.pop(seq)

  def check(self):
    self.alloc.check()  # no page owned twice, none leaked
    owners = self.alloc.owners()
    assert set(owners) == set(self.running)
    assert sum(map(len, owners.values())) + self.alloc.num_free == NUM_PAGES
    for seq, tokens in self.running.items():
      assert len(owners[seq]) * PAGE_SIZE >= tokens
    if self.running:  # block table = owned pages in order, then padding
      seq = max(self.running)
      table = self.alloc.block_table(seq, width=NUM_PAGES, pad=-1)
      assert tuple(table[table >= 0]) == owners[seq]


OPERATIONS = [0]


@hypothesis.settings(max_examples=EXAMPLES, deadline=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(ops=st.binary(min_size=2 * OPS_PER_EXAMPLE, max_size=2 * OPS_PER_EXAMPLE))
def _random_interleaving(ops):
  """Each op is a 16-bit code: kind = bits 0-2 (mod 5), pick = bits 3-8, tokens = bits 9-15."""
  m = AllocatorModel()
  for code in np.frombuffer(ops, np.uint16).tolist():
    OPERATIONS[0] += 1
    m.apply(OPS[(code & 7) % len(OPS)], (code >> 3) & 63, 1 + (code >> 9) % (3 * PAGE_SIZE))
    m.check()
  for seq in list(m.running):  # finishing everything returns the whole pool
    m.apply("finish", 0, 0)
  assert m.alloc.num_free == NUM_PAGES


def test_allocator_random_interleavings_10k_operations():
  OPERATIONS[0] = 0
  _random_interleaving()  # pylint: disable=no-value-for-parameter
  assert OPERATIONS[0] >= 10_000


def test_allocator_rejects_too_large_and_is_all_or_nothing():
  alloc = PageAllocator(num_pages=3, page_size=4)
  assert alloc.ensure(0, 8) and alloc.num_free == 1
  assert not alloc.ensure(1, 9)  # needs 3, only 1 free: nothing changes
  assert alloc.num_free == 1 and alloc.pages_of(1) == ()
  assert alloc.ensure(0, 12) and alloc.num_free == 0
  with pytest.raises(ValueError, match="width"):
    alloc.block_table(0, width=2)
  alloc.check()


CFG = SamplerConfig(num_slots=3, page_size=PAGE_SIZE, num_pages=10, max_seq_len=40,
                    min_prefill_bucket=8, prefill_rows=2)


def _seq(uid, prompt_len):
  req = Request(prompt_tokens=np.ones(prompt_len, np.int32), sample_id=uid)
  return SequenceState(uid=uid, request=req, prompt=req.prompt_tokens, max_new=100,
                       tokens=[1] * prompt_len)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(ops=st.lists(st.tuples(st.sampled_from(["submit", "step"]),
                                         st.integers(1, 14), st.integers(0, 2**16)),
                               min_size=1, max_size=120))
def test_scheduler_preempts_lifo_and_conserves_pages(ops):
  alloc = PageAllocator(CFG.num_pages, CFG.page_size)
  sched = Scheduler(CFG.num_slots, alloc)
  seqs, done = [], []
  for op, n, r in ops:
    if op == "submit":
      seqs.append(_seq(len(seqs), n))
      sched.enqueue(seqs[-1])
      continue
    resident_before = {s.uid: s.admit_order for s in sched.running()}
    preempted = sched.reserve_decode()
    victims = {s.uid for s in preempted}
    for s in preempted:  # LIFO: everything admitted after a victim is a victim too
      assert all(u in victims for u, o in resident_before.items() if o > resident_before[s.uid])
    assert list(sched.waiting)[:len(preempted)] == preempted
    if not preempted:
      sched.admit(lambda s: True)
    for s in sched.running():
      assert len(alloc.pages_of(s.uid)) * PAGE_SIZE >= len(s.tokens)
    calls = plan_prefill(sched.running(), CFG)
    for bucket, rows in calls:
      assert len(rows) <= CFG.prefill_rows and all(s.prefill_len <= bucket for s in rows)
      for s in rows:
        s.num_cached = s.prefill_len
    for i, s in enumerate(sched.running()):  # one decode step
      assert not s.needs_prefill
      s.tokens.append(2)
      s.num_cached = len(s.tokens) - 1
      if (r >> i) % 3 == 0 or len(s.tokens) >= CFG.max_seq_len - 1:
        sched.finish(s)
        done.append(s)
    alloc.check()
    uids = ([s.uid for s in sched.running()] + [s.uid for s in sched.waiting]
            + [s.uid for s in done])
    assert sorted(uids) == list(range(len(seqs)))  # nothing lost or duplicated
  for s in sched.drain():
    assert s.slot == -1
  alloc.check()
  assert alloc.num_free == CFG.num_pages
