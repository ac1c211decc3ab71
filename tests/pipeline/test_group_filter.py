"""Dynamic sampling (issue #24 item 3): the zero-variance rule against the advantage estimators,
the queue's drops, bound and admission release, and the replacement rules of the drivers."""

import dataclasses

import numpy as np
import pytest

from rlax_pipe import advantages
from rlax_pipe.pipeline import group_filter as gf
from rlax_pipe.pipeline import rollout_queue as rq
from rlax_pipe.pipeline import rules
from rlax_pipe.pipeline import staleness as st
from rlax_pipe.pipeline.config import PipelineConfig
from rlax_pipe.types import Rollout

_SID = iter(range(10**9))
ZV = gf.GroupFilterConfig("zero_variance", max_dropped_per_step=2)


def _group(q, gid, rewards, tokens=3):
  for r in rewards:
    q.put(Rollout(sample_id=next(_SID), group_id=gid, prompt_tokens=np.ones(2, np.int32),
                  completion_tokens=np.zeros(tokens, np.int32),
                  behavior_logprobs=np.zeros(tokens, np.float32),
                  policy_versions=np.zeros(tokens, np.int32), finish_reason="eos",
                  reward=float(r)))


def test_has_signal_is_exactly_when_some_advantage_is_nonzero():
  """Reference: the group-relative estimators themselves (float64 numpy)."""
  rng = np.random.default_rng(0)
  cases = [[0.1, 0.1, 0.1], [1, 1], [0, 1], [np.nan, 1, 1], [np.nan, 0, 1], [np.nan, np.nan, 1],
           [np.nan] * 3, [2.5], [-1, -1, -1, -1.0000001]]
  cases += [rng.choice([0.0, 0.5, 1.0, np.nan], size=int(rng.integers(1, 6))) for _ in range(200)]
  for rewards in cases:
    r = np.asarray(rewards, np.float64)
    nonzero = any(np.any(fn(r[None]) != 0) for fn in (advantages.grpo, advantages.rloo,
                                                       advantages.dr_grpo))
    assert gf.has_signal(r) == nonzero, rewards
  with pytest.raises(ValueError, match="one group"):
    gf.has_signal(np.zeros((2, 2)))


def test_should_drop_and_its_bound():
  assert gf.should_drop(ZV, [1, 1], 0) and gf.should_drop(ZV, [0, 0], 1)
  assert not gf.should_drop(ZV, [1, 1], 2)  # at the bound: kept
  assert not gf.should_drop(ZV, [0, 1], 0)
  assert not gf.should_drop(gf.GroupFilterConfig(), [1, 1], 0)  # off
  assert gf.matches(ZV, [1, 1]) and not gf.matches(ZV, [0, 1])
  assert not gf.matches(gf.GroupFilterConfig(), [1, 1])


def test_config_validation_names_the_flag():
  with pytest.raises(ValueError, match="--config.pipeline.filter_groups"):
    PipelineConfig(filter_groups="zero-variance")
  with pytest.raises(ValueError, match="--config.pipeline.filter_max_dropped_per_step"):
    PipelineConfig(filter_groups="zero_variance", filter_max_dropped_per_step=0)
  p = PipelineConfig(filter_groups="zero_variance", filter_max_dropped_per_step=5)
  assert p.group_filter == gf.GroupFilterConfig("zero_variance", 5)
  assert not PipelineConfig().group_filter.active  # default: off


def test_queue_drops_counts_releases_admission_and_bounds_drops():
  cfg = st.StalenessConfig("block", max_lag=0, groups_per_step=2)
  q = rq.RolloutQueue(cfg, group_size=2, group_filter=ZV)
  for gid in range(2):
    assert q.try_admit(gid, 0)
  assert not q.try_admit(2, 0)  # B * (0 + 0 + 1) = 2 admitted: full
  _group(q, 0, [1, 1], tokens=3)  # zero variance: dropped
  s = q.stats()
  assert (s.waste.filtered_groups, s.waste.filtered_samples, s.waste.filtered_tokens) == (1, 2, 6)
  assert s.waste.wasted_tokens == 6 and s.ready_groups == 0 and q.filtered_groups() == 1
  assert q.try_admit(2, 0)  # the drop released its admission: a replacement may start
  _group(q, 1, [0, 0])       # second drop since the last batch
  assert q.try_admit(3, 0)
  _group(q, 2, [1, 1])       # bound (2) reached: kept, trained with zero advantage, counted
  _group(q, 3, [0, 1])
  assert q.filtered_groups() == 2 and q.stats().filter_kept_groups == 1
  batch = q.try_get_batch(2, 0)
  assert sorted(g[0].group_id for g in batch) == [2, 3]
  assert q.try_admit(4, 1)
  _group(q, 4, [0, 0])  # the count restarts after a batch: dropped again
  assert q.filtered_groups() == 3
  # Resume keeps the counters (and the bound's count since the last batch).
  q2 = rq.RolloutQueue.from_state_dict(q.state_dict(), cfg, ZV)
  assert q2.stats() == q.stats() and q2.state_dict() == q.state_dict()


def test_off_trains_zero_variance_groups():
  q = rq.RolloutQueue(st.StalenessConfig("drop", max_lag=None, groups_per_step=1), group_size=2)
  _group(q, 0, [1, 1])
  assert len(q.try_get_batch(1, 0)) == 1 and q.stats().waste.filtered_groups == 0


def test_unscored_and_aborted_keep_their_reasons():
  q = rq.RolloutQueue(st.StalenessConfig("drop", max_lag=None, groups_per_step=1), group_size=2, group_filter=ZV)
  _group(q, 0, [np.nan, np.nan])
  assert q.stats().waste.unscored_groups == 1 and q.filtered_groups() == 0
  _group(q, 1, [np.nan, 1.0])  # one valid reward: no baseline, no signal
  assert q.filtered_groups() == 1


def test_reopen_filtered_rule():
  s = rules.RoundState(rounds_started=3, round_open=0)
  assert rules.reopen_filtered("pipeline", s, 2) == s
  for driver in ("sync", "async-batch"):
    s2 = rules.reopen_filtered(driver, s, 2)
    assert s2 == dataclasses.replace(s, round_open=2)
    # Re-opened groups start at once, even while the round's others run (no new round).
    assert rules.begin_top_up(driver, s2, has_work=True, weights_version=2,
                              groups_per_step=4) == (s2, True)
  with pytest.raises(ValueError):
    rules.reopen_filtered("sync", s, -1)


def test_deadlock_rule():
  assert rules.deadlocked(True, 3, 3)
  assert not rules.deadlocked(True, 3, 4)  # a drop released an admission
  assert not rules.deadlocked(False, 3, 3)
