"""Policy-gradient objectives with per-token importance correction and lag rules (rlax style).

Every objective is a pure function with one signature,

  fn(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, *,
     prox_logp_BT=None, segment_ids_BT=None, entropy_BT=None) -> (loss, ObjectiveDiagnostics)

and is registered by name in `OBJECTIVES` (the single list of valid names). The loss is to be
minimized; its gradient w.r.t. `logp_BT` is the variant's policy-gradient estimate.

Shared rules, applied identically to every variant (`_prepare` / `_finish`):
  * ratios are formed in log space and clipped to [-log_ratio_clamp, log_ratio_clamp] before exp;
  * a token enters the loss only if mask > 0 and lag <= max_lag ("valid"); invalid positions are
    replaced by zeros *before* any arithmetic and selected out with `jnp.where`, so they give
    exact zeros in loss and gradient whatever their values (-inf, NaN, 1e30);
  * truncation levels are multiplied by s(lag) from `offpolicy.lag_truncation_scale`;
  * the per-token loss is reduced by `aggregate_loss` (token_mean / sequence_mean / constant);
  * diagnostics come from `offpolicy.compute_diagnostics`.

Example:
  >>> cfg = ObjectiveConfig(name="tis_pg", truncation=2.0, max_lag=8)
  >>> loss, diag = get_objective(cfg.name)(logp, mu_logp, adv, mask, lag, cfg)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from rlax_pipe import offpolicy
from rlax_pipe.offpolicy import ObjectiveDiagnostics

AGGREGATIONS: tuple[str, ...] = ("token_mean", "sequence_mean", "constant")
# Largest admissible log_ratio_clamp: exp(80) ~ 5.5e34 is still finite in float32.
_MAX_LOG_RATIO_CLAMP = 80.0


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """Configuration of the learner objective (static: hashable, safe as a jit static argument).

  Fields that a variant would silently ignore raise instead (e.g. `lag_truncation` with
  `no_correction`), so an ablation never runs a knob that does nothing.

  Attributes:
    name: objective, a key of `OBJECTIVES`.
    truncation: c > 0, upper bound of the held-constant importance weight min(r, c) in `tis_pg`
      and `cispo` (epsilon_max there). Default 2.0, the TIS / verl rollout-correction default
      (Yao et al. 2025); PipelineRL trains with 5, ScaleRL's CISPO with 4-8.
    clip_eps: PPO clip epsilon in (0, 1); lower clip 1 - clip_eps (Schulman et al. 2017 eq. 7).
    clip_eps_high: upper clip epsilon > 0 (DAPO clip-higher, e.g. 0.28), None = clip_eps.
    is_mask_low: a >= 0, `is_mask` drops tokens with r < a (IcePop band; default 0.5).
    is_mask_high: b >= 1 (and b > a), `is_mask` drops tokens with r > b (default 5.0).
    behavior_trunc: None (off) or a level >= 1 for a truncation of the behavior ratio:
      in `ppo_clip` the dual-clip bound max(surrogate, c_b * A) for A < 0 (Ye et al. 2020 eq. 5);
      in `decoupled_ppo` the weight min(pi_prox/mu, c_b) (Yao et al. 2025 TIS for PPO). Only
      valid with those two objectives.
    max_lag: None or int >= 0; hard bound: no token with lag > max_lag ever enters loss,
      normalizer or gradient.
    lag_truncation: None, a decay d in (0, 1], or a tuple of multipliers > 0: the truncation
      level used for a token of lag l is level * s(l), with s(l) = d**l or s(l) =
      table[min(l, len - 1)] (see `offpolicy.lag_truncation_scale`). It scales `truncation` in
      tis_pg/cispo and `behavior_trunc` in ppo_clip/decoupled_ppo, and is only valid there.
    aggregation: how per-token losses are reduced, one of AGGREGATIONS: "token_mean" (sum over
      valid tokens / their count; DAPO token-level), "sequence_mean" (mean over each sample's
      valid tokens, then over samples; GRPO; needs segment_ids_BT), "constant" (sum over
      valid tokens / constant_normalizer; Dr. GRPO, Liu et al. 2025).
    constant_normalizer: positive divisor for "constant" aggregation, e.g. the batch's token
      capacity B * max completion length; required for "constant", invalid otherwise.
    log_ratio_clamp: bound in nats on |log ratio| before exp, in (0, 80] (default 20.0).
    hist_bins: number K >= 2 of lag histogram bins; bins 0..K-2 count lags exactly, bin K-1
      counts lag >= K-1 (default 17).
  """

  name: str = "tis_pg"
  truncation: float = 2.0
  clip_eps: float = 0.2
  clip_eps_high: float | None = None
  is_mask_low: float = 0.5
  is_mask_high: float = 5.0
  behavior_trunc: float | None = None
  max_lag: int | None = None
  lag_truncation: float | tuple[float, ...] | None = None
  aggregation: str = "token_mean"
  constant_normalizer: float | None = None
  log_ratio_clamp: float = 20.0
  hist_bins: int = 17

  def __post_init__(self):
    if self.name not in OBJECTIVES:
      raise ValueError(f"ObjectiveConfig.name={self.name!r}; choose one of {tuple(OBJECTIVES)}.")
    if not (math.isfinite(self.truncation) and self.truncation > 0):
      raise ValueError(f"ObjectiveConfig.truncation={self.truncation} must be finite and > 0.")
    if not 0 < self.clip_eps < 1:
      raise ValueError(f"ObjectiveConfig.clip_eps={self.clip_eps} must be in (0, 1).")
    if self.clip_eps_high is not None and not self.clip_eps_high > 0:
      raise ValueError(f"ObjectiveConfig.clip_eps_high={self.clip_eps_high} must be > 0 or None.")
    if not 0 <= self.is_mask_low <= 1:
      raise ValueError(f"ObjectiveConfig.is_mask_low={self.is_mask_low} must be in [0, 1].")
    if not (math.isfinite(self.is_mask_high) and self.is_mask_high >= 1
            and self.is_mask_high > self.is_mask_low):
      raise ValueError(f"ObjectiveConfig.is_mask_high={self.is_mask_high} must be finite, >= 1 "
                       f"and > is_mask_low={self.is_mask_low}.")
    if self.behavior_trunc is not None:
      if self.name not in _USES_BEHAVIOR_TRUNC:
        raise ValueError(
            f"ObjectiveConfig.behavior_trunc={self.behavior_trunc} has no effect with "
            f"name={self.name!r}; it is used by {_USES_BEHAVIOR_TRUNC} only.")
      if not (math.isfinite(self.behavior_trunc) and self.behavior_trunc >= 1):
        raise ValueError(
            f"ObjectiveConfig.behavior_trunc={self.behavior_trunc} must be finite and >= 1.")
    if self.max_lag is not None and (
        isinstance(self.max_lag, bool) or not isinstance(self.max_lag, int) or self.max_lag < 0):
      raise ValueError(f"ObjectiveConfig.max_lag={self.max_lag!r} must be None or an int >= 0.")
    self._validate_lag_truncation()
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(
          f"ObjectiveConfig.aggregation={self.aggregation!r}; choose one of {AGGREGATIONS}.")
    if self.aggregation == "constant":
      if self.constant_normalizer is None or not (
          math.isfinite(self.constant_normalizer) and self.constant_normalizer > 0):
        raise ValueError(
            f"ObjectiveConfig.constant_normalizer={self.constant_normalizer} must be a finite "
            "number > 0 when aggregation='constant'.")
    elif self.constant_normalizer is not None:
      raise ValueError(
          f"ObjectiveConfig.constant_normalizer={self.constant_normalizer} is only used with "
          f"aggregation='constant' (got aggregation={self.aggregation!r}); set it to None.")
    if not 0 < self.log_ratio_clamp <= _MAX_LOG_RATIO_CLAMP:
      raise ValueError(f"ObjectiveConfig.log_ratio_clamp={self.log_ratio_clamp} must be in "
                       f"(0, {_MAX_LOG_RATIO_CLAMP}].")
    if isinstance(self.hist_bins, bool) or not isinstance(self.hist_bins, int) or (
        self.hist_bins < 2):
      raise ValueError(f"ObjectiveConfig.hist_bins={self.hist_bins!r} must be an int >= 2.")

  def _validate_lag_truncation(self):
    """Checks `lag_truncation`'s form and that the chosen objective has a level to scale."""
    lt = self.lag_truncation
    if lt is None:
      return
    if isinstance(lt, tuple):
      if not lt or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                           for v in lt):
        raise ValueError(f"ObjectiveConfig.lag_truncation={lt!r}: a table must be a non-empty "
                         "tuple of finite multipliers > 0.")
    elif isinstance(lt, bool) or not isinstance(lt, (int, float)) or not 0 < lt <= 1:
      raise ValueError(f"ObjectiveConfig.lag_truncation={lt!r} must be None, a decay in (0, 1] "
                       "or a tuple of multipliers > 0 (a list is not hashable; use a tuple).")
    has_level = self.name in ("tis_pg", "cispo") or (
        self.name in _USES_BEHAVIOR_TRUNC and self.behavior_trunc is not None)
    if not has_level:
      raise ValueError(
          f"ObjectiveConfig.lag_truncation={lt!r} has no effect with name={self.name!r}"
          f"{' and behavior_trunc=None' if self.name in _USES_BEHAVIOR_TRUNC else ''}; it scales "
          "`truncation` in tis_pg/cispo and `behavior_trunc` in ppo_clip/decoupled_ppo.")

  @property
  def eps_high(self) -> float:
    """Upper PPO clip epsilon: clip_eps_high, or clip_eps when that is None."""
    return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


