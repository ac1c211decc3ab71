"""Tests for the rollout queue: grouping, ordering, policies, waits, resume."""

import threading
import time

import numpy as np
import pytest

from rlax_pipe.pipeline import rollout_queue as rq
from rlax_pipe.pipeline import rules
from rlax_pipe.pipeline import staleness as st
from rlax_pipe.types import Rollout

_SID = iter(range(10**9))


def _rollout(group_id, versions, finish="eos", sample_id=None, prompt_len=3):
  versions = np.asarray(versions, np.int32)
  t = versions.shape[0]
  return Rollout(
      sample_id=next(_SID) if sample_id is None else sample_id, group_id=group_id,
      prompt_tokens=np.arange(1, prompt_len + 1, dtype=np.int32),
      completion_tokens=np.arange(t, dtype=np.int32) + 10,
      behavior_logprobs=-np.linspace(0.1, 1.0, t).astype(np.float32), policy_versions=versions,
      finish_reason=finish, reward=1.0)


def _put_group(q, gid, versions_per_sample, **kw):
  for vs in versions_per_sample:
    q.put(_rollout(gid, vs), **kw)


def test_group_ready_only_when_complete_and_oldest_first():
  q = rq.RolloutQueue(st.StalenessConfig("drop", max_lag=3, groups_per_step=2), group_size=2)
  q.put(_rollout(7, [1, 1]))
  assert q.stats().partial_groups == 1 and q.try_get_batch(1, 2) is None
  _put_group(q, 5, [[2, 2], [2]])
  q.put(_rollout(7, [0, 1]))  # group 7 completes later but holds older tokens
  _put_group(q, 9, [[2], [2]])
  batch = q.try_get_batch(2, learner_version=2)
  assert [g[0].group_id for g in batch] == [7, 5]
  assert all(len(g) == 2 for g in batch)
  assert [r.sample_id for r in batch[0]] == sorted(r.sample_id for r in batch[0])
  s = q.stats()
  assert (s.ready_groups, s.trained_groups, s.trained_samples, s.trained_tokens) == (1, 2, 4, 7)


def test_fifo_among_equal_versions():
  q = rq.RolloutQueue(st.StalenessConfig("drop", max_lag=None, groups_per_step=1), group_size=1)
  for gid in (3, 1, 2):
    q.put(_rollout(gid, [0]))
  assert [g[0].group_id for g in q.try_get_batch(3, 0)] == [3, 1, 2]


def test_drop_policy_never_returns_stale_tokens():
  q = rq.RolloutQueue(st.StalenessConfig("drop", max_lag=1, groups_per_step=1), group_size=2)
  _put_group(q, 0, [[0, 1], [1]])
  _put_group(q, 1, [[2], [2, 2]])
  q.set_learner_version(3)
  _put_group(q, 2, [[0], [3]])  # already too stale at put time: dropped at once
  assert q.stats().waste.stale_groups == 1 and q.stats().waste.stale_tokens == 2
  batch = q.try_get_batch(1, learner_version=3)  # group 0 (oldest 0, lag 3) is dropped now
  assert batch[0][0].group_id == 1
  for r in batch[0]:
    assert rules.token_lag(r.policy_versions, 3).max() <= 1
  w = q.stats().waste
  assert (w.stale_groups, w.stale_samples, w.stale_tokens, w.wasted_tokens) == (2, 4, 5, 5)


def test_queue_drop_keeps_capacity_and_drops_oldest():
  cfg = st.StalenessConfig("queue-drop", max_lag=None, groups_per_step=1,
                           queue_capacity_groups=2)
  q = rq.RolloutQueue(cfg, group_size=1)
  for gid, v in [(0, 0), (1, 1), (2, 2), (3, 3)]:
    q.put(_rollout(gid, [v, v]))
  s = q.stats()
  assert s.ready_groups == 2 and (s.waste.overflow_groups, s.waste.overflow_tokens) == (2, 4)
  assert [g[0].group_id for g in q.try_get_batch(2, 3)] == [2, 3]
  with pytest.raises(ValueError, match="<= queue_capacity_groups=2"):
    q.try_get_batch(3, 3)


def test_aborted_samples_discard_the_group():
  q = rq.RolloutQueue(st.StalenessConfig("drop", max_lag=None, groups_per_step=1), group_size=2)
  _put_group(q, 0, [[0, 0, 0]])
  q.put(_rollout(0, [0], finish="aborted"))
  w = q.stats().waste
  assert (w.aborted_groups, w.aborted_samples, w.aborted_tokens) == (1, 2, 4)
  q.put(_rollout(1, [0, 0]))
  q.discard_group(1)  # the driver gives up on group 1; a late sample is counted and ignored
  q.put(_rollout(1, [0]))
  w = q.stats().waste
  assert (w.aborted_groups, w.aborted_samples, w.aborted_tokens) == (2, 4, 7)
  assert q.stats().partial_groups == 0 and q.stats().ready_groups == 0


def test_duplicates_rejected_and_counted_without_stopping():
  # Issue #14 item 9: a duplicate of a partial group's sample used to stop the run; a duplicate of
  # a finished sample silently reopened its group. Both are now rejected and counted.
  q = rq.RolloutQueue(st.StalenessConfig("drop", max_lag=1, groups_per_step=1), group_size=2)
  assert q.try_admit(0, 0, sample_ids=[1, 2])
  assert q.put(_rollout(0, [0], sample_id=1))
  assert not q.put(_rollout(0, [0], sample_id=1))  # duplicate of a partial group's sample
  assert not q.put(_rollout(0, [0], sample_id=7))  # not one of the group's samples
  assert q.missing_samples(0) == [2]
  assert q.put(_rollout(0, [0], sample_id=2))
  assert not q.put(_rollout(0, [0], sample_id=2))  # duplicate of a finished sample
  s = q.stats()
  assert (s.rejected_samples, s.ready_groups, s.partial_groups) == (3, 1, 0)
  assert len(q.try_get_batch(1, 0)[0]) == 2
  assert not q.put(_rollout(0, [0], sample_id=1))  # after training: still rejected
  assert q.stats().partial_groups == 0 and q.stats().rejected_samples == 4


