"""GSPO against an independent float64 numpy implementation of Zheng et al. 2025 (eqs. 5-7):
loss value and (finite-difference) gradient, packing, the lag mask, the clip, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import objectives
from rlax_pipe.learner import token_loss
from rlax_pipe.objectives import ObjectiveConfig


def _np_gspo(logp, mu, adv_i, samples, eps_low, eps_high):
  """-(1/G) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i), with
  s_i = (prod_t pi/mu)^(1/|y_i|) over each sample's token positions (a list of index arrays)."""
  total = 0.0
  for (rows, cols), a in zip(samples, adv_i):
    s = np.exp(np.sum(logp[rows, cols] - mu[rows, cols]) / len(cols))
    total += min(s * a, np.clip(s, 1 - eps_low, 1 + eps_high) * a)
  return -total / len(samples)


def _case(seed=0, scale=0.1):
  rng = np.random.default_rng(seed)
  b, t = 2, 10
  logp = -rng.uniform(0.1, 2.0, (b, t))
  mu = logp + rng.normal(0, scale, (b, t))
  # Row 0: one sample (tokens 2..9 completion); row 1: two packed samples.
  seg = np.array([[1] * 10, [1, 1, 1, 1, 1, 2, 2, 2, 2, 2]], np.int32)
  mask = np.zeros((b, t))
  mask[0, 2:] = 1
  mask[1, 1:5] = 1
  mask[1, 6:] = 1
  lag = np.zeros((b, t), np.int32)
  lag[1, 8:] = 5   # two tokens beyond max_lag=3: excluded from the sample's mean and the loss
  adv_i = np.array([0.9, -0.6, 1.3])
  adv = np.zeros((b, t))
  adv[0] = adv_i[0]
  adv[1, :5] = adv_i[1]
  adv[1, 5:] = adv_i[2]
  valid = (mask > 0) & (lag <= 3)
  samples = [np.nonzero(valid & (np.arange(b)[:, None] == r) & (seg == s))
             for r, s in ((0, 1), (1, 1), (1, 2))]
  return logp, mu, adv, mask, lag, seg, adv_i, samples


@pytest.mark.parametrize("eps", [(0.2, 0.28), (3e-3, 4e-3)])
def test_gspo_matches_paper_equations_value_and_gradient(eps):
  logp, mu, adv, mask, lag, seg, adv_i, samples = _case()
  cfg = ObjectiveConfig(name="gspo", clip_eps=eps[0], clip_eps_high=eps[1], max_lag=3,
                        aggregation="sequence_mean")
  with jax.enable_x64(True):
    f = lambda lp: token_loss.objective_loss(
        lp, jnp.asarray(mu), jnp.asarray(adv), jnp.asarray(mask), jnp.asarray(lag), cfg,
        segment_ids_BT=jnp.asarray(seg))
    (loss, diag), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
  ref = _np_gspo(logp, mu, adv_i, samples, *eps)
  np.testing.assert_allclose(float(loss), ref, rtol=1e-12)
  fd = np.zeros_like(logp)
  h = 1e-6
  for idx in np.ndindex(logp.shape):
    up, dn = logp.copy(), logp.copy()
    up[idx] += h
    dn[idx] -= h
    fd[idx] = (_np_gspo(up, mu, adv_i, samples, *eps) - _np_gspo(dn, mu, adv_i, samples, *eps)
               ) / (2 * h)
  np.testing.assert_allclose(np.asarray(grad), fd, rtol=1e-6, atol=1e-9)
  if eps[0] < 0.01:  # with the paper's tiny clip range some sample must be clipped
    assert float(diag.frac_truncated) > 0


def test_gspo_is_sequence_level_ratio_in_token_form():
  """Every valid token of a sample has the same ratio s_i: the truncated flag is constant over a
  sample, and the per-token gradient within a sample is uniform (s_i A_i / |y_i| / G)."""
  logp, mu, adv, mask, lag, seg, _, samples = _case(1, scale=0.5)
  cfg = ObjectiveConfig(name="gspo", max_lag=3, aggregation="sequence_mean")
  sel = token_loss.select_valid(jnp.asarray(logp, jnp.float32), jnp.asarray(mu, jnp.float32),
                                jnp.asarray(adv, jnp.float32), jnp.asarray(mask, jnp.float32),
                                jnp.asarray(lag), cfg)
  _, out = token_loss.per_token_loss(sel, jnp.asarray(lag), cfg, jnp.asarray(seg))
  trunc = np.asarray(out.truncated_BT)
  for rows, cols in samples:
    assert len(set(trunc[rows, cols].tolist())) == 1


def test_gspo_rejects_per_token_truncation_knobs():
  with pytest.raises(ValueError, match="lag_truncation"):
    ObjectiveConfig(name="gspo", lag_truncation=0.9)
  with pytest.raises(ValueError, match="behavior_trunc"):
    ObjectiveConfig(name="gspo", behavior_trunc=2.0)
  assert "gspo" in objectives.OBJECTIVES and "gspo" in objectives.SEQUENCE_OBJECTIVES