_USES_BEHAVIOR_TRUNC = ("ppo_clip", "decoupled_ppo")


def aggregate_loss(loss_BT: jax.Array, valid_BT: jax.Array, cfg: ObjectiveConfig,
                   segment_ids_BT: jax.Array | None = None) -> jax.Array:
  """Reduces per-token losses to a scalar with `cfg.aggregation` (loss 0.0 if nothing is valid).

  * token_mean: sum_valid l / N_valid (DAPO, Yu et al. 2025 eq. 8 token-level average).
  * sequence_mean: (1/S) sum_s (1/|s|) sum_{t in s} l_t over the S samples that have a valid
    token; a sample is a (row, segment id) pair, so packed rows hold several samples
    (GRPO, Shao et al. 2024 eq. 3).
  * constant: sum_valid l / cfg.constant_normalizer (Dr. GRPO, Liu et al. 2025 Sec. 3.2).

  Args:
    loss_BT: float[B, T] per-token loss; any value at invalid positions is ignored.
    valid_BT: bool[B, T] tokens that count (numerator and normalizer).
    cfg: ObjectiveConfig (reads aggregation and constant_normalizer).
    segment_ids_BT: int[B, T] sample id within each row, values in [0, T]; required for
      "sequence_mean" (pass ones for unpacked rows).

  Returns:
    scalar loss in loss_BT's dtype.

  Raises:
    ValueError: on shape mismatch, or sequence_mean without segment ids.
    TypeError: if segment ids are not integer.
  """
  shape = offpolicy.check_token_shapes(loss_BT=loss_BT, valid_BT=valid_BT)
  loss_BT = jnp.where(valid_BT, loss_BT, 0.0)
  if cfg.aggregation == "constant":
    return jnp.sum(loss_BT) / jnp.asarray(cfg.constant_normalizer, loss_BT.dtype)
  if cfg.aggregation == "token_mean":
    count = jnp.sum(valid_BT)
    return jnp.sum(loss_BT) / jnp.maximum(count, 1).astype(loss_BT.dtype)
  if segment_ids_BT is None:
    raise ValueError("aggregation='sequence_mean' needs segment_ids_BT (sample id per token; "
                     "use ones for rows that hold a single sample).")
  if jnp.shape(segment_ids_BT) != shape:
    raise ValueError(f"segment_ids_BT shape {jnp.shape(segment_ids_BT)} != token shape {shape}.")
  if not jnp.issubdtype(segment_ids_BT.dtype, jnp.integer):
    raise TypeError(f"segment_ids_BT must be integer; got dtype {segment_ids_BT.dtype}.")
  b, t = shape
  # One id per (row, segment) pair; static number of ids keeps this jit-friendly and O(B*T).
  sample_BT = jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1) + jnp.clip(
      segment_ids_BT.astype(jnp.int32), 0, t)
  sums = jax.ops.segment_sum(loss_BT.reshape(-1), sample_BT.reshape(-1), num_segments=b * (t + 1))
  counts = jax.ops.segment_sum(valid_BT.astype(loss_BT.dtype).reshape(-1), sample_BT.reshape(-1),
                               num_segments=b * (t + 1))
  present = counts > 0
  per_sample = jnp.where(present, sums / jnp.where(present, counts, 1.0), 0.0)
  return jnp.sum(per_sample) / jnp.maximum(jnp.sum(present), 1).astype(loss_BT.dtype)


