"""Off-policy diagnostics and lag rules (rlax_pipe.offpolicy), through the objectives and alone."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import objectives
from rlax_pipe.learner import token_loss
from rlax_pipe import offpolicy
from rlax_pipe.objectives import ObjectiveConfig

NAMES = tuple(objectives.OBJECTIVES)


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  logp = (rng.normal(size=(2, 4)) - 1.0).astype(np.float32)
  mu = (logp + 0.5 * rng.normal(size=(2, 4))).astype(np.float32)
  adv = rng.normal(size=(2, 4)).astype(np.float32)
  return jnp.asarray(logp), jnp.asarray(mu), jnp.asarray(adv)


@pytest.mark.parametrize("name", NAMES)
def test_on_policy_ess_is_one_and_nothing_is_truncated(name):
  logp, _, adv = _batch()
  mask = jnp.asarray([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
  _, d = token_loss.objective_loss(logp, logp, adv, mask, jnp.zeros((2, 4), jnp.int32),
                                   ObjectiveConfig(name=name))
  assert float(d.ess) == 1.0
  assert float(d.ratio_mean) == 1.0 and float(d.ratio_var) == 0.0
  assert float(d.kl_k3) == 0.0 and float(d.logp_mismatch_max) == 0.0
  assert float(d.frac_truncated) == 0.0 and float(d.frac_masked) == 0.0
  assert int(d.tokens) == 7


def _ess_reference(w, valid):
  """Kong (1992) normalized ESS (sum w)^2 / (N sum w^2) over valid tokens, float64."""
  w = np.asarray(w, np.float64)[np.asarray(valid)]
  return 0.0 if w.size == 0 else float(w.sum() ** 2 / (w.size * (w * w).sum()))


def _diagnosed_ess(w, valid):
  """The diagnostics' ESS of importance ratios w (behaviour log-prob 0, policy log-prob log w)."""
  w = np.asarray(w, np.float32)
  logp = jnp.asarray(np.log(np.where(np.asarray(valid), w, 1.0)), jnp.float32)
  _, d = token_loss.objective_loss(logp, jnp.zeros_like(logp), jnp.ones_like(logp),
                                   jnp.asarray(valid, jnp.float32),
                                   jnp.zeros(logp.shape, jnp.int32), ObjectiveConfig())
  return float(d.ess)


@pytest.mark.parametrize("w, valid", [
    ([[2.0, 2.0, 2.0, 2.0]], [[True] * 4]),
    ([[1.0, 1e-30, 1e-30, 1e-30]], [[True] * 4]),
    ([[1.0, 3.0, 1e30, 7.0]], [[True, True, False, False]]),  # invalid tokens are ignored
    ([[1e8, 3e8, 1e8, 3e8]], [[True] * 4]),  # scale-free (log ratios stay inside the clamp)
    ([[0.5, 1.5, 2.5], [4.0, 0.25, 1.0]], [[True, True, False], [True, True, True]]),
])
def test_diagnostics_ess_matches_kongs_formula(w, valid):
  """#25 step 5: one ESS formula (the diagnostics' log-sum-exp form), checked against float64."""
  np.testing.assert_allclose(_diagnosed_ess(w, valid), _ess_reference(w, valid), rtol=1e-5)


def test_lag_histogram_bins_and_overflow_bin():
  lag = jnp.asarray([[0, 1, 2, 3, 4, 9], [-1, 0, 3, 3, 2, 1]], jnp.int32)
  mask = jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 0]], jnp.float32)
  hist = offpolicy.lag_histogram(lag, mask, bins=4)
  # lags of mask tokens: 0 1 2 3 4 9 | -1(->0) 0 3 2 ; bin 3 collects 3, 4, 9, 3.
  np.testing.assert_array_equal(hist, [3, 1, 2, 4])
  assert hist.dtype == jnp.int32


def test_lag_histogram_through_objective_uses_hist_bins():
  logp, mu, adv = _batch()
  lag = jnp.asarray([[0, 0, 1, 5], [2, 2, 2, 30]], jnp.int32)
  _, d = token_loss.objective_loss(logp, mu, adv, jnp.ones((2, 4)), lag,
                                   ObjectiveConfig(hist_bins=3))
  np.testing.assert_array_equal(d.lag_hist, [2, 1, 5])


