"""Group-relative advantages: golden values, exact zeros, the missing-reward rule, registry."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from rlax_pipe import advantages

NAMES = tuple(advantages.ADVANTAGES)


def test_golden_values():
  r = np.array([[1.0, 0.0, 0.0], [3.0, 1.0, 2.0]], np.float32)
  # Group 0: mean 1/3, population std sqrt(2/9) = 0.4714045; group 1: mean 2, std sqrt(2/3).
  np.testing.assert_allclose(
      advantages.grpo(r), [[1.4142135, -0.7071068, -0.7071068], [1.2247449, -1.2247449, 0.0]],
      rtol=1e-5)
  np.testing.assert_allclose(advantages.dr_grpo(r), [[2 / 3, -1 / 3, -1 / 3], [1.0, -1.0, 0.0]],
                             rtol=1e-6)
  # Leave-one-out: 1 - mean(0, 0) = 1, 0 - mean(1, 0) = -.5; 3 - 1.5, 1 - 2.5, 2 - 2.
  np.testing.assert_allclose(advantages.rloo(r), [[1.0, -0.5, -0.5], [1.5, -1.5, 0.0]],
                             rtol=1e-6)
  # Sample std (ddof=1) for group 0: sqrt(1/3).
  np.testing.assert_allclose(advantages.grpo(r[:1], std_ddof=1),
                             [[1.1547005, -0.5773503, -0.5773503]], rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [0.1, 1e-7, -3.3, 0.7, 123.456])
@pytest.mark.parametrize("size", [2, 3, 7, 16])
def test_equal_rewards_give_exactly_zero(name, value, size):
  r = np.full((2, size), value, np.float32)
  out = advantages.get_advantage_fn(name)(r)
  assert out.dtype == np.float32 and out.shape == (2, size)
  assert np.all(out == 0.0), out


@settings(max_examples=60, deadline=None)
@given(value=st.floats(-1e6, 1e6, allow_nan=False, width=32),
       size=st.integers(1, 20), name=st.sampled_from(NAMES))
def test_equal_rewards_exact_zero_property(value, size, name):
  assert np.all(advantages.get_advantage_fn(name)(np.full((3, size), value, np.float32)) == 0.0)


def test_missing_rewards_rule():
  nan = np.nan
  r = np.array([[nan, 1.0, 0.0], [nan, 1.0, nan], [nan, nan, nan], [1.0, 0.0, 0.0]])
  for name in NAMES:
    out = advantages.get_advantage_fn(name)(r)
    assert np.all(np.isfinite(out))
    # The NaN sample gets 0; the group is computed from the valid rewards only.
    np.testing.assert_allclose(out[0], np.concatenate(
        [[0.0], advantages.get_advantage_fn(name)(r[:1, 1:])[0]]), rtol=1e-6)
    # A group with < 2 valid rewards, or none, gets all zeros.
    assert np.all(out[1] == 0.0) and np.all(out[2] == 0.0)
  np.testing.assert_allclose(advantages.rloo(r)[0], [0.0, 1.0, -1.0])
  np.testing.assert_allclose(advantages.dr_grpo(r)[0], [0.0, 0.5, -0.5])


@pytest.mark.parametrize("name", NAMES)
def test_flat_rewards_with_group_ids_match_grouped_layout(name):
  fn = advantages.get_advantage_fn(name)
  # Groups with ids 7 (three samples), 3 (two samples) and 11 (one sample), interleaved.
  flat = np.array([1.0, 0.0, 2.0, 5.0, 0.5, np.nan, 4.0], np.float32)
  ids = np.array([7, 3, 7, 3, 7, 7, 11])
  out = fn(flat, ids)
  assert out.shape == (7,) and out.dtype == np.float32
  np.testing.assert_allclose(out[[0, 2, 4]], fn(np.array([[1.0, 2.0, 0.5]]))[0], rtol=1e-6)
  np.testing.assert_allclose(out[[1, 3]], fn(np.array([[0.0, 5.0]]))[0], rtol=1e-6)
  assert out[5] == 0.0 and out[6] == 0.0  # missing reward; singleton group


@settings(max_examples=40, deadline=None)
@given(rewards=st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=12),
       shift=st.floats(-50, 50, allow_nan=False))
def test_baselines_sum_to_zero_and_ignore_shifts(rewards, shift):
  r = np.asarray([rewards], np.float64)
  for name in NAMES:
    out = advantages.get_advantage_fn(name)(r)
    spread = max(1.0, float(np.max(np.abs(r))))
    np.testing.assert_allclose(out.sum(), 0.0, atol=1e-4 * spread * r.size)
    np.testing.assert_allclose(advantages.get_advantage_fn(name)(r + shift), out,
                               atol=1e-3 * (1 + abs(shift)))
  spread = float(np.std(r))
  if spread > 1e-2:
    np.testing.assert_allclose(np.std(advantages.grpo(r)), 1.0, rtol=1e-3)
  # rloo = n / (n - 1) * dr_grpo.
  n = r.size
  np.testing.assert_allclose(advantages.rloo(r), n / (n - 1) * advantages.dr_grpo(r),
                             atol=1e-4 * max(1.0, float(np.max(np.abs(r)))))


def test_registry_and_typo():
  assert set(NAMES) == {"grpo", "dr_grpo", "rloo"}
  assert advantages.get_advantage_fn("rloo") is advantages.rloo
  with pytest.raises(ValueError, match="dr_grpo") as err:
    advantages.get_advantage_fn("drgrpo")
  for name in NAMES:
    assert name in str(err.value)


@pytest.mark.parametrize("args,kwargs,error", [
    ((np.zeros(4),), {}, ValueError),  # flat rewards need group ids
    ((np.zeros((2, 2)), np.zeros(4, np.int32)), {}, ValueError),
    ((np.zeros(4), np.zeros(3, np.int32)), {}, ValueError),
    ((np.zeros(4), np.zeros(4)), {}, TypeError),  # float group ids
    ((np.array([["a", "b"]]),), {}, TypeError),
    ((np.zeros((1, 2)),), {"eps": 0.0}, ValueError),
    ((np.zeros((1, 2)),), {"std_ddof": 2}, ValueError),
])
def test_input_errors(args, kwargs, error):
  with pytest.raises(error):
    advantages.grpo(*args, **kwargs)


def test_empty_input():
  assert advantages.rloo(np.zeros((0,)), np.zeros((0,), np.int32)).shape == (0,)
  assert advantages.grpo(np.zeros((0, 4))).shape == (0, 4)
  assert math.isclose(float(advantages.grpo(np.array([[0.0, 1.0]]))[0, 1]), 1.0, rel_tol=1e-5)