class _Prepared(NamedTuple):
  """Sanitized inputs shared by all objectives (zeros at invalid positions)."""
  logp_BT: jax.Array
  behavior_logp_BT: jax.Array
  adv_BT: jax.Array
  prox_logp_BT: jax.Array | None
  valid_BT: jax.Array
  log_ratio_BT: jax.Array  # clamped log(pi / mu)
  scale_BT: jax.Array  # lag-dependent truncation multiplier s(lag)


def _prepare(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg,
             prox_logp_BT) -> _Prepared:
  """Checks rank/shape/dtype, applies the lag rule and sanitizes invalid positions."""
  if not isinstance(cfg, ObjectiveConfig):
    raise TypeError(f"cfg must be an ObjectiveConfig; got {type(cfg).__name__}.")
  arrays = dict(logp_BT=logp_BT, behavior_logp_BT=behavior_logp_BT,
                advantages_BT=advantages_BT, mask_BT=mask_BT, lag_BT=lag_BT)
  if prox_logp_BT is not None:
    arrays["prox_logp_BT"] = prox_logp_BT
  offpolicy.check_token_shapes(**arrays)
  for name, x in arrays.items():
    if name != "lag_BT" and not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating array; got dtype {x.dtype}.")
  dtype = jnp.promote_types(logp_BT.dtype, jnp.float32)
  valid = offpolicy.lag_keep_mask(mask_BT, lag_BT, cfg.max_lag)

  def clean(x):
    return jnp.where(valid, x.astype(dtype), jnp.zeros((), dtype))

  logp, mu = clean(logp_BT), clean(behavior_logp_BT)
  return _Prepared(
      logp_BT=logp,
      behavior_logp_BT=mu,
      adv_BT=jax.lax.stop_gradient(clean(advantages_BT)),
      prox_logp_BT=None if prox_logp_BT is None else clean(prox_logp_BT),
      valid_BT=valid,
      log_ratio_BT=offpolicy.clamped_log_ratio(logp, mu, cfg.log_ratio_clamp),
      scale_BT=offpolicy.lag_truncation_scale(lag_BT, cfg.lag_truncation, dtype),
  )


