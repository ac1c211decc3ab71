"""Golden values of the closed-form models (each computed by hand in the comment next to it)."""

import math

import numpy as np
import pytest

from rlax_pipe.sim import formulas


def test_expected_max_of_k_small_sample():
  # Sorted 1..4, P(max <= x_i) = (i/4)^2 -> weights 1/16, 3/16, 5/16, 7/16:
  # (1 + 6 + 15 + 28) / 16 = 50 / 16 = 3.125 (the mean of max over all 16 ordered pairs).
  assert formulas.expected_max_of_k([4, 1, 3, 2], 2) == pytest.approx(3.125)
  assert formulas.expected_max_of_k([4, 1, 3, 2], 1) == pytest.approx(2.5)


def test_expected_max_matches_brute_force():
  x = np.array([3, 7, 7, 20, 1])
  pairs = [max(a, b, c) for a in x for b in x for c in x]
  assert formulas.expected_max_of_k(x, 3) == pytest.approx(np.mean(pairs))


def test_tailness():
  assert formulas.tailness([4, 1, 3, 2], 2) == pytest.approx(3.125 / 2.5)  # 1.25
  assert formulas.tailness([5, 5, 5], 8) == pytest.approx(1.0)
  assert formulas.tailness([1, 100], 1) == pytest.approx(1.0)
  # groups [1, 3] and [2, 2]: mean of maxima 2.5, mean length 2 -> 1.25
  assert formulas.tailness_from_groups(np.array([[1, 3], [2, 2]])) == pytest.approx(1.25)


def test_applied_compute_staleness_golden():
  # Applied Compute's first validation run: C=120, B=240, q=2, rho=0.63, M_tail=1.42:
  # 120 * 1.42 / 240 + 0.63 = 0.71 + 0.63 = 1.34 (their predicted value).
  assert formulas.applied_compute_staleness(120, 240, 0.63, 1.42, 2.0) == pytest.approx(1.34)
  # Train-bound, C=128, B=128, q=1, rho=1.14, M_tail=1.45:
  # 1.45 / 1.14 + (2 + 1.14 - 1) / 2.28 = 1.271930 + 0.938596 = 2.210526.
  assert formulas.applied_compute_staleness(128, 128, 1.14, 1.45, 1.0) == pytest.approx(
      2.210526, abs=1e-6)
  # Continuity at rho = 1 for q = 1: both branches give C M / B + 1.
  lo = formulas.applied_compute_staleness(64, 32, 1.0, 1.5)
  hi = formulas.applied_compute_staleness(64, 32, 1.0 + 1e-9, 1.5)
  assert lo == pytest.approx(4.0) and hi == pytest.approx(4.0, abs=1e-6)
  with pytest.raises(ValueError):
    formulas.applied_compute_staleness(64, 32, 0.5, 0.9)


def test_pipeline_max_lag():
  assert formulas.pipeline_max_lag(10.0, 3.0) == 4  # ceil(3.33)
  assert formulas.pipeline_max_lag(9.0, 3.0) == 3
  assert formulas.pipeline_max_lag(0.0, 1.0) == 0
  with pytest.raises(ValueError):
    formulas.pipeline_max_lag(1.0, 0.0)


def test_split_and_period():
  # N=10, rho=1, c_T=1, c_R=4: n_T = 10 / (1 + 1/4) = 8, n_R = 2; then v_train = 8 = v_rollout.
  n_t, n_r = formulas.split_for_rho(10, 1.0, 1.0, 4.0)
  assert (n_t, n_r) == (pytest.approx(8.0), pytest.approx(2.0))
  # B=8: period = 8/10 * 1 * (1 + 1/4) = 1.0 s = B / v_train.
  assert formulas.step_period(8, 10, 1.0, 1.0, 4.0) == pytest.approx(1.0)
  # rho=0.5: n_T = 10/1.125 = 8.889, v_rollout = 0.5 * 8.889 = 4.444 -> B / v_rollout = 1.8 s;
  # formula: 0.8 * 2 * (1 + 0.125) = 1.8.
  assert formulas.step_period(8, 10, 0.5, 1.0, 4.0) == pytest.approx(1.8)
  # rho=2: 0.8 * (1 + 0.5) = 1.2; the optimum is rho = 1.
  assert formulas.step_period(8, 10, 2.0, 1.0, 4.0) == pytest.approx(1.2)


def test_sync_idle_fraction():
  # 4 samples on 4 slots: busy slot-steps 1+2+3+10 = 16 of 4 * 10 = 40 -> idle 0.6.
  assert formulas.sync_idle_fraction([1, 2, 3, 10], 4) == pytest.approx(0.6)
  # 2 slots, FIFO: slot a runs 1 then 3 (ends at 4), slot b runs 2 then 10 (ends at 12):
  # idle = 1 - 16 / (2 * 12) = 1/3.
  assert formulas.sync_idle_fraction([1, 2, 3, 10], 2) == pytest.approx(1 / 3)
  assert formulas.sync_idle_fraction([5, 5, 5, 5], 4) == pytest.approx(0.0)
  # More slots than samples: the unused slots are idle too (2 of 4 busy for 5 steps).
  assert formulas.sync_idle_fraction([5, 5], 4) == pytest.approx(0.5)


def test_lognormal_expected_max():
  # 100 * exp(0.5 * sqrt(2 ln 8) - 0.125) = 100 * exp(1.019672 - 0.125) = 244.652.
  assert formulas.lognormal_expected_max(100.0, 0.5, 8) == pytest.approx(244.652, abs=1e-3)
  # k = 1: the median exp(m) = mean * exp(-s^2/2).
  assert formulas.lognormal_expected_max(100.0, 1.0, 1) == pytest.approx(100 * math.exp(-0.5))
  assert formulas.lognormal_tailness(0.0, 16) == pytest.approx(1.0)


def test_lognormal_approximation_overestimates_moderately():
  rng = np.random.default_rng(0)
  sigma, k = 0.5, 256
  draws = np.exp(sigma * rng.standard_normal((2000, k)) - sigma ** 2 / 2)  # mean 1
  empirical = draws.max(axis=1).mean()  # ~3.71
  approx = formulas.lognormal_expected_max(1.0, sigma, k)  # 4.67
  assert empirical < approx < 1.3 * empirical