def test_lost_sample_named_and_group_discarded_as_lost():
  q = rq.RolloutQueue(st.StalenessConfig("block", max_lag=1, groups_per_step=1), group_size=3)
  assert q.try_admit(4, 0, sample_ids=[10, 11, 12])
  q.put(_rollout(4, [0, 0], sample_id=10))
  q.put(_rollout(4, [0], sample_id=12))
  with pytest.raises(rq.QueueTimeout, match=r"not arrived: group 4: samples \[11\]"):
    q.get_batch(1, 0, timeout=0.01)
  q.discard_group(4, "lost")
  w = q.stats().waste
  assert (w.lost_groups, w.lost_samples, w.lost_tokens, q.stats().in_flight_groups) == (1, 2, 3, 0)
  q.put(_rollout(4, [0], sample_id=11))  # arrives after all: counted as lost, ignored
  assert q.stats().waste.lost_samples == 3 and q.stats().partial_groups == 0


def test_future_token_version_rejected():
  q = rq.RolloutQueue(st.StalenessConfig("drop", max_lag=None, groups_per_step=1), group_size=1)
  q.put(_rollout(0, [5]))
  with pytest.raises(ValueError, match="version 5 > learner_version 4"):
    q.try_get_batch(1, learner_version=4)
  assert q.try_get_batch(1, learner_version=5)  # the failed get did not lose the group


def test_block_admission_and_deterministic_loop():
  """Single-thread interleaving: admission through the queue keeps every lag <= k."""
  k, b, size = 1, 2, 2
  q = rq.RolloutQueue(st.StalenessConfig("block", max_lag=k, groups_per_step=b), group_size=size)
  rng = np.random.default_rng(0)
  v = w = 0
  in_flight, gid, steps = {}, 0, 0
  while steps < 12:
    while len(in_flight) < 5 and q.try_admit(gid, w):
      in_flight[gid] = [int(rng.integers(1, 25)) for _ in range(size)], [[] for _ in range(size)]
      gid += 1
    for g in list(in_flight):
      lengths, versions = in_flight[g]
      for i in range(size):
        if len(versions[i]) < lengths[i]:
          versions[i].append(w)
          if len(versions[i]) == lengths[i]:
            q.put(_rollout(g, versions[i]))
      if all(len(vs) == n for vs, n in zip(versions, lengths)):
        del in_flight[g]
    batch = q.try_get_batch(b, v)
    if batch is not None:
      for group in batch:
        for r in group:
          assert rules.token_lag(r.policy_versions, v).max() <= k
      v += 1
      steps += 1
      w = v  # immediate weight pick-up
  assert q.stats().waste.dropped_groups == 0


def test_get_batch_timeout_message_and_close():
  q = rq.RolloutQueue(st.StalenessConfig("block", max_lag=2, groups_per_step=2), group_size=2)
  assert q.try_admit(0, 0) and q.try_admit(1, 0)
  q.put(_rollout(0, [0]))
  with pytest.raises(rq.QueueTimeout, match=(r"waited 0.05 s for 2 groups at learner version 0: "
                                             r"0 ready, 1 partially finished, 2 admitted")):
    q.get_batch(2, 0, timeout=0.05)
  threading.Timer(0.05, q.close).start()
  with pytest.raises(rq.QueueClosed):
    q.get_batch(2, 0, timeout=5)


def test_threaded_producer_consumer():
  q = rq.RolloutQueue(st.StalenessConfig("drop", max_lag=None, groups_per_step=2), group_size=3)

  def producer():
    for g in range(10):
      for _ in range(3):
        q.put(_rollout(g, [0, 0]))
        time.sleep(0.001)

  t = threading.Thread(target=producer)
  t.start()
  got = [q.get_batch(2, 0, timeout=10) for _ in range(5)]
  t.join()
  assert sorted(g[0].group_id for batch in got for g in batch) == list(range(10))


def test_state_dict_round_trip():
  cfg = st.StalenessConfig("block", max_lag=1, groups_per_step=1)
  q = rq.RolloutQueue(cfg, group_size=2)
  for g in range(2):
    assert q.try_admit(g, 0)
  _put_group(q, 0, [[0, 0], [0]])
  q.put(_rollout(1, [0, 0, 0]))
  q.put(_rollout(5, [0], finish="aborted"))
  q.discard_group(5)
  state = q.state_dict()
  r = rq.RolloutQueue.from_state_dict(state)
  assert r.stats() == q.stats()
  assert r.state_dict()["admission"] == state["admission"]
  assert isinstance(state["ready"][0]["rollouts"][0]["completion_tokens"], np.ndarray)
  a, b = q.try_get_batch(1, 0), r.try_get_batch(1, 0)
  for x, y in zip(a[0], b[0]):
    for name in ("completion_tokens", "behavior_logprobs", "policy_versions", "prompt_tokens"):
      np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
    assert (x.sample_id, x.reward, x.finish_reason) == (y.sample_id, y.reward, y.finish_reason)
  r.put(_rollout(1, [0]))  # the partial group survived the round trip
  assert not r.put(_rollout(0, [0], sample_id=1000))  # group 0 stays complete after resume
  assert r.stats().ready_groups == 1
  with pytest.raises(ValueError, match="unknown format"):
    rq.RolloutQueue.from_state_dict({"format": 9})