def _finish(objective_BT, p: _Prepared, mask_BT, lag_BT, cfg, *, truncated_BT, used_BT=None,
            segment_ids_BT=None, entropy_BT=None):
  """Per-token objective (to maximize) -> (aggregated loss, diagnostics)."""
  used = p.valid_BT if used_BT is None else p.valid_BT & used_BT
  loss_BT = jnp.where(used, -objective_BT, 0.0)
  loss = aggregate_loss(loss_BT, p.valid_BT, cfg, segment_ids_BT)
  diag = offpolicy.compute_diagnostics(
      log_ratio_BT=p.log_ratio_BT, logp_BT=p.logp_BT, behavior_logp_BT=p.behavior_logp_BT,
      mask_BT=mask_BT, lag_BT=lag_BT, valid_BT=p.valid_BT, used_BT=used,
      truncated_BT=truncated_BT & used, hist_bins=cfg.hist_bins, entropy_BT=entropy_BT)
  return loss, diag


_ARGS_DOC = """
  Args:
    logp_BT: float[B, T] log pi_theta(a_t|s_t) of the current policy (nats; differentiable).
    behavior_logp_BT: float[B, T] log mu(a_t|s_t) recorded by the sampler (nats).
    advantages_BT: float[B, T] per-token advantage (held constant).
    mask_BT: float[B, T] loss mask in {0, 1} (completion tokens).
    lag_BT: int[B, T] learner version minus the token's policy version (>= 0).
    cfg: ObjectiveConfig.
    prox_logp_BT: optional float[B, T] log pi_prox (weights before this optimizer step); read
      only by decoupled_ppo.
    segment_ids_BT: optional int[B, T] sample id per token; required for sequence_mean.
    entropy_BT: optional float[B, T] per-token policy entropy (nats), for diagnostics only.

  Returns:
    (loss, ObjectiveDiagnostics): scalar loss to minimize, diagnostics (see offpolicy).

  Raises:
    ValueError: on rank/shape mismatch or sequence_mean without segment ids.
    TypeError: on non-floating inputs, non-integer lag, or a cfg of the wrong type.
"""


