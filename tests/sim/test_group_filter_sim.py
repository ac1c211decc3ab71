"""Dynamic sampling in the simulator: the Beta solve-rate model against independent references,
the over-sampling against its closed form, the bound, the staleness bound, and `off` unchanged."""

import dataclasses

import numpy as np
import pytest

from rlax_pipe.costs import CostModel
from rlax_pipe.pipeline.group_filter import GroupFilterConfig
from rlax_pipe.pipeline.staleness import StalenessConfig
from rlax_pipe.sim import distributions as dist
from rlax_pipe.sim import rewards
from rlax_pipe.sim import simulator as sim

COSTS = CostModel(decode_step_s=0.01, slot_step_s=2e-4, train_step_s=0.05, train_token_s=1e-4,
                  source="test")
ZV = GroupFilterConfig("zero_variance", max_dropped_per_step=64)


def _cfg(driver="sync", policy="block", max_lag=2, steps=60, **kw):
  return sim.SimConfig(driver=driver, staleness=StalenessConfig(policy, max_lag, 4), group_size=4,
                       num_steps=steps, slots_per_engine=32, lengths=dist.LogNormal(60, 0.8),
                       costs=COSTS, **kw)


@pytest.mark.parametrize("alpha,beta,size", [(1.0, 1.0, 4), (0.5, 2.0, 8), (3.0, 0.7, 2)])
def test_zero_variance_probability_matches_integral_and_draws(alpha, beta, size):
  model = rewards.SolveRate(alpha, beta)
  p = model.zero_variance_probability(size)
  # Reference 1: E[q^S + (1 - q)^S] under Beta(alpha, beta), by quadrature in float64 (the
  # substitution q = t^(1/alpha) removes the endpoint singularity of q^(alpha - 1)).
  t = np.linspace(0.0, 1.0, 400_001)
  q = t ** (1.0 / alpha)
  with np.errstate(divide="ignore"):
    w = (1.0 - q) ** (beta - 1.0) / alpha  # pdf * dq/dt, up to 1/B(alpha, beta)
  w[-1] = 0.0 if beta > 1 else w[-2]
  f = q ** size + (1.0 - q) ** size
  assert p == pytest.approx(np.trapezoid(f * w, t) / np.trapezoid(w, t), rel=2e-3)
  # Reference 2: the draws the simulator uses.
  draws = model.sample_groups(np.random.default_rng(0), 200_000, size)
  assert set(np.unique(draws)) <= {0.0, 1.0}
  frac = np.mean(draws.min(axis=1) == draws.max(axis=1))
  assert frac == pytest.approx(p, abs=4 * np.sqrt(p * (1 - p) / 200_000))


def test_oversampling_matches_the_geometric_closed_form():
  """Sync, bound never reached: every admitted group is zero-variance independently with
  probability p, so a batch of B kept groups costs B / (1 - p) groups on average."""
  model = rewards.SolveRate(1.0, 1.0)
  res = sim.simulate(dataclasses.replace(_cfg(steps=400, rewards=model, group_filter=ZV),
                                         lengths=dist.Constant(8)))
  p = model.zero_variance_probability(4)  # = 0.4
  assert res.filter_kept_groups == 0
  assert res.generated_samples_per_step == pytest.approx(16 / (1 - p), rel=0.03)
  assert res.token_lag_max == 0  # sync: replacements start with the round's weights
  assert res.waste.filtered_groups * 4 == res.waste.filtered_samples
  assert res.waste.wasted_tokens == res.waste.filtered_tokens > 0


def test_all_zero_variance_terminates_at_the_bound():
  """Every reward equal: each sync step drops exactly max_dropped groups, then trains the B
  groups that complete next (zero advantage) and counts them."""
  replay = rewards.RewardReplay(((1.0, 1.0, 1.0, 1.0),))
  res = sim.simulate(_cfg(steps=20, rewards=replay,
                          group_filter=GroupFilterConfig("zero_variance", 3)))
  assert res.steps == 20
  assert res.generated_samples_per_step == (4 + 3) * 4
  assert res.waste.filtered_groups == 20 * 3 and res.filter_kept_groups == 20 * 4


@pytest.mark.parametrize("driver,policy,max_lag", [
    ("pipeline", "block", 1), ("pipeline", "learner-wait", 2), ("pipeline", "drop", 1),
    ("async-batch", "block", 1)])
def test_filter_keeps_the_staleness_bound_and_batch_size(driver, policy, max_lag):
  res = sim.simulate(_cfg(driver, policy, max_lag, steps=25, record_schedule=True,
                          rewards=rewards.SolveRate(0.7, 0.7), group_filter=ZV))
  assert res.waste.filtered_groups > 0
  assert res.token_lag_max <= max_lag
  sizes = {len(samples) for _, samples in res.schedule}
  assert min(sizes) >= 16 and (policy == "learner-wait" or sizes == {16})


def test_off_is_unchanged_by_a_reward_model():
  base = sim.simulate(_cfg("pipeline", record_schedule=True))
  with_rewards = sim.simulate(_cfg("pipeline", record_schedule=True,
                                   rewards=rewards.SolveRate(1.0, 1.0)))
  assert with_rewards.schedule == base.schedule
  assert dataclasses.replace(with_rewards, schedule=None) == dataclasses.replace(base,
                                                                                 schedule=None)


def test_validation():
  with pytest.raises(ValueError, match="rewards is None"):
    _cfg(group_filter=ZV)
  with pytest.raises(ValueError, match="must be > 0"):
    rewards.SolveRate(0.0, 1.0)
  with pytest.raises(ValueError, match="not 3"):
    rewards.RewardReplay(((0.0, 1.0),)).sample_groups(None, 1, 3)
