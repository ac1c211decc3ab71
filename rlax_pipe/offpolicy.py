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
  """Per-batch off-policy diagnostics (all jnp arrays, jit-friendly), each on named tokens.

  Token sets: "loss-mask" tokens have mask > 0; "valid" tokens are loss-mask tokens whose lag is
  within `max_lag`; "used" tokens are valid tokens the objective keeps (only `is_mask` rejects
  some); "equal-weight" tokens are valid tokens of samples generated entirely by the weights the
  learner holds before this batch's first update (every completion token of the sample has lag
  0), so the sampler and the learner scored them with identical weights and an identical
  context (`equal_weight_mask`).

  Two ratios are reported, named for what they measure:
    * r = pi_theta / mu, the *behaviour ratio* the objectives correct with: learner policy at
      the update over the sampler's recorded probability. It mixes staleness (lag > 0),
      in-batch updates (minibatches after the first) and the engine mismatch.
    * pi_prox / mu on equal-weight tokens, the *engine mismatch* at equal weights (Yao et al.
      2025; the ratio IcePop's band is meant for): pi_prox is the learner's policy before the
      batch's first update, so on these tokens only numerics differ (kernels, precision).

  A statistic whose token set is empty is NaN ("absent", never a fake 0.0); the count fields say
  how many tokens each statistic describes (`DIAGNOSTIC_COUNTS`).

  Attributes:
    ratio_mean: mean of r over valid tokens (r from the clamped log-ratio); float scalar.
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
      of KL(mu || pi_theta) under tokens sampled from mu (Schulman 2020, "Approximating KL
      divergence"); float scalar, nats per token.
    entropy: mean over valid tokens of the per-token policy entropy (nats); NaN when the caller
      gave none.
    tokens: int32 scalar, number of used tokens (those that contribute to the loss).
    logp_mismatch_mean: mean of |log pi_prox - log mu| over equal-weight tokens: the
      sampler/learner numeric mismatch for identical weights and context; float scalar, nats.
    logp_mismatch_max: max of |log pi_prox - log mu| over equal-weight tokens; float scalar.
    mask_tokens: int32 scalar, number of loss-mask tokens.
    valid_tokens: int32 scalar, number of valid tokens.
    mismatch_tokens: int32 scalar, number of equal-weight tokens.
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
  mask_tokens: jax.Array
  valid_tokens: jax.Array
  mismatch_tokens: jax.Array


# Statistic -> the count field of the tokens it describes; a statistic is NaN (absent) when that
# count is 0. `entropy` is also absent when no per-token entropy was given.
DIAGNOSTIC_COUNTS: dict[str, str] = {
    "ratio_mean": "valid_tokens", "ratio_var": "valid_tokens", "ratio_min": "valid_tokens",
    "ratio_max": "valid_tokens", "ess": "valid_tokens", "frac_truncated": "valid_tokens",
    "kl_k3": "valid_tokens", "entropy": "valid_tokens", "frac_masked": "mask_tokens",
    "logp_mismatch_mean": "mismatch_tokens", "logp_mismatch_max": "mismatch_tokens",
}


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


def _segments(segment_ids_BT: jax.Array | None, shape: tuple[int, int]) -> jax.Array:
  if segment_ids_BT is None:
    return jnp.ones(shape, jnp.int32)
  return jnp.clip(segment_ids_BT.astype(jnp.int32), 0, shape[1])


def per_sample(x_BTC: jax.Array, segment_ids_BT: jax.Array | None, op: str = "sum") -> jax.Array:
  """Reduces [B, T, C] per token into [B, T + 1, C] per (row, segment id) sample.

  Samples never straddle rows, so the reduction runs row by row (`jax.vmap` of a segment
  reduction): with rows sharded over devices it stays local to each device.

  Args:
    x_BTC: [B, T, C] values (C channels reduced together).
    segment_ids_BT: int[B, T] sample id within each row (values in [0, T]), or None for one
      sample per row.
    op: "sum" or "max" (empty samples give 0 for sum, the dtype's lowest value for max).

  Returns:
    [B, T + 1, C]: entry [b, s] reduces row b's tokens with segment id s.
  """
  b, t = x_BTC.shape[:2]
  seg = _segments(segment_ids_BT, (b, t))
  fn = jax.ops.segment_sum if op == "sum" else jax.ops.segment_max
  return jax.vmap(lambda x, ids: fn(x, ids, num_segments=t + 1))(x_BTC, seg)


def per_token(x_BS: jax.Array, segment_ids_BT: jax.Array | None, t: int) -> jax.Array:
  """Broadcasts per-sample values [B, T + 1] back to their tokens: [B, T]."""
  seg = _segments(segment_ids_BT, (x_BS.shape[0], t))
  return jnp.take_along_axis(x_BS, seg, axis=1)


def equal_weight_mask(valid_BT: jax.Array, mask_BT: jax.Array, lag_BT: jax.Array,
                      segment_ids_BT: jax.Array | None) -> jax.Array:
  """Valid tokens of samples whose every loss-mask (completion) token has lag 0.

  Token versions never decrease within a sample, so these are the samples that one version,
  the learner's current one, generated from prefill to the end: sampler and learner then scored
  every token with identical weights and an identical KV context. A lag-0 token of a sample
  that started under older weights is excluded: with `kv_policy="keep"` its context was
  encoded by the older weights (stale KV), which is not an equal-weights comparison.

  Args:
    valid_BT: bool[B, T] valid tokens.
    mask_BT: float[B, T] loss mask.
    lag_BT: int[B, T] per-token lag.
    segment_ids_BT: int[B, T] packing ids, or None for one sample per row.

  Returns:
    bool[B, T].
  """
  shape = check_token_shapes(valid_BT=valid_BT, mask_BT=mask_BT, lag_BT=lag_BT)
  stale = ((mask_BT > 0) & (lag_BT != 0)).astype(jnp.int32)
  any_stale = per_sample(stale[:, :, None], segment_ids_BT, "sum")[:, :, 0]
  return valid_BT & (lag_BT == 0) & (per_token(any_stale, segment_ids_BT, shape[1]) == 0)


class DiagnosticSums(NamedTuple):
  """Additive sufficient statistics of `ObjectiveDiagnostics` over a set of tokens.

  Sums over disjoint token sets combine with `combine_sums` (sums add, extremes take max,
  log-sum-exps add in log space), so diagnostics of a batch processed in micro-batches equal
  those of the whole batch. Build with `diagnostic_sums`, read with `finalize_diagnostics`.
  Counts are int32; `lse_r` / `lse_r2` are log sum r and log sum r^2 over valid tokens (-inf
  when empty; log space keeps r^2 finite up to log_ratio_clamp = 80); `sum_dr` / `sum_dr2` are
  sum (r - 1) and sum (r - 1)^2 (shifted by 1 so the variance has no cancellation near r = 1).
  """

  n_mask: jax.Array
  n_valid: jax.Array
  n_used: jax.Array
  n_mismatch: jax.Array
  n_entropy: jax.Array
  lse_r: jax.Array
  lse_r2: jax.Array
  sum_dr: jax.Array
  sum_dr2: jax.Array
  sum_k3: jax.Array
  sum_truncated: jax.Array
  sum_entropy: jax.Array
  sum_mismatch: jax.Array
  max_log_r: jax.Array
  neg_min_log_r: jax.Array
  max_mismatch: jax.Array
  lag_hist: jax.Array


def diagnostic_sums(*, log_ratio_BT: jax.Array, mismatch_BT: jax.Array, mask_BT: jax.Array,
                    lag_BT: jax.Array, valid_BT: jax.Array, used_BT: jax.Array,
                    truncated_BT: jax.Array, equal_weight_BT: jax.Array, hist_bins: int,
                    entropy_BT: jax.Array | None = None) -> DiagnosticSums:
  """Sufficient statistics of the diagnostics over one batch (or micro-batch) of tokens.

  All inputs are treated as constants (stop_gradient). Definitions on `ObjectiveDiagnostics`.
  Every reduction selects with `jnp.where`, so values at excluded positions never matter.

  Args:
    log_ratio_BT: float[B, T] clamped log(pi_theta / mu), finite at valid positions.
    mismatch_BT: float[B, T] |log pi_prox - log mu|, finite at equal-weight positions.
    mask_BT: float[B, T] loss mask before the lag rule.
    lag_BT: int[B, T] per-token lag.
    valid_BT: bool[B, T] loss-mask tokens within max_lag.
    used_BT: bool[B, T] tokens that contribute to the loss (valid and not ratio-masked).
    truncated_BT: bool[B, T] tokens whose weight or ratio the objective truncated or clipped.
    equal_weight_BT: bool[B, T] tokens the engine mismatch is measured on.
    hist_bins: static number of lag histogram bins (>= 1).
    entropy_BT: optional float[B, T] per-token policy entropy in nats.

  Returns:
    DiagnosticSums (float32 sums, int32 counts).

  Raises:
    ValueError: on rank or shape mismatch.
  """
  shape = check_token_shapes(log_ratio_BT=log_ratio_BT, mismatch_BT=mismatch_BT, mask_BT=mask_BT,
                             lag_BT=lag_BT, valid_BT=valid_BT, used_BT=used_BT,
                             truncated_BT=truncated_BT, equal_weight_BT=equal_weight_BT)
  sg = jax.lax.stop_gradient
  f32 = jnp.float32
  zero = jnp.zeros((), f32)
  log_r = jnp.where(valid_BT, sg(log_ratio_BT).astype(f32), zero)
  mismatch = jnp.where(equal_weight_BT, sg(mismatch_BT).astype(f32), zero)
  dr = jnp.expm1(log_r)  # r - 1, exact near r = 1
  k3 = dr - log_r  # (r - 1) - log r, without cancellation near r = 1
  # Materialize the transcendentals once: otherwise XLA re-emits them inside every reduction
  # fusion below, which doubles compile time for no run-time gain.
  dr, k3 = jax.lax.optimization_barrier((dr, k3))
  if entropy_BT is None:
    entropy, n_entropy = jnp.zeros(shape, f32), jnp.zeros((), jnp.int32)
  else:
    if jnp.shape(entropy_BT) != shape:
      raise ValueError(f"entropy_BT shape {jnp.shape(entropy_BT)} != token shape {shape}.")
    entropy = jnp.where(valid_BT, sg(entropy_BT).astype(f32), zero)
    n_entropy = None

  def over(select, x):
    return jnp.where(select, x, zero)

  n_mask, n_valid, n_used, n_mismatch = jnp.sum(
      jnp.stack([mask_BT > 0, valid_BT, used_BT & valid_BT, equal_weight_BT]), axis=(1, 2),
      dtype=jnp.int32)
  sum_dr, sum_dr2, sum_k3, sum_trunc, sum_entropy, sum_mismatch = jnp.sum(jnp.stack([
      over(valid_BT, dr), over(valid_BT, dr * dr), over(valid_BT, k3),
      over(valid_BT & truncated_BT, 1.0), entropy, mismatch]), axis=(1, 2))
  neg_inf = jnp.array(-jnp.inf, f32)
  max_log_r, neg_min_log_r, max_mismatch = jnp.max(jnp.stack([
      jnp.where(valid_BT, log_r, neg_inf), jnp.where(valid_BT, -log_r, neg_inf),
      jnp.where(equal_weight_BT, mismatch, neg_inf)]), axis=(1, 2))
  lse_r, lse_r2 = (jax.nn.logsumexp(jnp.where(valid_BT, x, neg_inf)) for x in (log_r, 2 * log_r))
  return DiagnosticSums(
      n_mask=n_mask, n_valid=n_valid, n_used=n_used, n_mismatch=n_mismatch,
      n_entropy=n_valid if n_entropy is None else n_entropy,
      lse_r=lse_r, lse_r2=lse_r2, sum_dr=sum_dr, sum_dr2=sum_dr2, sum_k3=sum_k3,
      sum_truncated=sum_trunc, sum_entropy=sum_entropy, sum_mismatch=sum_mismatch,
      max_log_r=max_log_r, neg_min_log_r=neg_min_log_r, max_mismatch=max_mismatch,
      lag_hist=lag_histogram(lag_BT, mask_BT, hist_bins))


def empty_sums(hist_bins: int) -> DiagnosticSums:
  """The identity of `combine_sums`: statistics of an empty token set."""
  zero_i, zero_f = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
  neg_inf = jnp.full((), -jnp.inf, jnp.float32)
  return DiagnosticSums(
      n_mask=zero_i, n_valid=zero_i, n_used=zero_i, n_mismatch=zero_i, n_entropy=zero_i,
      lse_r=neg_inf, lse_r2=neg_inf, sum_dr=zero_f, sum_dr2=zero_f, sum_k3=zero_f,
      sum_truncated=zero_f, sum_entropy=zero_f, sum_mismatch=zero_f, max_log_r=neg_inf,
      neg_min_log_r=neg_inf, max_mismatch=neg_inf,
      lag_hist=jnp.zeros((hist_bins,), jnp.int32))


_MAX_FIELDS = ("max_log_r", "neg_min_log_r", "max_mismatch")
_LSE_FIELDS = ("lse_r", "lse_r2")


def combine_sums(a: DiagnosticSums, b: DiagnosticSums) -> DiagnosticSums:
  """Statistics of the union of two disjoint token sets."""
  out = {}
  for name in DiagnosticSums._fields:
    x, y = getattr(a, name), getattr(b, name)
    out[name] = (jnp.maximum(x, y) if name in _MAX_FIELDS else
                 jnp.logaddexp(x, y) if name in _LSE_FIELDS else x + y)
  return DiagnosticSums(**out)


def normalized_ess(lse_r: jax.Array, lse_r2: jax.Array, n: jax.Array | int) -> jax.Array:
  """Normalized effective sample size (sum r)^2 / (N sum r^2) of N importance ratios r, from
  log(sum r) and log(sum r^2) (Kong 1992; Owen 2013, "Monte Carlo theory, methods and
  examples", eq. 9.13, divided by N). Computed in log space, so ratios far from 1 neither
  overflow nor underflow; capped at 1.0 (rounding).

  Args:
    lse_r: float scalar, logsumexp of the log-ratios.
    lse_r2: float scalar, logsumexp of twice the log-ratios.
    n: number of ratios (>= 1).

  Returns:
    float scalar in (0, 1]; 1.0 exactly when every ratio is equal (on-policy: r = 1).
  """
  return jnp.minimum(jnp.exp(2.0 * lse_r - lse_r2 - jnp.log(n)), 1.0)


def finalize_diagnostics(s: DiagnosticSums) -> ObjectiveDiagnostics:
  """`ObjectiveDiagnostics` from their sufficient statistics; empty sets give NaN (absent)."""
  f32 = jnp.float32
  nan = jnp.full((), jnp.nan, f32)

  def mean(total, count):
    return jnp.where(count > 0, total / jnp.maximum(count, 1).astype(f32), nan)

  def present(value, count):
    return jnp.where(count > 0, value, nan)

  n = jnp.maximum(s.n_valid, 1).astype(f32)
  mean_dr = s.sum_dr / n
  return ObjectiveDiagnostics(
      ratio_mean=present(1.0 + mean_dr, s.n_valid),
      ratio_var=present(jnp.maximum(s.sum_dr2 / n - mean_dr * mean_dr, 0.0), s.n_valid),
      ratio_min=present(jnp.exp(-s.neg_min_log_r), s.n_valid),
      ratio_max=present(jnp.exp(s.max_log_r), s.n_valid),
      ess=present(normalized_ess(s.lse_r, s.lse_r2, n), s.n_valid),
      frac_truncated=mean(s.sum_truncated, s.n_valid),
      frac_masked=present(1.0 - s.n_used.astype(f32) / jnp.maximum(s.n_mask, 1).astype(f32),
                          s.n_mask),
      lag_hist=s.lag_hist,
      kl_k3=mean(s.sum_k3, s.n_valid),
      entropy=mean(s.sum_entropy, s.n_entropy),
      tokens=s.n_used,
      logp_mismatch_mean=mean(s.sum_mismatch, s.n_mismatch),
      logp_mismatch_max=present(s.max_mismatch, s.n_mismatch),
      mask_tokens=s.n_mask,
      valid_tokens=s.n_valid,
      mismatch_tokens=s.n_mismatch,
  )