def _with_args_doc(fn):
  """Appends the Args/Returns/Raises section shared by every objective to fn's docstring."""
  fn.__doc__ = fn.__doc__.rstrip() + "\n" + _ARGS_DOC
  return fn


@_with_args_doc
def tis_pg(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, *,
           prox_logp_BT=None, segment_ids_BT=None, entropy_BT=None):
  """Truncated importance-weighted policy gradient (PipelineRL default).

  loss = -agg_t( sg(min(r_t, c(lag_t))) * A_t * log pi_theta(a_t|s_t) ),  r_t = pi_theta / mu,
  with c(lag) = cfg.truncation * s(lag). This is the policy-gradient term of IMPALA with the
  truncated weight rho_t = min(rho_bar, r_t) (Espeholt et al. 2018 eq. 1 and Sec. 4.2) and the
  TIS correction of Yao et al. 2025; PipelineRL (Piche et al. 2025 Sec. 5) clamps at 5.
  frac_truncated counts tokens with r_t > c(lag_t).
  """
  del prox_logp_BT
  p = _prepare(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, None)
  ratio = jnp.exp(p.log_ratio_BT)
  level = cfg.truncation * p.scale_BT
  weight = jax.lax.stop_gradient(jnp.minimum(ratio, level))
  return _finish(weight * p.adv_BT * p.logp_BT, p, mask_BT, lag_BT, cfg,
                 truncated_BT=ratio > level, segment_ids_BT=segment_ids_BT,
                 entropy_BT=entropy_BT)


@_with_args_doc
def cispo(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, *,
          prox_logp_BT=None, segment_ids_BT=None, entropy_BT=None):
  """Clipped IS-weight policy optimization, CISPO (MiniMax-M1, 2025 eq. 4).

  loss = -agg_t( sg(min(r_t, eps_max)) * A_t * log pi_theta(a_t|s_t) ),  r_t = pi_theta / mu,
  eps_max = cfg.truncation * s(lag), no lower bound (MiniMax-M1 leaves eps_low unset; ScaleRL,
  Khatri et al. 2025 Sec. 3.2, writes it sg(min(rho, eps_max)) and uses eps_max in 4-8).
  Unlike PPO, tokens beyond the trust region still receive gradient, with a capped weight.
  With the same truncation the estimator equals `tis_pg`; it is registered separately so
  ablation tables name the recipe (set truncation to ScaleRL's 4-8 for CISPO).
  frac_truncated counts tokens with r_t > eps_max.
  """
  del prox_logp_BT
  p = _prepare(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, None)
  ratio = jnp.exp(p.log_ratio_BT)
  eps_max = cfg.truncation * p.scale_BT
  weight = jax.lax.stop_gradient(jnp.minimum(ratio, eps_max))
  return _finish(weight * p.adv_BT * p.logp_BT, p, mask_BT, lag_BT, cfg,
                 truncated_BT=ratio > eps_max, segment_ids_BT=segment_ids_BT,
                 entropy_BT=entropy_BT)


