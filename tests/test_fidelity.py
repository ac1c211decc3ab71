"""rlax_pipe.fidelity against float64 numpy references written from the definitions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import fidelity
from rlax_pipe.learner import token_loss
from rlax_pipe.objectives import ObjectiveConfig


def test_mean_interval_matches_t_formula():
  x = np.array([0.1, 0.4, 0.35, 0.2, 0.3])
  iv = fidelity.mean_interval(x)
  half = 2.7764451051977987 * x.std(ddof=1) / math.sqrt(5)  # t_{0.975, 4}
  assert iv.value == pytest.approx(x.mean())
  assert iv.low == pytest.approx(x.mean() - half) and iv.high == pytest.approx(x.mean() + half)
  assert math.isnan(fidelity.mean_interval(np.array([1.0])).low)
  with pytest.raises(ValueError, match="non-empty 1-D"):
    fidelity.mean_interval(np.zeros((2, 2)))


def test_true_gradient_reference():
  rng = np.random.default_rng(0)
  g = rng.normal(size=(6, 5)) + np.array([3.0, 0, 0, 1.0, 0])
  t = fidelity.true_gradient(g)
  mean = g.mean(0)
  tr = sum(np.sum((g[j] - mean) ** 2) for j in range(6)) / 5
  assert t.trace_cov == pytest.approx(tr)
  assert t.norm == pytest.approx(math.sqrt(mean @ mean - tr / 6))
  assert t.rel_se == pytest.approx(math.sqrt(tr / 6) / t.norm)
  proj = [g[j] @ (np.delete(g, j, 0).mean(0) / np.linalg.norm(np.delete(g, j, 0).mean(0)))
          for j in range(6)]
  assert t.proj_var == pytest.approx(np.var(proj, ddof=1))
  with pytest.raises(ValueError, match="M >= 2"):
    fidelity.true_gradient(g[:1])


def test_fidelity_reference_and_unbiased_has_no_bias():
  rng = np.random.default_rng(1)
  gs = np.array([2.0, -1.0, 0.5, 0.0])
  truth = fidelity.true_gradient(gs + 0.01 * rng.normal(size=(50, 4)))
  g = 0.5 * gs + rng.normal(size=(40, 4)) * 0.3  # shrunk by half: bias -0.5 along g*
  f = fidelity.fidelity(g, truth)
  u = truth.mean_P / np.linalg.norm(truth.mean_P)
  assert f.bias_parallel.value == pytest.approx((np.mean(g @ u) - truth.norm) / truth.norm)
  assert f.bias_parallel.low < -0.5 < f.bias_parallel.high
  cos = [gi @ truth.mean_P / np.linalg.norm(gi) / np.linalg.norm(truth.mean_P) for gi in g]
  assert f.cosine.value == pytest.approx(np.mean(cos))
  tr = np.sum((g - g.mean(0)) ** 2) / 39
  assert f.trace_var.value == pytest.approx(tr / truth.norm**2)
  assert f.proj_var.value == pytest.approx(np.var(g @ u, ddof=1) / truth.norm**2)
  assert f.bias_norm == pytest.approx(np.linalg.norm(g.mean(0) - truth.mean_P) / truth.norm)
  # An unbiased estimator: the parallel-bias interval covers 0 and bias_norm ~ noise floor.
  g2 = gs + rng.normal(size=(40, 4)) * 0.3
  f2 = fidelity.fidelity(g2, truth)
  assert f2.bias_parallel.low < 0 < f2.bias_parallel.high
  assert f2.bias_norm < 3 * f2.bias_noise_floor
  assert f.bias_parallel.separates_from(f2.bias_parallel)
  with pytest.raises(ValueError, match="non-finite"):
    fidelity.fidelity(np.full((2, 4), np.inf), truth)


def test_pooled():
  a, b = fidelity.Interval(1.0, 0.0, 2.0), fidelity.Interval(3.0, 2.0, 4.0)
  p = fidelity.pooled([a, b])
  assert p.value == 2.0
  assert p.high - 2.0 == pytest.approx(math.sqrt(2) / 2)


def test_objective_gradients_equal_direct_grad():
  """The VJP route equals jax.grad of the composed loss, for each objective."""
  rng = np.random.default_rng(2)
  b, t, d = 3, 5, 4
  w0 = {"w": jnp.asarray(rng.normal(size=(d,)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=()), jnp.float32)}
  x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)

  def logp_fn(p):
    return jax.nn.log_sigmoid(x @ p["w"] + p["b"])

  mask = (rng.random((b, t)) < 0.8).astype(np.float32)
  batch = dict(loss_mask=mask, behavior_logprobs=np.asarray(logp_fn(w0)) + rng.normal(
      size=(b, t)).astype(np.float32) * 0.5, advantages=rng.normal(size=(b, t)).astype(
      np.float32), policy_versions=np.array([[3] * t, [1] * t, [0] * t], np.int32),
      segment_ids=np.ones((b, t), np.int32))
  cfgs = (ObjectiveConfig(name="tis_pg", lag_truncation=0.7),
          ObjectiveConfig(name="untruncated_is"), ObjectiveConfig(name="decoupled_ppo"))
  g, diag = jax.jit(lambda p: fidelity.objective_gradients(logp_fn, p, batch, 3, cfgs))(w0)
  assert g.shape == (3, d + 1) and diag.ess.shape == (3,)
  lag = 3 - batch["policy_versions"]
  for o, cfg in enumerate(cfgs):
    def loss(p, cfg=cfg):
      lp = logp_fn(p)
      return token_loss.objective_loss(lp, batch["behavior_logprobs"], batch["advantages"],
                                       mask, lag, cfg, prox_logp_BT=jax.lax.stop_gradient(lp),
                                       segment_ids_BT=batch["segment_ids"])[0]
    ref = jax.jit(jax.grad(loss))(w0)
    np.testing.assert_allclose(np.asarray(g[o]), np.asarray(fidelity.flatten(ref)), rtol=1e-5,
                               atol=1e-6)
  # untruncated IS and decoupled PPO (pi_prox = pi_theta) are the same estimator.
  np.testing.assert_allclose(np.asarray(g[1]), np.asarray(g[2]), rtol=1e-5, atol=1e-7)


def test_per_batch_reference():
  rng = np.random.default_rng(3)
  truth = fidelity.true_gradient(np.array([1.0, 2.0, -1.0]) + 0.1 * rng.normal(size=(20, 3)))
  g = rng.normal(size=(4, 3))
  pb = fidelity.per_batch(g, truth)
  gs = truth.mean_P
  for i in range(4):
    assert pb["cosine"][i] == pytest.approx(g[i] @ gs / np.linalg.norm(g[i]) / np.linalg.norm(gs))
    assert pb["parallel"][i] == pytest.approx(g[i] @ gs / np.linalg.norm(gs) / truth.norm)
    assert pb["sq_error"][i] == pytest.approx(np.sum((g[i] - gs) ** 2) / truth.norm**2)


def test_reference_free_paired_stats_against_explicit_vectors():
  """U-statistic, tr Cov, jackknife pseudo-values and paired_stats vs float64 numpy written
  from the definitions on the vectors themselves (not through the Gram matrix)."""
  rng = np.random.default_rng(3)
  o, n, p = 3, 6, 40
  g = rng.normal(size=(o, n, p)) + rng.normal(size=(o, 1, p))  # a common mean per objective
  g_gram = fidelity.gram(g.reshape(o * n, p), chunk=7)
  np.testing.assert_allclose(g_gram, g.reshape(o * n, p) @ g.reshape(o * n, p).T, rtol=1e-12)

  def u_direct(y):  # mean over i != j of <y_i, y_j>
    m = len(y)
    return sum(y[i] @ y[j] for i in range(m) for j in range(m) if i != j) / (m * (m - 1))

  def trcov_direct(y):
    return float(np.sum(np.var(y, axis=0, ddof=1)))

  def pseudo_direct(stat, y):
    m = len(y)
    return np.array([m * stat(y) - (m - 1) * stat(np.delete(y, i, axis=0)) for i in range(m)])

  anchor, scale2 = 1, 2.5
  stats = fidelity.paired_stats(g_gram, o, anchor, scale2)
  for j in range(o):
    d = g[j] - g[anchor]
    np.testing.assert_allclose(stats[j]["bias2"], pseudo_direct(u_direct, d) / scale2,
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(stats[j]["var"], pseudo_direct(trcov_direct, g[j]) / scale2,
                               rtol=1e-9)
    np.testing.assert_allclose(stats[j]["energy"], np.sum(g[j] ** 2, axis=1) / scale2)
  # the anchor has no bias against itself; U is unbiased for |E y|^2: with mean 0 it is ~0
  np.testing.assert_allclose(stats[anchor]["bias2"], 0.0, atol=1e-12)
  np.testing.assert_allclose(fidelity.u_sq_mean(g_gram[:n, :n]), u_direct(g[0]), rtol=1e-10)
  np.testing.assert_allclose(fidelity.log_energy_ratio([1.0, 0.0, 4.0], [2.0, 3.0, 1.0]),
                             [np.log(0.5), np.log(4.0)])
  with pytest.raises(ValueError, match="scale2"):
    fidelity.paired_stats(g_gram, o, anchor, 0.0)
  with pytest.raises(ValueError, match="N >= 3"):
    fidelity.jackknife_pseudo(fidelity.trace_cov, g_gram[:2, :2])