def test_frac_masked_and_tokens_count_lag_and_ratio_masks():
  # r = [4, 1, 1, 1 | 1, .25, 1, 1]; is_mask band [.5, 2] rejects two tokens; max_lag=1
  # removes the lag-2 token; one token is outside the loss mask.
  logp = jnp.zeros((2, 4))
  mu = -jnp.log(jnp.asarray([[4.0, 1.0, 1.0, 1.0], [1.0, 0.25, 1.0, 1.0]]))
  mask = jnp.asarray([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
  lag = jnp.asarray([[0, 0, 2, 0], [1, 0, 0, 0]], jnp.int32)
  cfg = ObjectiveConfig(name="is_mask", is_mask_low=0.5, is_mask_high=2.0, max_lag=1)
  _, d = token_loss.objective_loss(logp, mu, jnp.ones((2, 4)), mask, lag, cfg)
  assert int(d.tokens) == 4
  np.testing.assert_allclose(d.frac_masked, 3 / 7, rtol=1e-6)
  # Ratio statistics cover the 6 valid tokens (lag mask applied, ratio mask not).
  np.testing.assert_allclose(d.ratio_max, 4.0, rtol=1e-6)
  np.testing.assert_allclose(d.ratio_min, 0.25, rtol=1e-6)


def test_logp_mismatch_uses_only_equal_weight_samples():
  """The engine mismatch is measured on samples the current version generated end to end.

  Row 0 holds samples 1 (lags 0, 0) and 2 (lags 1, 0): sample 2's last token has lag 0 but its
  context was encoded by older weights (stale KV under kv_policy="keep"), so it is excluded
  although its gap (0.7) is the largest. Row 1: sample 1 (lags 0, 0, 0) counts, sample 2
  (lag 3) does not. The mismatch compares mu with pi_prox (the policy before the batch's first
  update), not with pi_theta.
  """
  logp = jnp.zeros((2, 4))
  prox = jnp.full((2, 4), -0.5)
  mu = jnp.asarray([[-0.4, -0.7, 5.0, 0.2], [-0.5, -0.5, -0.2, 9.0]])
  lag = jnp.asarray([[0, 0, 1, 0], [0, 0, 0, 3]], jnp.int32)
  seg = jnp.asarray([[1, 1, 2, 2], [1, 1, 1, 2]], jnp.int32)
  one = jnp.ones((2, 4))
  _, d = token_loss.objective_loss(logp, mu, one, one, lag, ObjectiveConfig(), prox_logp_BT=prox,
                                   segment_ids_BT=seg)
  # |prox - mu| on tokens (0,0), (0,1), (1,0), (1,1), (1,2) = .1, .2, 0, 0, .3
  assert int(d.mismatch_tokens) == 5
  np.testing.assert_allclose(d.logp_mismatch_max, 0.3, rtol=1e-6)
  np.testing.assert_allclose(d.logp_mismatch_mean, 0.6 / 5, rtol=1e-6)
  # The behaviour ratio pi_theta / mu covers every valid token, stale ones included.
  assert int(d.valid_tokens) == 8
  np.testing.assert_allclose(d.ratio_max, np.exp(0.7), rtol=1e-6)


def test_is_mask_band_on_the_proximal_ratio():
  """is_mask_ratio="proximal" bands pi_prox / mu (engine mismatch), "behavior" pi_theta / mu."""
  logp = jnp.zeros((1, 4))  # pi_theta / mu = 1 / mu
  mu = jnp.log(jnp.asarray([[1.0, 0.25, 1.0, 1.0]]))
  prox = jnp.log(jnp.asarray([[1.0, 0.25, 4.0, 0.1]]))  # pi_prox / mu = [1, 1, 4, .1]
  one, zero = jnp.ones((1, 4)), jnp.zeros((1, 4), jnp.int32)
  kept = {}
  for ratio in ("behavior", "proximal"):
    cfg = ObjectiveConfig(name="is_mask", is_mask_low=0.5, is_mask_high=2.0, is_mask_ratio=ratio)
    out = objectives.is_mask(logp, mu, one, zero, cfg, prox_logp_BT=prox)
    kept[ratio] = np.asarray(out.kept_BT)[0].tolist()
    _, d = token_loss.objective_loss(logp, mu, one, one, zero, cfg, prox_logp_BT=prox)
    assert int(d.tokens) == sum(kept[ratio])
  assert kept == {"behavior": [True, False, True, True], "proximal": [True, True, False, False]}


def test_k3_is_non_negative_and_entropy_defaults_to_zero():
  logp, mu, adv = _batch(seed=3)
  _, d = token_loss.objective_loss(logp, mu, adv, jnp.ones((2, 4)),
                                   jnp.zeros((2, 4), jnp.int32), ObjectiveConfig(name="ppo_clip"))
  log_r = np.asarray(logp - mu, np.float64)
  np.testing.assert_allclose(d.kl_k3, np.mean(np.expm1(log_r) - log_r), rtol=1e-5)
  assert float(d.kl_k3) > 0.0
  assert np.isnan(d.entropy)  # no per-token entropy given: absent, not 0


def test_lag_rules_helpers():
  mask = jnp.asarray([[1.0, 1.0, 0.0, 1.0]])
  lag = jnp.asarray([[0, 3, 0, 4]], jnp.int32)
  np.testing.assert_array_equal(offpolicy.lag_keep_mask(mask, lag, 3), [[True, True, False,
                                                                         False]])
  np.testing.assert_array_equal(offpolicy.lag_keep_mask(mask, lag, None), [[True, True, False,
                                                                            True]])
  np.testing.assert_allclose(offpolicy.lag_truncation_scale(lag, 0.5, jnp.float32),
                             [[1.0, 0.125, 1.0, 0.0625]])
  np.testing.assert_allclose(offpolicy.lag_truncation_scale(lag, (1.0, 0.9, 0.5), jnp.float32),
                             [[1.0, 0.5, 1.0, 0.5]])
  np.testing.assert_array_equal(offpolicy.lag_truncation_scale(lag, None, jnp.float32),
                                np.ones((1, 4)))
  with pytest.raises(TypeError, match="lag_BT"):
    offpolicy.lag_keep_mask(mask, lag.astype(jnp.float32), 1)


def test_clamped_log_ratio():
  out = offpolicy.clamped_log_ratio(jnp.asarray([[0.0, -1e4, -1.0]]),
                                    jnp.asarray([[-1e4, 0.0, -1.5]]), 20.0)
  np.testing.assert_allclose(out, [[20.0, -20.0, 0.5]])
  with pytest.raises(ValueError, match="clamp"):
    offpolicy.clamped_log_ratio(jnp.zeros((1, 2)), jnp.zeros((1, 2)), 0.0)
  with pytest.raises(ValueError, match="shape"):
    offpolicy.clamped_log_ratio(jnp.zeros((1, 2)), jnp.zeros((2, 1)), 1.0)


def test_diagnostics_is_a_namedtuple_of_arrays_with_documented_fields():
  logp, mu, adv = _batch()
  _, d = token_loss.objective_loss(logp, mu, adv, jnp.ones((2, 4)),
                                   jnp.zeros((2, 4), jnp.int32), ObjectiveConfig())
  assert d._fields == ("ratio_mean", "ratio_var", "ratio_min", "ratio_max", "ess",
                       "frac_truncated", "frac_masked", "lag_hist", "kl_k3", "entropy", "tokens",
                       "logp_mismatch_mean", "logp_mismatch_max", "mask_tokens", "valid_tokens",
                       "mismatch_tokens")
  assert set(offpolicy.DIAGNOSTIC_COUNTS.values()) <= set(d._fields)
  for field, value in zip(d._fields, d):
    assert field in offpolicy.ObjectiveDiagnostics.__doc__
    assert value.shape == ((17,) if field == "lag_hist" else ())
  for field in ("tokens", "lag_hist", "mask_tokens", "valid_tokens", "mismatch_tokens"):
    assert getattr(d, field).dtype == jnp.int32