@_with_args_doc
def ppo_clip(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, *,
             prox_logp_BT=None, segment_ids_BT=None, entropy_BT=None):
  """PPO clipped surrogate with the behavior policy as the old policy.

  loss = -agg_t( min(r_t A_t, clip(r_t, 1 - eps, 1 + eps_high) A_t) ),  r_t = pi_theta / mu
  (Schulman et al. 2017 eq. 7; asymmetric clip-higher of DAPO, Yu et al. 2025). This is the
  "naive PPO" of AReaL (Fu et al. 2025 eq. 4) when tokens are stale.
  With cfg.behavior_trunc = c_b, for A_t < 0 the surrogate becomes
  max(min(...), c A_t) with c = max(c_b * s(lag), 1 + eps_high): dual-clip PPO (Ye et al. 2020
  eq. 5), which truncates the otherwise unbounded ratio of negative-advantage tokens at c.
  frac_truncated counts tokens whose clip (or dual clip) changes the surrogate's value.
  """
  del prox_logp_BT
  p = _prepare(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, None)
  ratio = jnp.exp(p.log_ratio_BT)
  adv = p.adv_BT
  low, high = 1.0 - cfg.clip_eps, 1.0 + cfg.eps_high
  surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, low, high) * adv)
  clipped = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
  if cfg.behavior_trunc is not None:
    level = jnp.maximum(cfg.behavior_trunc * p.scale_BT, high)
    dual = (adv < 0) & (ratio > level)
    surrogate = jnp.where(adv < 0, jnp.maximum(surrogate, level * adv), surrogate)
    clipped = clipped | dual
  return _finish(surrogate, p, mask_BT, lag_BT, cfg, truncated_BT=clipped,
                 segment_ids_BT=segment_ids_BT, entropy_BT=entropy_BT)


@_with_args_doc
def decoupled_ppo(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, *,
                  prox_logp_BT=None, segment_ids_BT=None, entropy_BT=None):
  """Decoupled PPO with a proximal policy (AReaL, Fu et al. 2025 eq. 5).

  loss = -agg_t( sg(w_t) * min(u_t A_t, clip(u_t, 1 - eps, 1 + eps_high) A_t) ),
  u_t = pi_theta / pi_prox,  w_t = pi_prox / mu, or min(w_t, behavior_trunc * s(lag)) when
  cfg.behavior_trunc is set (TIS applied to PPO's old/behavior ratio, Yao et al. 2025).
  pi_prox is the policy before this optimizer step; with prox_logp_BT=None it is
  stop_gradient(logp_BT), so u_t = 1 and the gradient is sg(w_t) A_t grad log pi_theta.
  Both ratios are clamped in log space. frac_truncated counts tokens where w_t was truncated
  or the clip of u_t changes the surrogate.
  """
  p = _prepare(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, prox_logp_BT)
  prox = jax.lax.stop_gradient(p.logp_BT if p.prox_logp_BT is None else p.prox_logp_BT)
  behavior_weight = jnp.exp(offpolicy.clamped_log_ratio(prox, p.behavior_logp_BT,
                                                        cfg.log_ratio_clamp))
  truncated = jnp.zeros(behavior_weight.shape, bool)
  if cfg.behavior_trunc is not None:
    level = cfg.behavior_trunc * p.scale_BT
    truncated = behavior_weight > level
    behavior_weight = jnp.minimum(behavior_weight, level)
  u = jnp.exp(offpolicy.clamped_log_ratio(p.logp_BT, prox, cfg.log_ratio_clamp))
  adv = p.adv_BT
  low, high = 1.0 - cfg.clip_eps, 1.0 + cfg.eps_high
  surrogate = jnp.minimum(u * adv, jnp.clip(u, low, high) * adv)
  clipped = ((adv > 0) & (u > high)) | ((adv < 0) & (u < low))
  return _finish(jax.lax.stop_gradient(behavior_weight) * surrogate, p, mask_BT, lag_BT, cfg,
                 truncated_BT=truncated | clipped, segment_ids_BT=segment_ids_BT,
                 entropy_BT=entropy_BT)


