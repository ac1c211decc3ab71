"""Off-policy bookkeeping shared by every objective: log-ratios, lag rules and diagnostics.

Notation (see `rlax_pipe.types` for the letter legend): B batch rows, T tokens per row.
pi = current (learner) policy, mu = behavior (sampler) policy, r_t = pi(a_t|s_t) / mu(a_t|s_t),
lag_t = learner version - version of the weights that sampled token t (DESIGN.md, "Staleness").

Everything here is a pure function of arrays; masked positions never produce NaN or inf because
callers pass sanitized inputs and every reduction selects with `jnp.where` (never `0 * x`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ObjectiveDiagnostics(NamedTuple):
  """Per-batch off-policy diagnostics returned by every objective (all jnp arrays, jit-friendly).

  "Valid" tokens are loss-mask tokens whose lag is within `max_lag`. Every scalar statistic is
  0.0 when no token qualifies for it (check `tokens`), so the tuple is always finite.

  Attributes:
    ratio_mean: mean of r = pi/mu over valid tokens (r from the clamped log-ratio); float scalar.
    ratio_var: population variance of r over valid tokens; float scalar.
    ratio_min: smallest r over valid tokens; float scalar.
    ratio_max: largest r over valid tokens; float scalar.
    ess: normalized effective sample size (sum r)^2 / (N sum r^2) of the untruncated ratios over
      the N valid tokens (Kong 1992; PipelineRL Sec. 5). In (0, 1]; 1.0 exactly on-policy.
    frac_truncated: fraction of valid tokens whose weight or ratio was truncated or clipped by
      the objective (its docstring says which event counts); float scalar in [0, 1].
    frac_masked: fraction of loss-mask tokens removed from the loss, by the lag mask
      (lag > max_lag) or by an importance-ratio mask (is_mask); float scalar in [0, 1].
    lag_hist: int32[hist_bins] number of loss-mask tokens with lag 0, 1, ..., hist_bins - 2;
      the last bin counts lag >= hist_bins - 1. Counts tokens before the lag mask is applied.
    kl_k3: mean over valid tokens of k3 = (r - 1) - log r, an unbiased, non-negative estimator
      of KL(mu || pi) under tokens sampled from mu (Schulman 2020, "Approximating KL
      divergence"); float scalar, nats per token.
    entropy: mean over valid tokens of the caller's per-token entropy (nats), 0.0 when the
      objective was called without `entropy_BT`.
    tokens: int32 scalar, number of tokens that contribute to the loss.
    logp_mismatch_mean: mean of |log pi - log mu| over valid lag-0 tokens, i.e. the
      sampler/learner numeric mismatch for identical weights (Yao et al. 2025); float scalar.
    logp_mismatch_max: max of |log pi - log mu| over valid lag-0 tokens; float scalar.
  """

  ratio_mean: jax.Array
  ratio_var: jax.Array
  ratio_min: jax.Array
  ratio_max: jax.Array
  ess: jax.Array
  frac_truncated: jax.Array
  frac_masked: jax.Array
  lag_hist: jax.Array
  kl_k3: jax.Array
  entropy: jax.Array
  tokens: jax.Array
  logp_mismatch_mean: jax.Array
  logp_mismatch_max: jax.Array


def check_token_shapes(**arrays: jax.Array) -> tuple[int, ...]:
  """Checks that every keyword array is rank 2 [B, T] and that all shapes agree.

  Args:
    **arrays: arrays by argument name (the names appear in the error message).

  Returns:
    The common shape (B, T).

  Raises:
    ValueError: if an array is not rank 2 or the shapes differ.
  """
  shapes = {name: jnp.shape(x) for name, x in arrays.items()}
  first = next(iter(shapes.values()))
  for name, shape in shapes.items():
    if len(shape) != 2:
      raise ValueError(f"{name} must be rank 2 [B, T]; got shape {shape}.")
    if shape != first:
      raise ValueError(f"Token arrays disagree in shape: {shapes}; all must be [B, T].")
  return first


def clamped_log_ratio(logp_BT: jax.Array, other_logp_BT: jax.Array,
                      clamp: float) -> jax.Array:
  """Log importance ratio log(pi / q) = log pi - log q, clipped to [-clamp, clamp].

  Clipping in log space before any `exp` keeps exp(log_ratio) within [e^-clamp, e^clamp], so a
  ratio never overflows. The gradient is zero where the clip is active.

  Args:
    logp_BT: float[B, T] log pi of each token (nats).
    other_logp_BT: float[B, T] log q of the same tokens (behavior or proximal policy).
    clamp: positive float, bound on |log ratio| (nats).

  Returns:
    float[B, T] clipped log-ratio in the dtype of `logp_BT - other_logp_BT`.

  Raises:
    ValueError: on rank or shape mismatch or a non-positive clamp.
  """
  check_token_shapes(logp_BT=logp_BT, other_logp_BT=other_logp_BT)
  if not clamp > 0:
    raise ValueError(f"clamp={clamp} must be > 0.")
  return jnp.clip(logp_BT - other_logp_BT, -clamp, clamp)


def lag_keep_mask(mask_BT: jax.Array, lag_BT: jax.Array, max_lag: int | None) -> jax.Array:
  """Tokens that may enter the loss: loss-mask tokens with lag <= max_lag (DESIGN.md).

  This is the hard staleness bound: a token with lag > max_lag never contributes to the loss,
  its normalizer, or the gradient.

  Args:
    mask_BT: float[B, T] loss mask, 1.0 at completion tokens (any value > 0 counts as 1).
    lag_BT: int[B, T] per-token lag in optimizer steps (>= 0).
    max_lag: largest admissible lag, or None for no bound.

  Returns:
    bool[B, T].

  Raises:
    ValueError: on rank or shape mismatch; TypeError if `lag_BT` is not integer.
  """
  check_token_shapes(mask_BT=mask_BT, lag_BT=lag_BT)
  if not jnp.issubdtype(lag_BT.dtype, jnp.integer):
    raise TypeError(f"lag_BT must be an integer array; got dtype {lag_BT.dtype}.")
  keep = mask_BT > 0
  if max_lag is not None:
    keep = keep & (lag_BT <= max_lag)
  return keep


def lag_truncation_scale(lag_BT: jax.Array, lag_truncation: float | tuple[float, ...] | None,
                         dtype: jnp.dtype) -> jax.Array:
  """Lag-dependent multiplier s(lag) of an objective's truncation level: c(lag) = c * s(lag).

  Rule (the only one used in the package):
    * None: s(lag) = 1 (no lag dependence);
    * float d in (0, 1]: s(lag) = d ** lag, a geometric decay, so older tokens get a tighter
      truncation (a lag-aware variant of the IMPALA rho-bar, Espeholt et al. 2018 eq. 1);
    * tuple (s_0, ..., s_{K-1}): s(lag) = s_{min(lag, K-1)}, a table per lag whose last
      entry covers every larger lag.
  Negative lags (a caller bug) are treated as lag 0.

  Args:
    lag_BT: int[B, T] per-token lag.
    lag_truncation: None, a decay factor, or a tuple of positive multipliers.
    dtype: floating dtype of the result.

  Returns:
    dtype[B, T] positive multipliers.

  Raises:
    TypeError: if `lag_BT` is not integer.
  """
  if not jnp.issubdtype(lag_BT.dtype, jnp.integer):
    raise TypeError(f"lag_BT must be an integer array; got dtype {lag_BT.dtype}.")
  lag_BT = jnp.maximum(lag_BT, 0)
  if lag_truncation is None:
    return jnp.ones(lag_BT.shape, dtype)
  if isinstance(lag_truncation, tuple):
    table = jnp.asarray(lag_truncation, dtype)
    return table[jnp.minimum(lag_BT, len(lag_truncation) - 1)]
  return jnp.power(jnp.asarray(lag_truncation, dtype), lag_BT.astype(dtype))


def lag_histogram(lag_BT: jax.Array, mask_BT: jax.Array, bins: int) -> jax.Array:
  """Counts of loss-mask tokens per lag 0, 1, ..., bins - 2, and lag >= bins - 1 in the last bin.

  Args:
    lag_BT: int[B, T] per-token lag (negative values are counted as lag 0).
    mask_BT: float[B, T] loss mask (tokens with mask > 0 are counted).
    bins: static number of bins K >= 1.

  Returns:
    int32[K] counts.

  Raises:
    ValueError: on rank/shape mismatch or bins < 1.
  """
  check_token_shapes(lag_BT=lag_BT, mask_BT=mask_BT)
  if bins < 1:
    raise ValueError(f"bins={bins} must be >= 1.")
  # A fused compare-and-reduce; unlike a scatter-add it compiles fast and stays deterministic.
  bin_BTK = jnp.clip(lag_BT, 0, bins - 1)[:, :, None] == jnp.arange(bins)[None, None, :]
  return jnp.sum(bin_BTK & (mask_BT > 0)[:, :, None], axis=(0, 1), dtype=jnp.int32)


def effective_sample_size(weights_BT: jax.Array, valid_BT: jax.Array) -> jax.Array:
  """Normalized effective sample size (sum w)^2 / (N sum w^2) over valid tokens (Kong 1992).

  Computed on w / max(w), which leaves the value unchanged and cannot overflow. Returns 1.0 for
  equal weights and 0.0 when there is no valid token.

  Args:
    weights_BT: float[B, T] non-negative importance weights (finite at valid positions).
    valid_BT: bool[B, T] tokens to include.

  Returns:
    float scalar in [0, 1].

  Raises:
    ValueError: on rank or shape mismatch.
  """
  check_token_shapes(weights_BT=weights_BT, valid_BT=valid_BT)
  w = jnp.where(valid_BT, weights_BT, 0.0)
  top = jnp.max(w)
  scaled = w / jnp.where(top > 0, top, 1.0)
  total, total_sq, count = jnp.sum(
      jnp.stack([scaled, scaled * scaled, valid_BT.astype(w.dtype)]), axis=(1, 2))
  denom = count * total_sq
  ok = denom > 0
  return jnp.where(ok, total * total / jnp.where(ok, denom, 1.0), 0.0)


def compute_diagnostics(*, log_ratio_BT: jax.Array, logp_BT: jax.Array,
                        behavior_logp_BT: jax.Array, mask_BT: jax.Array, lag_BT: jax.Array,
                        valid_BT: jax.Array, used_BT: jax.Array, truncated_BT: jax.Array,
                        hist_bins: int,
                        entropy_BT: jax.Array | None = None) -> ObjectiveDiagnostics:
  """Fills `ObjectiveDiagnostics`; the one diagnostic routine shared by every objective.

  All inputs are treated as constants (stop_gradient). Definitions are on `ObjectiveDiagnostics`.
  Sums, extremes and centred moments are each taken in one stacked reduction (cheaper to compile
  and run than one reduction per statistic).

  Args:
    log_ratio_BT: float[B, T] clamped log(pi/mu) (finite everywhere).
    logp_BT: float[B, T] log pi, sanitized (finite) at invalid positions.
    behavior_logp_BT: float[B, T] log mu, sanitized (finite) at invalid positions.
    mask_BT: float[B, T] loss mask before the lag rule.
    lag_BT: int[B, T] per-token lag.
    valid_BT: bool[B, T] loss-mask tokens within max_lag.
    used_BT: bool[B, T] tokens that contribute to the loss (valid and not ratio-masked).
    truncated_BT: bool[B, T] tokens whose weight or ratio the objective truncated or clipped.
    hist_bins: static number of lag histogram bins (>= 1).
    entropy_BT: optional float[B, T] per-token policy entropy in nats.

  Returns:
    ObjectiveDiagnostics.

  Raises:
    ValueError: on rank or shape mismatch.
  """
  shape = check_token_shapes(log_ratio_BT=log_ratio_BT, logp_BT=logp_BT,
                            behavior_logp_BT=behavior_logp_BT, mask_BT=mask_BT, lag_BT=lag_BT,
                            valid_BT=valid_BT, used_BT=used_BT, truncated_BT=truncated_BT)
  sg = jax.lax.stop_gradient
  log_r = sg(log_ratio_BT)
  dtype = log_r.dtype
  ratio = jnp.exp(log_r)
  on_time = valid_BT & (lag_BT == 0)
  mismatch = jnp.abs(sg(logp_BT) - sg(behavior_logp_BT))
  k3 = jnp.expm1(log_r) - log_r  # (r - 1) - log r, without cancellation near r = 1
  # Materialize the transcendentals once: otherwise XLA re-emits exp/expm1 inside every
  # reduction fusion below, which doubles compile time for no run-time gain.
  ratio, k3 = jax.lax.optimization_barrier((ratio, k3))
  if entropy_BT is None:
    entropy = jnp.zeros(shape, dtype)
  else:
    if jnp.shape(entropy_BT) != shape:
      raise ValueError(f"entropy_BT shape {jnp.shape(entropy_BT)} != token shape {shape}.")
    entropy = sg(entropy_BT).astype(dtype)

  def over(select, x):
    return jnp.where(select, x, jnp.zeros((), dtype))

  n_valid, n_on_time, n_mask, n_used = jnp.sum(
      jnp.stack([valid_BT, on_time, mask_BT > 0, used_BT]), axis=(1, 2), dtype=jnp.int32)
  sum_r, sum_k3, sum_trunc, sum_entropy, sum_mismatch = jnp.sum(jnp.stack([
      over(valid_BT, ratio), over(valid_BT, k3), over(valid_BT & truncated_BT, 1.0),
      over(valid_BT, entropy), over(on_time, mismatch)]), axis=(1, 2))
  neg_inf = jnp.array(-jnp.inf, dtype)
  max_r, neg_min_r, max_mismatch = jnp.max(jnp.stack([
      jnp.where(valid_BT, ratio, neg_inf), jnp.where(valid_BT, -ratio, neg_inf),
      jnp.where(on_time, mismatch, neg_inf)]), axis=(1, 2))

  def mean(total, count):
    return jnp.where(count > 0, total / jnp.maximum(count, 1).astype(dtype), 0.0)

  ratio_mean = mean(sum_r, n_valid)
  any_valid = n_valid > 0
  scaled = ratio / jnp.where(any_valid & (max_r > 0), max_r, 1.0)
  sum_sq_dev, sum_scaled, sum_scaled_sq = jnp.sum(jnp.stack([
      over(valid_BT, jnp.square(ratio - ratio_mean)), over(valid_BT, scaled),
      over(valid_BT, scaled * scaled)]), axis=(1, 2))
  ess_denom = n_valid.astype(dtype) * sum_scaled_sq
  ess_ok = ess_denom > 0

  return ObjectiveDiagnostics(
      ratio_mean=ratio_mean,
      ratio_var=mean(sum_sq_dev, n_valid),
      ratio_min=jnp.where(any_valid, -neg_min_r, 0.0),
      ratio_max=jnp.where(any_valid, max_r, 0.0),
      ess=jnp.where(ess_ok, sum_scaled * sum_scaled / jnp.where(ess_ok, ess_denom, 1.0), 0.0),
      frac_truncated=mean(sum_trunc, n_valid),
      frac_masked=jnp.where(n_mask > 0, 1.0 - n_used.astype(dtype) / jnp.maximum(n_mask, 1),
                            0.0).astype(dtype),
      lag_hist=lag_histogram(lag_BT, mask_BT, hist_bins),
      kl_k3=mean(sum_k3, n_valid),
      entropy=mean(sum_entropy, n_valid),
      tokens=n_used,
      logp_mismatch_mean=mean(sum_mismatch, n_on_time),
      logp_mismatch_max=jnp.where(n_on_time > 0, max_mismatch, 0.0),
  )
