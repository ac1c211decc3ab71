"""Simulator sanity: exact small cases, the staleness bound, monotonicity, and the closed forms."""

import dataclasses

import numpy as np
import pytest

from rlax_pipe.costs import CostModel
from rlax_pipe.pipeline.staleness import StalenessConfig
from rlax_pipe.sim import distributions as dist
from rlax_pipe.sim import formulas
from rlax_pipe.sim import simulator as sim

COSTS = CostModel(decode_step_s=0.01, slot_step_s=1e-4, prefill_token_s=1e-4, train_step_s=0.02,
                  train_token_s=2e-5, push_s=0.005)
PROMPT = dist.Constant(2)  # one prefilled token per sample (the last prompt token is decoded)


def _cfg(driver="pipeline", max_lag=1, policy="block", groups=4, size=4, steps=120, slots=32,
         lengths=dist.LogNormal(100, 0.75, 1000), costs=COSTS, warmup=20, seed=0, queue=None,
         engines=1):
  return sim.SimConfig(driver=driver, staleness=StalenessConfig(policy, max_lag, groups, queue),
                       group_size=size, num_steps=steps, slots_per_engine=slots, lengths=lengths,
                       costs=costs, num_engines=engines, warmup_steps=warmup, seed=seed,
                       prompt_lengths=PROMPT)


def test_sync_constant_lengths_exact_period():
  # 2 groups x 4 samples of 10 tokens, 2-token prompts, on 8 slots: prefill 8 x 1 token x 1e-4 =
  # 0.0008; 10 decode steps of 0.01 + 8e-4 = 0.0108 -> 0.108; train on 8 x (2 + 10) = 96 tokens
  # 0.02 + 2e-5 * 96 = 0.02192; push 0.005. Period 0.13572 s; 80 completion tokens per period.
  r = sim.simulate(_cfg("sync", 0, groups=2, slots=8, lengths=dist.Constant(10), steps=10,
                        warmup=2))
  assert r.step_period_s == pytest.approx(0.13572)
  assert r.tokens_per_s == pytest.approx(80 / 0.13572)
  assert r.token_lag_max == 0 and r.slot_occupancy == pytest.approx(1.0)
  assert r.idle_learner == pytest.approx(1 - 0.02192 / 0.13572)


def test_sync_slot_idle_matches_closed_form():
  # Free learner and push, constant decode latency, no prefill: the window is back-to-back
  # rounds of the same replayed lengths, so slot idle = formulas.sync_idle_fraction.
  lengths = [3, 5, 9, 40, 2, 2, 7, 11]
  costs = CostModel(decode_step_s=0.01, slot_step_s=0, prefill_token_s=0, train_step_s=0,
                    push_s=0)
  r = sim.simulate(_cfg("sync", 0, groups=2, slots=6, lengths=dist.Replay.of(lengths, 4),
                        costs=costs, steps=6, warmup=1))
  assert r.slot_idle == pytest.approx(formulas.sync_idle_fraction(lengths, 6))


@pytest.mark.parametrize("driver", ["sync", "async-batch"])
def test_sync_idle_grows_with_tail_heaviness(driver):
  idle, ratio = [], []
  for sigma in (0.1, 0.6, 1.2):
    r = sim.simulate(_cfg(driver, 0 if driver == "sync" else 1, groups=8, size=16, slots=128,
                          lengths=dist.LogNormal(100, sigma, 4000), steps=30, warmup=5))
    idle.append(r.slot_idle)
    ratio.append(r.sync_t99_s / r.sync_t100_s)
  assert idle[0] < idle[1] < idle[2]
  assert 1.0 >= ratio[0] > ratio[2]  # the last 1% of samples takes a growing share of a round


@pytest.mark.parametrize("max_lag", [0, 1, 2, 3])
@pytest.mark.parametrize("lengths", [dist.Pareto(10, 1.1, 2000), dist.LogNormal(80, 1.2, 2000)])
def test_pipeline_lag_never_exceeds_max_lag_under_block(max_lag, lengths):
  r = sim.simulate(_cfg(max_lag=max_lag, lengths=lengths, slots=64, steps=80, warmup=0))
  assert r.token_lag_max <= max_lag
  assert len(r.lag_hist) <= max_lag + 1
  assert r.waste.wasted_tokens == 0
  assert r.wasted_token_fraction == 0.0


def test_drop_policy_bounds_lag_and_counts_waste():
  r = sim.simulate(_cfg(max_lag=1, policy="drop", slots=64, lengths=dist.Pareto(10, 1.1, 2000),
                        steps=80))
  assert r.token_lag_max <= 1
  assert r.waste.stale_groups > 0 and r.waste.stale_tokens > 0
  assert 0 < r.wasted_token_fraction < 1


