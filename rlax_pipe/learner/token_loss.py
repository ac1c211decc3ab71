"""From per-token objectives to a batch loss: masking, aggregation and diagnostics, done once
(by the learner's train step, per micro-batch).

An objective (`rlax_pipe.objectives`) maps finite per-token inputs to a per-token loss. This
module holds everything around it, the same for every objective:

  1. `select_valid`: a token counts only if mask > 0 and lag <= max_lag ("valid"); every other
     position is replaced by zeros with `jnp.where` *before* any arithmetic, so masked values
     (-inf, NaN, 1e30) give exact zeros in loss and gradient (never 0 * NaN);
  2. `loss_sums` / `aggregate`: the batch loss is numerator / normaliser, where the numerator is
     a sum over tokens and the normaliser a count over the *whole batch* (`normalizer`). Both are
     sums over samples, and a sample never straddles two micro-batches, so summing numerators
     and counts over micro-batches and dividing once gives exactly the whole-batch loss, for any
     micro-batching;
  3. `diagnostic_sums`: the additive statistics of `offpolicy.ObjectiveDiagnostics`.

`objective_loss` composes the three for one whole batch (the reference the learner's
micro-batched train step is tested against).

Letters: B batch rows, T tokens per row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlax_pipe import kl_penalty
from rlax_pipe import objectives
from rlax_pipe import offpolicy
from rlax_pipe.objectives import ObjectiveConfig


class Selected(NamedTuple):
  """Objective inputs with invalid positions replaced by zeros (all [B, T], float32 or wider).

  Attributes:
    logp_BT: log pi_theta (differentiable at valid positions).
    behavior_logp_BT: log mu.
    advantages_BT: advantages (gradient stopped).
    prox_logp_BT: log pi_prox, or None when not given.
    valid_BT: bool, loss-mask tokens within max_lag.
  """

  logp_BT: jax.Array
  behavior_logp_BT: jax.Array
  advantages_BT: jax.Array
  prox_logp_BT: jax.Array | None
  valid_BT: jax.Array


def select_valid(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT,
                 cfg: ObjectiveConfig, prox_logp_BT=None) -> Selected:
  """Applies the lag rule and selects invalid positions out (zeros, via `jnp.where`).

  Args:
    logp_BT: float[B, T] log pi_theta (nats).
    behavior_logp_BT: float[B, T] log mu (nats).
    advantages_BT: float[B, T] advantages.
    mask_BT: float[B, T] loss mask (completion tokens).
    lag_BT: int[B, T] learner version minus token version.
    cfg: ObjectiveConfig (reads max_lag).
    prox_logp_BT: optional float[B, T] log pi_prox.

  Returns:
    Selected.

  Raises:
    ValueError: on rank or shape mismatch.
    TypeError: on non-floating inputs, a non-integer lag, or a cfg of the wrong type.
  """
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

  return Selected(
      logp_BT=clean(logp_BT), behavior_logp_BT=clean(behavior_logp_BT),
      advantages_BT=jax.lax.stop_gradient(clean(advantages_BT)),
      prox_logp_BT=None if prox_logp_BT is None else clean(prox_logp_BT), valid_BT=valid)


class Counts(NamedTuple):
  """Normaliser counts of a batch (float32 scalars; they add up over micro-batches).

  Attributes:
    tokens: valid tokens.
    samples: samples (row, segment id) with at least one valid token.
    completions: samples with at least one loss-mask token (whatever their lag).
  """

  tokens: jax.Array
  samples: jax.Array
  completions: jax.Array


def _segment_ids(segment_ids_BT, shape, cfg):
  if segment_ids_BT is None:
    if cfg.aggregation != "token_mean":
      raise ValueError(f"aggregation={cfg.aggregation!r} needs segment_ids_BT (sample id per "
                       "token; use ones for rows that hold a single sample).")
    return None
  if jnp.shape(segment_ids_BT) != shape:
    raise ValueError(f"segment_ids_BT shape {jnp.shape(segment_ids_BT)} != token shape {shape}.")
  if not jnp.issubdtype(segment_ids_BT.dtype, jnp.integer):
    raise TypeError(f"segment_ids_BT must be integer; got dtype {segment_ids_BT.dtype}.")
  return segment_ids_BT


def loss_sums(loss_BT: jax.Array, valid_BT: jax.Array, mask_BT: jax.Array,
              segment_ids_BT: jax.Array | None, cfg: ObjectiveConfig):
  """Numerator and normaliser counts of the aggregated loss over one (micro-)batch.

  numerator = sum_t w_t l_t over valid tokens, with w_t = 1 (token_mean, constant) or
  w_t = 1 / |s(t)| (sequence_mean; |s| = valid tokens of t's sample, which lies in one row, so
  w_t is local to any micro-batch). See `normalizer` for the denominators.

  Args:
    loss_BT: float[B, T] per-token loss; values at invalid positions are ignored.
    valid_BT: bool[B, T] tokens that count.
    mask_BT: float[B, T] loss mask (for the completion count of "constant").
    segment_ids_BT: int[B, T] sample id within each row (values in [0, T]); required for
      sequence_mean and constant (pass ones for unpacked rows).
    cfg: ObjectiveConfig (aggregation).

  Returns:
    (numerator scalar in loss_BT's dtype promoted to >= float32, Counts of the same dtype).

  Raises:
    ValueError: on shape mismatch, or sequence_mean / constant without segment ids.
    TypeError: if segment ids are not integer.
  """
  shape = offpolicy.check_token_shapes(loss_BT=loss_BT, valid_BT=valid_BT, mask_BT=mask_BT)
  seg = _segment_ids(segment_ids_BT, shape, cfg)
  f32 = jnp.promote_types(loss_BT.dtype, jnp.float32)  # float64 under jax_enable_x64
  loss_BT = jnp.where(valid_BT, loss_BT.astype(f32), jnp.zeros((), f32))
  tokens = jnp.sum(valid_BT, dtype=f32)
  if seg is None:
    return jnp.sum(loss_BT), Counts(tokens, jnp.zeros((), f32), jnp.zeros((), f32))
  counts_BS = offpolicy.per_sample(
      jnp.stack([valid_BT, mask_BT > 0], axis=-1).astype(f32), seg)  # [B, T + 1, 2]
  valid_count = counts_BS[..., 0]
  counts = Counts(tokens, jnp.sum(valid_count > 0, dtype=f32),
                  jnp.sum(counts_BS[..., 1] > 0, dtype=f32))
  if cfg.aggregation == "sequence_mean":
    size = offpolicy.per_token(valid_count, seg, shape[1])
    loss_BT = jnp.where(valid_BT, loss_BT / jnp.maximum(size, 1.0), jnp.zeros((), f32))
  return jnp.sum(loss_BT), counts


def normalizer(counts: Counts, cfg: ObjectiveConfig) -> jax.Array:
  """The batch loss's denominator (float32 scalar), as in each aggregation's source.

  * token_mean: N = valid tokens (DAPO, Yu et al. 2025 eq. 8: sum over all tokens of the batch
    divided by their number).
  * sequence_mean: S = samples with a valid token; the numerator already divides each sample's
    sum by its length (GRPO, Shao et al. 2024 eq. 3: (1/G) sum_i (1/|o_i|) sum_t).
  * constant: G * L_max = completions x cfg.max_completion_len (Dr. GRPO, Liu et al. 2025
    Sec. 3.2 and their `masked_mean(..., constant_normalizer=generate_max_length)` averaged over
    the G samples): a per-sample constant, so the loss neither depends on completion lengths
    nor grows with the number of samples in a batch.
  The counts are those of the whole batch (summed over micro-batches), so the normaliser does
  not depend on micro-batching.
  """
  if cfg.aggregation == "token_mean":
    return counts.tokens
  if cfg.aggregation == "sequence_mean":
    return counts.samples
  return counts.completions * cfg.max_completion_len


def aggregate(numerator: jax.Array, counts: Counts, cfg: ObjectiveConfig) -> jax.Array:
  """numerator / normalizer(counts); 0.0 when the batch has nothing to normalise by."""
  denom = normalizer(counts, cfg)
  return jnp.where(denom > 0, numerator / jnp.where(denom > 0, denom, 1.0), 0.0)


def aggregate_loss(loss_BT: jax.Array, valid_BT: jax.Array, cfg: ObjectiveConfig,
                   segment_ids_BT: jax.Array | None = None, *,
                   mask_BT: jax.Array | None = None) -> jax.Array:
  """Reduces per-token losses of one whole batch with `cfg.aggregation` (0.0 if nothing valid).

  Args:
    loss_BT: float[B, T] per-token loss; any value at invalid positions is ignored.
    valid_BT: bool[B, T] tokens that count.
    cfg: ObjectiveConfig (aggregation, max_completion_len).
    segment_ids_BT: int[B, T] sample ids; required for sequence_mean and constant.
    mask_BT: float[B, T] loss mask for the completion count of "constant" (default: valid_BT).

  Returns:
    float32 scalar. Raises as `loss_sums`.
  """
  mask_BT = valid_BT.astype(jnp.float32) if mask_BT is None else mask_BT
  return aggregate(*loss_sums(loss_BT, valid_BT, mask_BT, segment_ids_BT, cfg), cfg)


def per_token_loss(sel: Selected, lag_BT: jax.Array, cfg: ObjectiveConfig,
                   segment_ids_BT: jax.Array | None = None
                   ) -> tuple[jax.Array, objectives.TokenLoss]:
  """Runs `cfg.name`'s objective on selected inputs; returns (used_BT, TokenLoss with the loss
  already zero wherever a token is not used). A sequence-level objective
  (`objectives.SEQUENCE_OBJECTIVES`) also gets the sample ids (None = one sample per row) and
  the valid tokens."""
  extra = {}
  if cfg.name in objectives.SEQUENCE_OBJECTIVES:
    extra = dict(segment_ids_BT=segment_ids_BT, valid_BT=sel.valid_BT)
  out = objectives.get_objective(cfg.name)(
      sel.logp_BT, sel.behavior_logp_BT, sel.advantages_BT, lag_BT, cfg,
      prox_logp_BT=sel.prox_logp_BT, **extra)
  used = sel.valid_BT if out.kept_BT is None else sel.valid_BT & out.kept_BT
  return used, out._replace(loss_BT=jnp.where(used, out.loss_BT, 0.0))


def with_kl(sel: Selected, out: objectives.TokenLoss | None, ref_logp_BT: jax.Array | None,
            segment_ids_BT: jax.Array | None, cfg: ObjectiveConfig):
  """The KL regularisation of `cfg.kl` (`rlax_pipe.kl_penalty`), in two calls around the
  objective: before it (out=None) the "reward" penalty-to-go is subtracted from the selected
  advantages; after it (out given) the "loss" term is added to the per-token loss at every
  valid token (aggregated with the objective's own loss by `loss_sums`).

  Args:
    sel: the selected inputs (`select_valid`).
    out: None before the objective, its TokenLoss after it.
    ref_logp_BT: float[B, T] log pi_ref on the same tokens (nats), or None when cfg.kl="off".
    segment_ids_BT: int[B, T] sample ids, or None for one sample per row.
    cfg: ObjectiveConfig (kl, kl_estimator, kl_coef, kl_is_weight, log_ratio_clamp).

  Returns:
    (sel or out, updated; kl_BT float[B, T]: the per-token estimate k (gradient stopped, zero at
    invalid tokens) of the mode that acted in this call, or None when it acted not).

  Raises:
    ValueError: if ref_logp_BT is None while cfg.kl != "off", or given while it is "off".
  """
  if (ref_logp_BT is None) != (cfg.kl == "off"):
    given = "None" if ref_logp_BT is None else "an array"
    raise ValueError(f"ObjectiveConfig.kl={cfg.kl!r} needs reference log-probs exactly when it "
                     f"is not 'off'; got ref_logp_BT={given}.")
  phase = "reward" if out is None else "loss"
  if cfg.kl != phase:
    return (sel if out is None else out), None
  dtype = sel.logp_BT.dtype
  ref = jnp.where(sel.valid_BT, ref_logp_BT.astype(dtype), jnp.zeros((), dtype))
  if out is None:
    adv, kl_BT = kl_penalty.reward_penalty(
        sel.advantages_BT, ref, sel.behavior_logp_BT, sel.valid_BT, segment_ids_BT,
        estimator=cfg.kl_estimator, coef=cfg.kl_coef, log_ratio_clamp=cfg.log_ratio_clamp)
    return sel._replace(advantages_BT=jnp.where(sel.valid_BT, adv, jnp.zeros((), dtype))), kl_BT
  term, kl_BT = kl_penalty.loss_penalty(
      sel.logp_BT, ref, sel.behavior_logp_BT, estimator=cfg.kl_estimator, coef=cfg.kl_coef,
      is_weight=cfg.kl_is_weight, log_ratio_clamp=cfg.log_ratio_clamp)
  zero = jnp.zeros((), dtype)
  return (out._replace(loss_BT=out.loss_BT + jnp.where(sel.valid_BT, term, zero)),
          jnp.where(sel.valid_BT, kl_BT, zero))


def diagnostic_sums(sel: Selected, out: objectives.TokenLoss, used_BT: jax.Array,
                    mask_BT: jax.Array, lag_BT: jax.Array, segment_ids_BT: jax.Array | None,
                    cfg: ObjectiveConfig,
                    entropy_BT: jax.Array | None = None) -> offpolicy.DiagnosticSums:
  """The diagnostics' additive statistics from values the loss computation already has.

  The behaviour ratio is pi_theta / mu; the engine mismatch |log pi_prox - log mu| is taken on
  equal-weight tokens only (`offpolicy.equal_weight_mask`), with pi_prox = pi_theta when no
  proximal log-probs were given (the policy before this batch's first update either way).
  """
  prox = sel.logp_BT if sel.prox_logp_BT is None else sel.prox_logp_BT
  return offpolicy.diagnostic_sums(
      log_ratio_BT=offpolicy.clamped_log_ratio(sel.logp_BT, sel.behavior_logp_BT,
                                               cfg.log_ratio_clamp),
      mismatch_BT=jnp.abs(prox - sel.behavior_logp_BT), mask_BT=mask_BT, lag_BT=lag_BT,
      valid_BT=sel.valid_BT, used_BT=used_BT, truncated_BT=out.truncated_BT & used_BT,
      equal_weight_BT=offpolicy.equal_weight_mask(sel.valid_BT, mask_BT, lag_BT, segment_ids_BT),
      hist_bins=cfg.hist_bins, entropy_BT=entropy_BT)


def objective_loss(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT,
                   cfg: ObjectiveConfig, *, prox_logp_BT=None, segment_ids_BT=None,
                   entropy_BT=None,
                   ref_logp_BT=None) -> tuple[jax.Array, offpolicy.ObjectiveDiagnostics]:
  """Loss and diagnostics of `cfg.name`'s objective over one whole batch.

  Args:
    logp_BT: float[B, T] log pi_theta(a_t|s_t) of the current policy (nats; differentiable).
    behavior_logp_BT: float[B, T] log mu(a_t|s_t) recorded by the sampler (nats).
    advantages_BT: float[B, T] per-token advantage (held constant).
    mask_BT: float[B, T] loss mask in {0, 1} (completion tokens).
    lag_BT: int[B, T] learner version minus the token's policy version (>= 0).
    cfg: ObjectiveConfig.
    prox_logp_BT: optional float[B, T] log pi_prox (policy before this batch's first update).
    segment_ids_BT: optional int[B, T] sample id per token; required for sequence_mean and
      constant, and used to find equal-weight samples (None = one sample per row).
    entropy_BT: optional float[B, T] per-token policy entropy (nats), for diagnostics only.
    ref_logp_BT: float[B, T] log pi_ref (nats) when cfg.kl != "off" (`with_kl`), else None.

  Returns:
    (loss, ObjectiveDiagnostics): scalar loss to minimize, diagnostics (see offpolicy).

  Raises:
    ValueError: on rank/shape mismatch or sequence_mean / constant without segment ids.
    TypeError: on non-floating inputs, non-integer lag, or a cfg of the wrong type.
  """
  sel = select_valid(logp_BT, behavior_logp_BT, advantages_BT, mask_BT, lag_BT, cfg,
                     prox_logp_BT)
  sel, _ = with_kl(sel, None, ref_logp_BT, segment_ids_BT, cfg)
  used, out = per_token_loss(sel, lag_BT, cfg, segment_ids_BT)
  out, _ = with_kl(sel, out, ref_logp_BT, segment_ids_BT, cfg)
  numerator, counts = loss_sums(out.loss_BT, sel.valid_BT, mask_BT, segment_ids_BT, cfg)
  sums = diagnostic_sums(sel, out, used, mask_BT, lag_BT, segment_ids_BT, cfg, entropy_BT)
  return aggregate(numerator, counts, cfg), offpolicy.finalize_diagnostics(sums)
