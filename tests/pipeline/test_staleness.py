"""Tests for the pure staleness functions, including a randomized check of the block bound."""

import numpy as np
import pytest

from rlax_pipe.pipeline import rules
from rlax_pipe.pipeline import staleness as st


def _headroom(ledger, sampler_version, config, next_train_version=None):
  """`admission_headroom` of a ledger's live groups."""
  return st.admission_headroom(ledger.num_net, ledger.oldest_version(), sampler_version, config,
                               next_train_version)


def test_config_validation():
  st.StalenessConfig("queue-drop", max_lag=None, groups_per_step=2, queue_capacity_groups=2)
  with pytest.raises(ValueError, match="choose one of"):
    st.StalenessConfig("blocking")
  with pytest.raises(ValueError, match="max_lag"):
    st.StalenessConfig("drop", max_lag=-1)
  with pytest.raises(ValueError, match="queue_capacity_groups=1 must be set and >= "):
    st.StalenessConfig("queue-drop", groups_per_step=2, queue_capacity_groups=1)
  with pytest.raises(ValueError, match="only used by policy 'queue-drop'"):
    st.StalenessConfig("drop", queue_capacity_groups=4)


def test_token_lag_and_predicates():
  np.testing.assert_array_equal(rules.token_lag(np.array([3, 4, 5]), 5), [2, 1, 0])
  with pytest.raises(ValueError, match="policy version 6 > learner version 5"):
    rules.token_lag(np.array([6]), 5)
  assert st.is_too_stale(3, 5, 1) and not st.is_too_stale(4, 5, 1)
  assert not st.is_too_stale(0, 100, None)
  assert not st.is_too_stale(np.iinfo(np.int32).max, 0, 0)  # a sample with no tokens
  assert [st.is_too_stale(o, 5, 2) for o in (4, 1, 5, 2)] == [False, True, False, True]
  assert st.queue_overflow(5, 3) == 2 and st.queue_overflow(2, 3) == 0
  assert st.queue_overflow(9, None) == 0


def test_admission_rule_by_hand():
  cfg = st.StalenessConfig("block", max_lag=1, groups_per_step=2)
  s = st.AdmissionLedger()
  # version 0, k = 1, B = 2: groups 0..3 may start (floor(n / 2) <= 1).
  assert _headroom(s, 0, cfg) == 4
  for g in range(4):
    s.admit(g, 0, cfg)
  assert not s.can_admit(0, cfg) and not s.can_admit(5, cfg)  # groups 0.. still live
  with pytest.raises(ValueError, match="would break max_lag=1"):
    s.admit(4, 0, cfg)
  s.retire([1, 2], trained=True)  # trained at version 0 -> version 1
  assert not s.can_admit(1, cfg)  # groups 0 and 3 (admitted at 0) still bound everything
  s.retire([0, 3], trained=True)  # version 2
  assert _headroom(s, 2, cfg) == 2 * (2 + 1 + 1) - 4
  # discarded groups do not count towards n.
  s.admit(10, 2, cfg)
  s.retire([10], trained=False)
  assert s.num_net == 4 and s.num_discarded == 1
  assert st.AdmissionLedger.from_dict(s.to_dict()).to_dict() == s.to_dict()
  with pytest.raises(KeyError, match=r"\[99\]"):
    s.retire([99], trained=True)
  s.admit(7, 2, cfg)
  with pytest.raises(ValueError, match="already live"):
    s.admit(7, 2, cfg)
  # other policies and unbounded block never limit admission.
  assert _headroom(s, 0, st.StalenessConfig("drop", max_lag=1, groups_per_step=1)) is None
  assert s.can_admit(0, st.StalenessConfig("block", max_lag=None, groups_per_step=1))
  # The pure rule on scalars (what the ledger feeds it): n = 4, a_min = 2, v = 3, k = 1, B = 2.
  assert st.admission_headroom(4, 2, 3, cfg) == 2 * (2 + 1 + 1) - 4
  assert st.admission_headroom(4, None, 3, cfg) == 2 * (3 + 1 + 1) - 4
  assert st.batch_size(5, 0, 2) == 2 and st.batch_size(5, 3, 2) == 3
  assert st.batch_size(1, 0, 2) is None


