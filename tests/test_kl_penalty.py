"""KL towards a reference: k1/k2/k3 and their gradients against float64 numpy, the reward
penalty-to-go against a loop, and both modes composed with an objective (token_loss)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import kl_penalty
from rlax_pipe.learner import token_loss
from rlax_pipe.objectives import ObjectiveConfig


def _np_k(log_r, est):
  """Schulman 2020 in float64 numpy, written from the definitions with r = exp(log r)."""
  r = np.exp(log_r)
  return {"k1": -log_r, "k2": 0.5 * log_r ** 2, "k3": r - 1.0 - log_r}[est]


def _np_dk_dlogp(log_r, est):
  """d k / d log pi_theta with log r = log pi_ref - log pi_theta (so d log r / d logp = -1)."""
  r = np.exp(log_r)
  return {"k1": np.ones_like(log_r), "k2": -log_r, "k3": 1.0 - r}[est]


def _inputs(seed=0, shape=(3, 7)):
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.05, 3.0, shape)
  ref = logp + rng.normal(0, 0.5, shape)
  mu = logp + rng.normal(0, 0.3, shape)
  return logp, ref, mu


@pytest.mark.parametrize("est", kl_penalty.KL_ESTIMATORS)
@pytest.mark.parametrize("is_weight", [False, True])
def test_loss_penalty_value_and_grad_match_float64(est, is_weight):
  logp, ref, mu = _inputs()
  with jax.enable_x64(True):
    def total(lp):
      term, _ = kl_penalty.loss_penalty(lp, jnp.asarray(ref), jnp.asarray(mu), estimator=est,
                                        coef=0.3, is_weight=is_weight, log_ratio_clamp=20.0)
      return jnp.sum(term), term
    (_, term), grad = jax.value_and_grad(total, has_aux=True)(jnp.asarray(logp))
    _, k = kl_penalty.loss_penalty(jnp.asarray(logp), jnp.asarray(ref), jnp.asarray(mu),
                                   estimator=est, coef=0.3, is_weight=is_weight,
                                   log_ratio_clamp=20.0)
  log_r = ref - logp
  w = np.exp(logp - mu) if is_weight else 1.0
  np.testing.assert_allclose(np.asarray(k), _np_k(log_r, est), rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(np.asarray(term), 0.3 * w * _np_k(log_r, est), rtol=1e-12)
  np.testing.assert_allclose(np.asarray(grad), 0.3 * w * _np_dk_dlogp(log_r, est), rtol=1e-10,
                             atol=1e-14)


def test_k1_k3_unbiased_and_k3_nonnegative():
  """Monte Carlo on a 5-way categorical: E_q[k1] = E_q[k3] = KL(q || p) exactly in expectation;
  the sample means agree within 4 standard errors; k3 >= 0 always."""
  rng = np.random.default_rng(1)
  q = rng.dirichlet(np.ones(5))
  p = rng.dirichlet(np.ones(5))
  kl = float(np.sum(q * np.log(q / p)))
  a = rng.choice(5, size=(1, 200_000), p=q)
  log_r = jnp.asarray(np.log(p[a]) - np.log(q[a]), jnp.float32)
  for est in ("k1", "k3"):
    k = np.asarray(kl_penalty.estimate(log_r, est), np.float64)
    assert abs(k.mean() - kl) < 4 * k.std() / np.sqrt(k.size), est
  assert np.all(np.asarray(kl_penalty.estimate(log_r, "k3")) >= 0)


def _np_to_go(k, valid, seg):
  out = np.zeros_like(k)
  b, t = k.shape
  for i in range(b):
    for j in range(t):
      out[i, j] = sum(k[i, u] for u in range(j, t) if seg[i, u] == seg[i, j] and valid[i, u])
  return out


def test_penalty_to_go_packed_rows_match_loop():
  rng = np.random.default_rng(2)
  k = rng.normal(size=(2, 9))
  seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 3, 3, 3]], np.int32)
  valid = (seg > 0) & (rng.uniform(size=seg.shape) < 0.8)
  with jax.enable_x64(True):
    got = kl_penalty.penalty_to_go(jnp.asarray(k), jnp.asarray(valid), jnp.asarray(seg))
    unpacked = kl_penalty.penalty_to_go(jnp.asarray(k), jnp.asarray(valid), None)
  np.testing.assert_allclose(np.asarray(got), _np_to_go(k, valid, seg), rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(np.asarray(unpacked), _np_to_go(k, valid, np.ones_like(seg)),
                             rtol=1e-12, atol=1e-12)


def _batch():
  logp, ref, mu = _inputs(3, (2, 8))
  adv = np.repeat(np.array([[0.7], [-1.2]]), 8, axis=1)
  mask = np.ones((2, 8))
  mask[:, :2] = 0.0
  mask[1, 7] = 0.0
  seg = np.array([[1] * 8, [1, 1, 1, 1, 2, 2, 2, 2]], np.int32)
  lag = np.zeros((2, 8), np.int32)
  lag[0, 5:] = 3   # beyond max_lag=2: outside the loss and the KL
  return logp, ref, mu, adv, mask, seg, lag


@pytest.mark.parametrize("est", kl_penalty.KL_ESTIMATORS)
def test_kl_loss_mode_adds_aggregated_term(est):
  """loss = objective's loss + coef * mean over valid tokens of k (token_mean aggregation),
  gradient likewise; reference in float64 numpy."""
  logp, ref, mu, adv, mask, seg, lag = _batch()
  base = ObjectiveConfig(name="no_correction", max_lag=2)
  cfg = dataclasses.replace(base, kl="loss", kl_estimator=est, kl_coef=0.5)
  with jax.enable_x64(True):
    f = lambda c, r: lambda lp: token_loss.objective_loss(
        lp, jnp.asarray(mu), jnp.asarray(adv), jnp.asarray(mask), jnp.asarray(lag), c,
        segment_ids_BT=jnp.asarray(seg), ref_logp_BT=r)[0]
    loss, grad = jax.value_and_grad(f(cfg, jnp.asarray(ref)))(jnp.asarray(logp))
    loss0, grad0 = jax.value_and_grad(f(base, None))(jnp.asarray(logp))
  valid = (mask > 0) & (lag <= 2)
  n = valid.sum()
  log_r = ref - logp
  np.testing.assert_allclose(float(loss) - float(loss0),
                             0.5 * _np_k(log_r, est)[valid].sum() / n, rtol=1e-10)
  want = np.where(valid, 0.5 * _np_dk_dlogp(log_r, est) / n, 0.0)
  np.testing.assert_allclose(np.asarray(grad) - np.asarray(grad0), want, rtol=1e-9, atol=1e-14)


def test_kl_reward_mode_shifts_advantage_by_penalty_to_go():
  """A'_t = A_t - coef * sum_{t'>=t in sample} k(log pi_ref - log mu); checked through the
  no_correction objective, whose gradient is -A'_t / N per valid token."""
  logp, ref, mu, adv, mask, seg, lag = _batch()
  cfg = ObjectiveConfig(name="no_correction", max_lag=2, kl="reward", kl_estimator="k1",
                        kl_coef=0.25)
  with jax.enable_x64(True):
    grad = jax.grad(lambda lp: token_loss.objective_loss(
        lp, jnp.asarray(mu), jnp.asarray(adv), jnp.asarray(mask), jnp.asarray(lag), cfg,
        segment_ids_BT=jnp.asarray(seg), ref_logp_BT=jnp.asarray(ref))[0])(jnp.asarray(logp))
  valid = (mask > 0) & (lag <= 2)
  k1 = -(ref - mu)
  shaped = adv - 0.25 * _np_to_go(np.where(valid, k1, 0.0), valid, seg)
  np.testing.assert_allclose(np.asarray(grad), np.where(valid, -shaped / valid.sum(), 0.0),
                             rtol=1e-10, atol=1e-14)


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="kl="):
    ObjectiveConfig(kl="forward")
  with pytest.raises(ValueError, match="kl_coef=0.1 has no effect with kl='off'"):
    ObjectiveConfig(kl_coef=0.1)
  with pytest.raises(ValueError, match="kl_estimator"):
    ObjectiveConfig(kl="loss", kl_estimator="k4")
  with pytest.raises(ValueError, match="kl_is_weight"):
    ObjectiveConfig(kl="reward", kl_is_weight=True)
  with pytest.raises(ValueError, match="needs reference log-probs"):
    z = jnp.zeros((1, 3))
    token_loss.objective_loss(z, z, z, z + 1, jnp.zeros((1, 3), jnp.int32),
                              ObjectiveConfig(kl="loss"))
