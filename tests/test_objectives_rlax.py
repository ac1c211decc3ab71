"""Objectives and diagnostics against rlax, wherever rlax computes the same quantity.

rlax works on rank-1 sequences of T timesteps; our [B, T] batches are flattened into one
sequence of B * T steps for the comparison. Losses and gradients are compared w.r.t. the
policy logits, so the log-softmax and the action gather are part of what is checked.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import objectives
from rlax_pipe.learner import token_loss
from rlax_pipe.objectives import ObjectiveConfig

rlax = pytest.importorskip("rlax")

pytestmark = pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")

B, T, V = 2, 4, 5


def _sample(rng, logits, shape):
  """Categorical samples from float[..., V] logits with numpy (fast, no compilation)."""
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  cdf = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)
  u = rng.uniform(size=shape)
  return np.minimum((u[..., None] > cdf).sum(-1), logits.shape[-1] - 1).astype(np.int32)


def _batch(seed=0):
  """Random pi/mu logits float32[B, T, V], sampled actions int32[B, T], advantages float32[B, T]."""
  rng = np.random.default_rng(seed)
  pi_logits = rng.normal(size=(B, T, V)).astype(np.float32)
  mu_logits = (pi_logits + 0.7 * rng.normal(size=(B, T, V))).astype(np.float32)
  actions = _sample(rng, mu_logits, (B, T))
  adv = rng.normal(size=(B, T)).astype(np.float32)
  return tuple(map(jnp.asarray, (pi_logits, mu_logits, actions, adv)))


def _logp(logits_BTV, actions_BT):
  return jnp.take_along_axis(jax.nn.log_softmax(logits_BTV), actions_BT[..., None], axis=-1)[..., 0]


def _compare_loss_and_grad(ours, reference, pi_logits):
  """Value and gradient w.r.t. the logits agree (each side jitted once)."""
  value, grad = jax.jit(jax.value_and_grad(ours))(pi_logits)
  ref_value, ref_grad = jax.jit(jax.value_and_grad(reference))(pi_logits)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def _ours(name, cfg, pi_logits, mu_logits, actions, adv, mask):
  """Our loss as a function of the policy logits, and its diagnostics (one sample per row)."""
  assert cfg.name == name
  mu_logp = _logp(mu_logits, actions)
  lag = jnp.zeros((B, T), jnp.int32)
  return token_loss.objective_loss(_logp(pi_logits, actions), mu_logp, adv, mask, lag, cfg,
                                   segment_ids_BT=jnp.ones((B, T), jnp.int32))


def test_ppo_clip_matches_rlax_clipped_surrogate():
  """token_mean over the unmasked tokens = rlax's mean over exactly those timesteps."""
  pi_logits, mu_logits, actions, adv = _batch()
  mask = jnp.ones((B, T)).at[0, 1].set(0.0).at[1, 3].set(0.0)
  keep = np.nonzero(np.asarray(mask).reshape(-1))[0]
  cfg = ObjectiveConfig(name="ppo_clip", clip_eps=0.2)

  def ours(logits):
    return _ours("ppo_clip", cfg, logits, mu_logits, actions, adv, mask)[0]

  def reference(logits):
    # The old policy of PPO is the behavior policy mu.
    ratios = jnp.exp(_logp(logits, actions) - _logp(mu_logits, actions)).reshape(-1)
    return rlax.clipped_surrogate_pg_loss(ratios[keep], adv.reshape(-1)[keep], 0.2)

  _compare_loss_and_grad(ours, reference, pi_logits)


def test_tis_pg_matches_rlax_vtrace_pg_advantage():
  """IMPALA's policy-gradient term: rlax's clipped pg advantage min(rho_bar, rho) * A.

  With discount 0 and zero values, rlax's v-trace q-estimate is the reward, so
  pg_advantage = min(clip_pg_rho_threshold, rho) * r_t; rlax.policy_gradient_loss then holds it
  constant, exactly like tis_pg's stop-gradient weight.
  """
  pi_logits, mu_logits, actions, adv = _batch(seed=1)
  truncation = 1.2
  rho = np.exp(np.asarray(_logp(pi_logits, actions) - _logp(mu_logits, actions)))
  assert 0 < np.mean(rho > truncation) < 1  # some weights truncated, some not
  cfg = ObjectiveConfig(name="tis_pg", truncation=truncation)
  mask = jnp.ones((B, T))

  def ours(logits):
    return _ours("tis_pg", cfg, logits, mu_logits, actions, adv, mask)[0]

  def reference(logits):
    flat = logits.reshape(B * T, V)
    rho = jnp.exp(_logp(logits, actions) - _logp(mu_logits, actions)).reshape(-1)
    zeros = jnp.zeros((B * T,))
    vtrace = rlax.vtrace_td_error_and_advantage(
        zeros, zeros, adv.reshape(-1), zeros, rho, clip_pg_rho_threshold=truncation)
    return rlax.policy_gradient_loss(flat, actions.reshape(-1), vtrace.pg_advantage,
                                     jnp.ones((B * T,)))

  _compare_loss_and_grad(ours, reference, pi_logits)