def test_ledger_oldest_version_and_due_at_scale():
  # 20k live groups over 20 versions (the cost per event is measured by bench_pipeline.py
  # --suite=control_plane, not here).
  cfg = st.StalenessConfig("learner-wait", max_lag=3, groups_per_step=1000)
  s = st.AdmissionLedger()
  for g in range(20000):
    s.admit(g, g // 1000, cfg)
  for g in range(20000, 22000):
    s.admit(g, 20, cfg)
    s.retire([g - 20000], trained=True)
  assert s.oldest_version() == 2 and s.num_live == 20000 and s.num_trained == 2000
  assert s.due(5, cfg) == list(range(2000, 3000))  # versions <= 5 - 3


def areal_admission_allowed(num_admitted: int, version: int, groups_per_step: int,
                            max_lag: int | None) -> bool:
  """AReaL Eq. 3 as published: admit while floor(num_admitted / B) <= version + eta.

  (AReaL writes floor((N_r - 1) / B) <= i + eta with N_r counting the new trajectory.) This
  bounds the lag only when the learner trains groups strictly in admission order. With
  out-of-order completion it does not bound per-token lag: B = 1, k = 1, group 0 is long; groups
  1 and 2 are short and trained at versions 0 and 1; group 0's first tokens (version 0) are then
  trained at version >= 2. The tests compare it with `AdmissionLedger.can_admit`, which `block` uses.
  """
  return max_lag is None or num_admitted // groups_per_step <= version + max_lag


def test_areal_rule_counterexample_and_ours():
  """B = 1, k = 1; group 0 is long, groups 1, 2 are short (docstring of areal_admission_allowed)."""
  assert areal_admission_allowed(0, 0, 1, 1) and areal_admission_allowed(1, 0, 1, 1)
  # group 1 trained at v0 -> v1; AReaL admits group 2 at v1, trained at v1 -> v2; group 0's
  # version-0 tokens would then be trained at v >= 2: lag 2 > 1.
  assert areal_admission_allowed(2, 1, 1, 1)
  cfg = st.StalenessConfig("block", max_lag=1, groups_per_step=1)
  s = st.AdmissionLedger()
  s.admit(0, 0, cfg)
  s.admit(1, 0, cfg)
  s.retire([1], trained=True)
  assert not s.can_admit(1, cfg)  # ours waits for group 0


def _simulate(cfg, seed, rule="ours", train_order="random", steps=30, slots=6):
  """Tick-level toy pipeline; returns the largest per-token lag ever trained."""
  rng = np.random.default_rng(seed)
  b, k = cfg.groups_per_step, cfg.max_lag
  state, v, w, next_gid = st.AdmissionLedger(), 0, 0, 0
  in_flight, ready, max_seen, weight_delay = {}, [], 0, []
  for _ in range(steps * 200):
    while len(in_flight) < slots:
      ok = (state.can_admit(w, cfg) if rule == "ours"
            else areal_admission_allowed(state.num_net, w, b, k))
      if not ok:
        break
      if rule == "ours":
        state.admit(next_gid, w, cfg)
      else:
        state.num_admitted += 1
      length = int(min(60, rng.pareto(1.2) * 3 + 1))
      in_flight[next_gid] = (length, [])
      next_gid += 1
    for gid in list(in_flight):
      length, versions = in_flight[gid]
      versions.append(w)  # in-flight weight updates: each token stamped with the current w
      if len(versions) == length:
        ready.append((gid, np.array(versions)))
        del in_flight[gid]
    if len(ready) >= b:
      if train_order == "random":
        idx = rng.permutation(len(ready))[:b]
      else:  # oldest first
        idx = np.argsort([r[1].min() for r in ready], kind="stable")[:b]
      batch = [ready[i] for i in idx]
      ready = [r for i, r in enumerate(ready) if i not in set(idx)]
      for _, versions in batch:
        max_seen = max(max_seen, int(rules.token_lag(versions, v).max()))
      if rule == "ours":
        state.retire([g for g, _ in batch], trained=True)
      v += 1
      weight_delay.append(v)
      if v >= steps:
        break
    if weight_delay and rng.random() < 0.5:  # the sampler picks up weights late
      w = weight_delay.pop(0)
  assert v >= steps, "the toy pipeline deadlocked"
  return max_seen


@pytest.mark.parametrize("k,b", [(0, 1), (1, 2), (2, 3)])
@pytest.mark.parametrize("order", ["random", "oldest"])
def test_block_bounds_lag_whatever_the_training_order(k, b, order):
  cfg = st.StalenessConfig("block", max_lag=k, groups_per_step=b)
  for seed in range(4):
    assert _simulate(cfg, seed, "ours", order) <= k


def test_areal_rule_can_exceed_the_bound_with_out_of_order_completion():
  cfg = st.StalenessConfig("block", max_lag=1, groups_per_step=1)
  worst = max(_simulate(cfg, seed, "areal", "oldest") for seed in range(6))
  assert worst > 1


def test_waste_counters():
  c = st.count_waste(st.WasteCounters(), "stale", 1, 4, 100)
  c = st.count_waste(c, "overflow", 2, 8, 50)
  c = st.count_waste(c, "aborted", 0, 1, 7)
  assert (c.dropped_groups, c.wasted_tokens, c.stale_samples) == (3, 157, 4)
  with pytest.raises(ValueError, match="not in"):
    st.count_waste(c, "late", 1, 1, 1)


def _simulate_queue(cfg, seed, steps=30, slots=6):
  """Toy pipeline of `_simulate` driven through a real RolloutQueue (any policy).

  Returns (largest per-token lag trained, mean slot occupancy, largest batch in groups).
  """
  from rlax_pipe.pipeline.rollout_queue import RolloutQueue  # pylint: disable=g-import-not-at-top
  from rlax_pipe.types import Rollout  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  q = RolloutQueue(cfg, group_size=1)
  v, w, next_gid, in_flight, max_seen, busy, ticks, biggest = 0, 0, 0, {}, 0, 0, 0, 0
  weight_delay = []
  for _ in range(steps * 400):
    while len(in_flight) < slots and q.try_admit(next_gid, w):
      in_flight[next_gid] = (int(min(60, rng.pareto(1.2) * 3 + 1)), [])
      next_gid += 1
    ticks, busy = ticks + 1, busy + len(in_flight)
    for gid in list(in_flight):
      length, versions = in_flight[gid]
      versions.append(w)
      if len(versions) == length:
        vs = np.array(versions, np.int32)
        q.put(Rollout(sample_id=gid, group_id=gid, prompt_tokens=np.ones(1, np.int32),
                      completion_tokens=np.ones(length, np.int32),
                      behavior_logprobs=np.zeros(length, np.float32), policy_versions=vs,
                      finish_reason="eos"))
        del in_flight[gid]
    batch = q.try_get_batch(cfg.groups_per_step, v)
    if batch is not None:
      biggest = max(biggest, len(batch))
      for group in batch:
        for r in group:
          max_seen = max(max_seen, int(rules.token_lag(r.policy_versions, v).max()))
      v += 1
      q.set_learner_version(v)
      weight_delay.append(v)
      if v >= steps:
        break
    if weight_delay and rng.random() < 0.5:  # the sampler picks up weights late
      w = weight_delay.pop(0)
  assert v >= steps, "the toy pipeline deadlocked"
  return max_seen, busy / (ticks * slots), biggest


@pytest.mark.parametrize("k,b", [(0, 1), (1, 2), (2, 3), (4, 2)])
def test_learner_wait_bounds_lag_and_keeps_the_sampler_busier(k, b):
  cfg = st.StalenessConfig("learner-wait", max_lag=k, groups_per_step=b)
  block = st.StalenessConfig("block", max_lag=k, groups_per_step=b)
  for seed in range(4):
    worst, occupancy, biggest = _simulate_queue(cfg, seed)
    assert worst <= k and biggest >= b
  if k >= 2:  # with room for staleness the sampler is never held back by one straggler
    occ_wait = np.mean([_simulate_queue(cfg, s)[1] for s in range(4)])
    occ_block = np.mean([_simulate_queue(block, s)[1] for s in range(4)])
    assert occ_wait > occ_block


def test_due_groups_and_learner_wait_admission_by_hand():
  cfg = st.StalenessConfig("learner-wait", max_lag=1, groups_per_step=2)
  s = st.AdmissionLedger()
  # AReaL Eq. 3 on the sampler version: 2 * (0 + 1 + 1) = 4 groups at version 0.
  assert _headroom(s, 0, cfg, next_train_version=0) == 4
  for g in range(4):
    s.admit(g, 0, cfg, next_train_version=0)
  assert not s.can_admit(0, cfg, 0)
  assert s.due(0, cfg) == []  # training at v0 leaves them for v1: lag 1 <= 1
  assert s.due(1, cfg) == [0, 1, 2, 3]  # at v1 all must go now (v2 would be lag 2)
  assert st.due_bound(1, cfg) == 0
  # A sampler still on version 0 may not admit once the learner's next batch is at version 2.
  s.retire([0, 1, 2, 3], trained=True)
  assert s.can_admit(1, cfg, next_train_version=2)
  assert not s.can_admit(0, cfg, next_train_version=2)
  assert s.due(5, st.StalenessConfig("block", max_lag=1, groups_per_step=2)) == []
