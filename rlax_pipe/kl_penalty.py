"""KL regularisation towards a reference policy: the k1 / k2 / k3 estimators and their two uses.

Notation: pi_theta the learner's policy, pi_ref the frozen reference (the initial params by
default), mu the behaviour policy that sampled the tokens (the sampler's recorded log-probs,
possibly several versions old). On a sampled token a_t the per-token log-ratio is

  log r_t = log pi_ref(a_t|s_t) - log q(a_t|s_t),

with q the policy whose divergence from pi_ref is estimated, and the estimators of Schulman
(2020, "Approximating KL divergence") are

  k1 = -log r,     k2 = (log r)^2 / 2,     k3 = (r - 1) - log r.

Under a_t ~ q, k1 and k3 are unbiased for KL(q || pi_ref) (k3 >= 0, lower variance); k2 is
biased, with small bias when q and pi_ref are close. k3 is the estimator GRPO adds to its loss
(Shao et al. 2024, DeepSeekMath eq. 4).

Two uses, `ObjectiveConfig.kl`:
  * "loss" (`loss_penalty`): q = pi_theta (differentiable); per token kl_coef * k(log r_t) is
    added to the objective's per-token loss and aggregated with it (GRPO eq. 3). The tokens come
    from mu, not pi_theta, so without a weight the estimate is of E_mu[k], which equals
    KL(pi_theta || pi_ref) only on-policy (mu = pi_theta). With `kl_is_weight` each term is
    multiplied by the held-constant importance weight sg(pi_theta / mu) (clamped in log space),
    which makes the k1 / k3 value unbiased for KL(pi_theta || pi_ref) under mu (the "unbiased KL
    estimate" DeepSeek-V3.2 applies to k3, DeepSeek-AI 2025). Default: no weight (GRPO).
    Gradients w.r.t. log pi_theta: dk1 = 1, dk2 = -log r, dk3 = 1 - r (times kl_coef, and the
    weight when set).
  * "reward" (`reward_penalty`): q = mu, the policy that generated the sample, so the estimate is
    unbiased for KL(mu || pi_ref) without any weight and carries no gradient. Each token gets
    the reward -kl_coef * k(log r_t); with gamma = 1 the return of token t is the task reward
    minus kl_coef times the sum of k over the sample's tokens t' >= t (the per-token KL reward
    of Ziegler et al. 2019 Sec. 2 and InstructGPT, Ouyang et al. 2022 eq. 2, with the per-token
    credit of PPO-RLHF implementations). The learner adds that penalty-to-go to the
    already-computed (group-normalised) advantage inside its micro-batch program, where pi_ref's
    log-probs are computed: the penalty is therefore not group-normalised (normalising it with
    the group would need the reference log-probs before the batch is built, a second pass).

Letters: B rows, T tokens per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_pipe import offpolicy

KL_MODES: tuple[str, ...] = ("off", "loss", "reward")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def estimate(log_r_BT: jax.Array, estimator: str) -> jax.Array:
  """Per-token KL estimate k(log r) (Schulman 2020): k1 = -log r, k2 = (log r)^2 / 2,
  k3 = (r - 1) - log r (computed as expm1(log r) - log r, accurate for small |log r|).

  Args:
    log_r_BT: float[B, T] log pi_ref - log q on sampled tokens (nats; finite, clamp it first).
    estimator: one of KL_ESTIMATORS.

  Returns:
    float[B, T] in log_r_BT's dtype (nats).

  Raises:
    ValueError: on an unknown estimator.
  """
  if estimator == "k1":
    return -log_r_BT
  if estimator == "k2":
    return 0.5 * jnp.square(log_r_BT)
  if estimator == "k3":
    return jnp.expm1(log_r_BT) - log_r_BT
  raise ValueError(f"KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}.")


def loss_penalty(logp_BT: jax.Array, ref_logp_BT: jax.Array, behavior_logp_BT: jax.Array, *,
                 estimator: str, coef: float, is_weight: bool,
                 log_ratio_clamp: float) -> tuple[jax.Array, jax.Array]:
  """Per-token KL loss term coef * [sg(pi_theta / mu)] * k(log pi_ref - log pi_theta).

  See the module docstring for what is estimated. Both log-ratios are clamped to
  [-log_ratio_clamp, log_ratio_clamp] before exp (zero gradient where the clamp is active).

  Args:
    logp_BT: float[B, T] log pi_theta (nats; differentiable).
    ref_logp_BT: float[B, T] log pi_ref (nats; gradient stopped here).
    behavior_logp_BT: float[B, T] log mu (nats; read only with is_weight).
    estimator: one of KL_ESTIMATORS.
    coef: kl_coef >= 0.
    is_weight: multiply by the held-constant importance weight pi_theta / mu.
    log_ratio_clamp: bound on |log ratio| in nats (> 0).

  Returns:
    (penalty_BT: the term to add to the per-token loss, float[B, T];
     kl_BT: the unweighted estimate k(log r) without the coefficient, gradient stopped, for
     diagnostics).
  """
  offpolicy.check_token_shapes(logp_BT=logp_BT, ref_logp_BT=ref_logp_BT,
                               behavior_logp_BT=behavior_logp_BT)
  log_r = offpolicy.clamped_log_ratio(jax.lax.stop_gradient(ref_logp_BT), logp_BT,
                                      log_ratio_clamp)
  k = estimate(log_r, estimator)
  term = coef * k
  if is_weight:
    weight = jnp.exp(offpolicy.clamped_log_ratio(logp_BT, behavior_logp_BT, log_ratio_clamp))
    term = jax.lax.stop_gradient(weight) * term
  return term, jax.lax.stop_gradient(k)


def penalty_to_go(k_BT: jax.Array, valid_BT: jax.Array,
                  segment_ids_BT: jax.Array | None) -> jax.Array:
  """sum_{t' >= t, t' in t's sample, valid} k_t' for every token t (undiscounted, gamma = 1).

  Samples are contiguous runs of one segment id within a row (packing), so with the row's
  inclusive prefix sum P_t, the suffix sum within t's sample is E_s - P_t + k_t, where E_s is
  P at the sample's last token.

  Args:
    k_BT: float[B, T] per-token penalty (finite everywhere).
    valid_BT: bool[B, T] tokens that carry a penalty (others contribute 0).
    segment_ids_BT: int[B, T] sample id per token, or None for one sample per row.

  Returns:
    float[B, T] (values at invalid tokens are their sample's penalty still to come).
  """
  shape = offpolicy.check_token_shapes(k_BT=k_BT, valid_BT=valid_BT)
  k = jnp.where(valid_BT, k_BT, jnp.zeros((), k_BT.dtype))
  prefix = jnp.cumsum(k, axis=1)
  if segment_ids_BT is None:
    end = prefix[:, -1:]
  else:
    seg = segment_ids_BT
    last = jnp.concatenate([seg[:, 1:] != seg[:, :-1], jnp.ones((shape[0], 1), bool)], axis=1)
    at_end = jnp.where(last, prefix, jnp.zeros((), prefix.dtype))[..., None]
    end = offpolicy.per_token(offpolicy.per_sample(at_end, seg)[..., 0], seg, shape[1])
  return end - prefix + k


def reward_penalty(advantages_BT: jax.Array, ref_logp_BT: jax.Array,
                   behavior_logp_BT: jax.Array, valid_BT: jax.Array,
                   segment_ids_BT: jax.Array | None, *, estimator: str, coef: float,
                   log_ratio_clamp: float) -> tuple[jax.Array, jax.Array]:
  """Advantages with the KL-in-reward penalty: A_t - coef * sum_{t' >= t} k(log pi_ref - log mu).

  The per-token reward -coef * k_t (Ziegler et al. 2019; Ouyang et al. 2022 eq. 2) summed to go
  within each sample (gamma = 1), added to the given advantage; q = mu, so the estimate of
  KL(mu || pi_ref) is unbiased without a weight. No gradient flows through it.

  Args:
    advantages_BT: float[B, T] advantages (e.g. group-normalised task reward).
    ref_logp_BT: float[B, T] log pi_ref (nats).
    behavior_logp_BT: float[B, T] log mu (nats).
    valid_BT: bool[B, T] tokens that carry a penalty (loss mask within max_lag).
    segment_ids_BT: int[B, T] sample ids (packing), or None for one sample per row.
    estimator: one of KL_ESTIMATORS.
    coef: kl_coef >= 0.
    log_ratio_clamp: bound on |log r| in nats (> 0).

  Returns:
    (advantages_BT with the penalty, gradient stopped; kl_BT: the per-token estimate k).
  """
  offpolicy.check_token_shapes(advantages_BT=advantages_BT, ref_logp_BT=ref_logp_BT,
                               behavior_logp_BT=behavior_logp_BT, valid_BT=valid_BT)
  dtype = jnp.promote_types(advantages_BT.dtype, jnp.float32)
  log_r = offpolicy.clamped_log_ratio(ref_logp_BT.astype(dtype),
                                      behavior_logp_BT.astype(dtype), log_ratio_clamp)
  log_r = jnp.where(valid_BT, log_r, jnp.zeros((), dtype))
  k = jax.lax.stop_gradient(estimate(log_r, estimator))
  adv = advantages_BT.astype(dtype) - coef * penalty_to_go(k, valid_BT, segment_ids_BT)
  return jax.lax.stop_gradient(adv), k
