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

KL_MODES: tuple[str, ...] = ("off", "loss", "reward")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def _log_ratio(a_BT, b_BT, clamp):
  """log a - log b clipped to [-clamp, clamp] (as `offpolicy.clamped_log_ratio`; this layer-0
  module imports no other package module)."""
  return jnp.clip(a_BT - b_BT, -clamp, clamp)


def _check_shapes(**arrays):
  shapes = {name: jnp.shape(x) for name, x in arrays.items()}
  if len(set(shapes.values())) != 1 or any(len(v) != 2 for v in shapes.values()):
    raise ValueError(f"kl_penalty: every array must be [B, T] with one shape; got {shapes}.")
  return next(iter(shapes.values()))


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
  _check_shapes(logp_BT=logp_BT, ref_logp_BT=ref_logp_BT, behavior_logp_BT=behavior_logp_BT)
  log_r = _log_ratio(jax.lax.stop_gradient(ref_logp_BT), logp_BT, log_ratio_clamp)
  k = estimate(log_r, estimator)
  term = coef * k
  if is_weight:
    weight = jnp.exp(_log_ratio(logp_BT, behavior_logp_BT, log_ratio_clamp))
    term = jax.lax.stop_gradient(weight) * term
  return term, jax.lax.stop_gradient(k)


def penalty_to_go(k_BT: jax.Array, valid_BT: jax.Array,
                  segment_ids_BT: jax.Array | None) -> jax.Array:
  """sum_{t' >= t, t' in t's sample, valid} k_t' for every token t (undiscounted, gamma = 1).

  Samples are contiguous runs of one segment id within a row (packing), so with the row's
  inclusive prefix sum P_t, the suffix sum within t's sample is P_e(t) - P_t + k_t, where e(t)
  is the last position of t's run (a reverse cumulative min over the run ends).

  Args:
    k_BT: float[B, T] per-token penalty (finite everywhere).
    valid_BT: bool[B, T] tokens that carry a penalty (others contribute 0).
    segment_ids_BT: int[B, T] sample id per token, or None for one sample per row.

  Returns:
    float[B, T] (values at invalid tokens are their sample's penalty still to come).
  """
  b, t = _check_shapes(k_BT=k_BT, valid_BT=valid_BT)
  k = jnp.where(valid_BT, k_BT, jnp.zeros((), k_BT.dtype))
  prefix = jnp.cumsum(k, axis=1)
  if segment_ids_BT is None:
    return prefix[:, -1:] - prefix + k
  seg = segment_ids_BT
  last = jnp.concatenate([seg[:, 1:] != seg[:, :-1], jnp.ones((b, 1), bool)], axis=1)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  end = jax.lax.cummin(jnp.where(last, pos, t), axis=1, reverse=True)
  return jnp.take_along_axis(prefix, end, axis=1) - prefix + k


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
  _check_shapes(advantages_BT=advantages_BT, ref_logp_BT=ref_logp_BT,
                behavior_logp_BT=behavior_logp_BT, valid_BT=valid_BT)
  dtype = jnp.promote_types(advantages_BT.dtype, jnp.float32)
  log_r = _log_ratio(ref_logp_BT.astype(dtype), behavior_logp_BT.astype(dtype), log_ratio_clamp)
  log_r = jnp.where(valid_BT, log_r, jnp.zeros((), dtype))
  k = jax.lax.stop_gradient(estimate(log_r, estimator))
  adv = advantages_BT.astype(dtype) - coef * penalty_to_go(k, valid_BT, segment_ids_BT)
  return jax.lax.stop_gradient(adv), k