def test_no_correction_matches_rlax_policy_gradient_loss_with_weights():
  """rlax averages loss * w over all B*T steps: our Dr. GRPO "constant" aggregation with B
  samples (one per row, each with a completion token) of max completion length T."""
  pi_logits, mu_logits, actions, adv = _batch(seed=2)
  mask = jnp.ones((B, T)).at[1, 0].set(0.0)
  cfg = ObjectiveConfig(name="no_correction", aggregation="constant", max_completion_len=T)

  def ours(logits):
    return _ours("no_correction", cfg, logits, mu_logits, actions, adv, mask)[0]

  def reference(logits):
    return rlax.policy_gradient_loss(logits.reshape(B * T, V), actions.reshape(-1),
                                     adv.reshape(-1), mask.reshape(-1))

  _compare_loss_and_grad(ours, reference, pi_logits)


def test_ratio_and_entropy_diagnostics_match_rlax():
  pi_logits, mu_logits, actions, adv = _batch(seed=3)
  mask = jnp.ones((B, T))

  @jax.jit
  def diagnostics_and_references(pi_logits, mu_logits):
    entropy_BT = -jnp.sum(jax.nn.softmax(pi_logits) * jax.nn.log_softmax(pi_logits), axis=-1)
    diag = token_loss.objective_loss(_logp(pi_logits, actions), _logp(mu_logits, actions), adv,
                                     mask, jnp.zeros((B, T), jnp.int32), ObjectiveConfig(),
                                     entropy_BT=entropy_BT)[1]
    rho = rlax.categorical_importance_sampling_ratios(
        pi_logits.reshape(B * T, V), mu_logits.reshape(B * T, V), actions.reshape(-1))
    # rlax.entropy_loss = -mean_t(H_t * w_t).
    entropy = -rlax.entropy_loss(pi_logits.reshape(B * T, V), jnp.ones((B * T,)))
    return diag, rho, entropy

  diag, rho, expected_entropy = diagnostics_and_references(pi_logits, mu_logits)
  rho = np.asarray(rho, np.float64)
  np.testing.assert_allclose(diag.ratio_mean, rho.mean(), rtol=1e-5)
  np.testing.assert_allclose(diag.ratio_var, rho.var(), rtol=1e-4)
  np.testing.assert_allclose([diag.ratio_min, diag.ratio_max], [rho.min(), rho.max()], rtol=1e-5)
  np.testing.assert_allclose(diag.ess, rho.sum() ** 2 / (rho.size * np.sum(rho ** 2)), rtol=1e-5)
  np.testing.assert_allclose(diag.entropy, expected_entropy, rtol=1e-5)


def test_k3_is_unbiased_for_rlax_categorical_kl():
  """Tokens sampled from mu: mean k3 estimates KL(mu || pi) (Schulman's k3 estimator).

  4 positions with fixed pi/mu logits, 4096 samples each; the exact per-position KL comes from
  rlax.categorical_kl_divergence and the tolerance is 4 standard errors of the estimate.
  """
  n, positions = 4096, 4
  rng = np.random.default_rng(4)
  pi_logits = rng.normal(size=(positions, V)).astype(np.float32)
  mu_logits = (pi_logits + 0.5 * rng.normal(size=(positions, V))).astype(np.float32)
  actions = _sample(rng, np.broadcast_to(mu_logits, (n, positions, V)), (n, positions))

  @jax.jit
  def k3_and_kl(pi_logits, mu_logits, actions):
    logp = jax.nn.log_softmax(pi_logits)[jnp.arange(positions)[None, :], actions]
    mu_logp = jax.nn.log_softmax(mu_logits)[jnp.arange(positions)[None, :], actions]
    ones, zeros = jnp.ones((n, positions)), jnp.zeros((n, positions), jnp.int32)
    _, diag = token_loss.objective_loss(logp, mu_logp, ones, ones, zeros,
                                        ObjectiveConfig(name="no_correction"))
    exact = jax.vmap(rlax.categorical_kl_divergence)(mu_logits, pi_logits)
    return diag.kl_k3, jnp.mean(exact), logp - mu_logp

  kl_k3, exact, log_r = k3_and_kl(pi_logits, mu_logits, actions)
  exact = float(exact)
  log_r = np.asarray(log_r, np.float64)
  k3 = np.expm1(log_r) - log_r
  stderr = k3.std() / np.sqrt(k3.size)
  np.testing.assert_allclose(kl_k3, k3.mean(), rtol=1e-4)
  assert abs(float(kl_k3) - exact) < 4 * stderr, (float(kl_k3), exact, stderr)
  assert exact > 10 * stderr  # the test can tell a real KL from zero