def test_throughput_is_monotone_in_max_lag():
  tput = [sim.simulate(_cfg(max_lag=k, slots=64)).tokens_per_s for k in (0, 1, 2, 4, 8)]
  for a, b in zip(tput, tput[1:]):
    assert b >= 0.98 * a
  assert tput[-1] > 1.5 * tput[0]


def test_pipeline_beats_sync_with_a_long_tail():
  lengths = dist.LogNormal(100, 1.0, 4000)
  s = sim.simulate(_cfg("sync", 0, slots=64, lengths=lengths))
  p = sim.simulate(_cfg("pipeline", 4, slots=64, lengths=lengths))
  assert p.tokens_per_s > 1.5 * s.tokens_per_s
  assert p.slot_idle < s.slot_idle


def test_applied_compute_formula_rollout_bound():
  lengths = dist.LogNormal(100, 0.5, 1000)
  costs = CostModel(decode_step_s=0.01, slot_step_s=1e-4, prefill_token_s=0, train_step_s=0,
                    train_token_s=1e-4, push_s=0)
  cfg = _cfg(max_lag=None, groups=8, size=4, slots=64, lengths=lengths, costs=costs, steps=300,
             warmup=50)
  r = sim.simulate(cfg)
  _, _, rho = sim.rates(cfg)
  assert 0.2 < rho < 0.6
  tail = formulas.tailness(lengths.sample(np.random.default_rng(1), 100_000), 4)
  predicted = formulas.applied_compute_staleness(r.mean_active_slots, cfg.batch_samples, rho,
                                                 tail)
  assert r.sample_lag_mean == pytest.approx(predicted, rel=0.1)


def test_applied_compute_formula_train_bound_queue_drop():
  lengths = dist.LogNormal(100, 0.5, 1000)
  costs = CostModel(decode_step_s=0.01, slot_step_s=1e-4, prefill_token_s=0, train_step_s=0,
                    train_token_s=6e-4, push_s=0)
  cfg = _cfg(max_lag=None, policy="queue-drop", queue=8, groups=8, size=4, slots=64,
             lengths=lengths, costs=costs, steps=200, warmup=50)
  r = sim.simulate(cfg)
  _, _, rho = sim.rates(cfg)
  assert rho > 1.5
  tail = formulas.tailness(lengths.sample(np.random.default_rng(1), 100_000), 4)
  predicted = formulas.applied_compute_staleness(r.mean_active_slots, cfg.batch_samples, rho,
                                                 tail, queue_factor=1.0)
  assert r.sample_lag_mean == pytest.approx(predicted, rel=0.15)
  assert r.waste.overflow_groups > 0


def test_deterministic_per_seed():
  a, b = sim.simulate(_cfg(seed=3)), sim.simulate(_cfg(seed=3))
  c = sim.simulate(_cfg(seed=4))
  assert a == b
  assert a.tokens_per_s != c.tokens_per_s


def test_more_engines_more_throughput():
  one = sim.simulate(_cfg(max_lag=4, slots=16, engines=1))
  two = sim.simulate(_cfg(max_lag=4, slots=16, engines=2))
  assert two.tokens_per_s > one.tokens_per_s


def test_is_fast():
  import time  # pylint: disable=import-outside-toplevel
  t0 = time.process_time()  # CPU time of this process: robust to other jobs on the machine
  r = sim.simulate(_cfg(max_lag=2, groups=2, size=4, slots=32, steps=1000, warmup=10))
  assert r.steps == 1000
  assert time.process_time() - t0 < 5.0  # ~0.5 s on an idle dev-cpu core


def test_config_validation():
  with pytest.raises(ValueError, match="group_size"):
    _cfg(slots=2, size=4)
  with pytest.raises(ValueError, match="driver"):
    _cfg(driver="nope")
  with pytest.raises(ValueError, match="warmup"):
    dataclasses.replace(_cfg(), warmup_steps=500)


def test_result_to_dict_is_json_ready():
  import json  # pylint: disable=import-outside-toplevel
  d = sim.simulate(_cfg(steps=30, warmup=5)).to_dict()
  json.dumps(d)
  assert d["steps"] == 30 and isinstance(d["lag_hist"], list)


def test_learner_wait_beats_block_when_sampling_bound_and_keeps_the_bound():
  """Same queue code as the pipeline: learner-wait keeps the sampler fuller than block."""
  res = {}
  for policy in ("block", "learner-wait"):
    cfg = sim.SimConfig(driver="pipeline", staleness=StalenessConfig(policy, 4, 8), group_size=8,
                        num_steps=60, slots_per_engine=64, lengths=dist.LogNormal(40, 1),
                        costs=CostModel(decode_step_s=0.01, slot_step_s=2e-4, train_step_s=0.05,
                                        train_token_s=1e-4))
    res[policy] = sim.simulate(cfg)
    assert res[policy].token_lag_max <= 4
  assert res["learner-wait"].tokens_per_s > 1.1 * res["block"].tokens_per_s
  assert res["learner-wait"].slot_occupancy > res["block"].slot_occupancy