@_with_args_doc
def is_mask(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, *,
            prox_logp_BT=None, segment_ids_BT=None, entropy_BT=None):
  """Importance-ratio masking (IcePop, Ant Ling 2025; token-level MIS, Liu et al. 2025).

  loss = -agg_t( 1[a <= r_t <= b] * sg(r_t) * A_t * log pi_theta(a_t|s_t) ),  r_t = pi_theta/mu,
  [a, b] = [cfg.is_mask_low, cfg.is_mask_high]. Kept tokens carry the importance weight r_t
  itself (bounded by b, so the estimator is unbiased on the kept set with bounded variance);
  rejected tokens give exact zeros but stay in the normalizer (IcePop's objective divides by
  the full token count), and are counted in frac_masked. frac_truncated is always 0.
  """
  del prox_logp_BT
  p = _prepare(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, None)
  ratio = jnp.exp(p.log_ratio_BT)
  inside = (ratio >= cfg.is_mask_low) & (ratio <= cfg.is_mask_high)
  weight = jax.lax.stop_gradient(ratio)
  return _finish(weight * p.adv_BT * p.logp_BT, p, mask_BT, lag_BT, cfg,
                 truncated_BT=jnp.zeros(ratio.shape, bool), used_BT=inside,
                 segment_ids_BT=segment_ids_BT, entropy_BT=entropy_BT)


@_with_args_doc
def no_correction(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, *,
                  prox_logp_BT=None, segment_ids_BT=None, entropy_BT=None):
  """REINFORCE that treats stale tokens as on-policy (no IS correction).

  loss = -agg_t( A_t * log pi_theta(a_t|s_t) ) (Williams 1992 eq. 11 with a baseline folded
  into A_t). The baseline of the staleness ablations; mu only enters the diagnostics.
  """
  del prox_logp_BT
  p = _prepare(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, None)
  return _finish(p.adv_BT * p.logp_BT, p, mask_BT, lag_BT, cfg,
                 truncated_BT=jnp.zeros(p.logp_BT.shape, bool), segment_ids_BT=segment_ids_BT,
                 entropy_BT=entropy_BT)


@_with_args_doc
def untruncated_is(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, *,
                   prox_logp_BT=None, segment_ids_BT=None, entropy_BT=None):
  """Per-token importance-weighted policy gradient without truncation.

  loss = -agg_t( sg(r_t) * A_t * log pi_theta(a_t|s_t) ),  r_t = pi_theta / mu (the unbiased
  per-decision IS estimator, Precup et al. 2000; "vanilla-IS" of Yao et al. 2025, their
  high-variance baseline). The only bound is log_ratio_clamp (r_t <= e^clamp).
  """
  del prox_logp_BT
  p = _prepare(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg, None)
  weight = jax.lax.stop_gradient(jnp.exp(p.log_ratio_BT))
  return _finish(weight * p.adv_BT * p.logp_BT, p, mask_BT, lag_BT, cfg,
                 truncated_BT=jnp.zeros(weight.shape, bool), segment_ids_BT=segment_ids_BT,
                 entropy_BT=entropy_BT)


Objective = Callable[..., tuple[jax.Array, ObjectiveDiagnostics]]

OBJECTIVES: dict[str, Objective] = {
    "tis_pg": tis_pg,
    "ppo_clip": ppo_clip,
    "cispo": cispo,
    "decoupled_ppo": decoupled_ppo,
    "is_mask": is_mask,
    "no_correction": no_correction,
    "untruncated_is": untruncated_is,
}


def get_objective(name: str) -> Objective:
  """Looks up an objective by its registry name.

  Args:
    name: a key of OBJECTIVES, e.g. "tis_pg".

  Returns:
    The objective function (see the module docstring for its signature).

  Raises:
    ValueError: if the name is unknown; the message lists the valid names.
  """
  try:
    return OBJECTIVES[name]
  except KeyError:
    raise ValueError(f"Unknown objective {name!r}; choose one of {tuple(OBJECTIVES)}.") from None
