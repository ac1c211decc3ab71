"""Policy-gradient objectives as per-token losses, with importance correction and lag rules.

Every objective is a pure function with one signature (rlax style),

  fn(logp_BT, behavior_logp_BT, advantages_BT, lag_BT, cfg, *, prox_logp_BT=None) -> TokenLoss

and is registered by name in `OBJECTIVES` (the single list of valid names). It returns the
per-token loss to minimize (its gradient w.r.t. `logp_BT` is the variant's policy-gradient
estimate per token) and which tokens it truncated or rejected. It does not mask, aggregate or
compute diagnostics: `rlax_pipe.learner.token_loss` does that once, for any objective, from
values the caller already has (the learner's train step does it per micro-batch;
`token_loss.objective_loss` is the whole-batch composition).

Inputs must be finite at every position: `token_loss.select_valid` selects masked and too-stale
positions out with `jnp.where` (never `0 * x`) before any objective sees them. Shared rules:
  * ratios are formed in log space and clipped to [-log_ratio_clamp, log_ratio_clamp] before exp;
  * truncation levels are multiplied by s(lag) from `offpolicy.lag_truncation_scale`.

Example:
  >>> cfg = ObjectiveConfig(name="tis_pg", truncation=2.0, max_lag=8)
  >>> loss, diag = token_loss.objective_loss(logp, mu_logp, adv, mask, lag, cfg)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from rlax_pipe import kl_penalty
from rlax_pipe import offpolicy
from rlax_pipe.router_replay import ROUTER_REPLAY_MODES

AGGREGATIONS: tuple[str, ...] = ("token_mean", "sequence_mean", "constant")
IS_MASK_RATIOS: tuple[str, ...] = ("behavior", "proximal")
# Largest admissible log_ratio_clamp: exp(80) ~ 5.5e34 is still finite in float32.
_MAX_LOG_RATIO_CLAMP = 80.0


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """Configuration of the learner objective (static: hashable, safe as a jit static argument).

  Fields that a variant would silently ignore raise instead (e.g. `lag_truncation` with
  `no_correction`), so an ablation never runs a knob that does nothing.

  Attributes:
    name: objective, a key of `OBJECTIVES`: the per-token tis_pg, ppo_clip, cispo,
      decoupled_ppo, is_mask, no_correction, untruncated_is, or the sequence-level gspo (GSPO,
      Zheng et al. 2025: clipped length-normalised sequence ratio; the paper's settings are
      clip_eps=3e-4, clip_eps_high=4e-4, aggregation="sequence_mean").
    truncation: c > 0, upper bound of the held-constant importance weight min(r, c) in `tis_pg`
      and `cispo` (epsilon_max there). Default 2.0, the TIS / verl rollout-correction default
      (Yao et al. 2025); PipelineRL trains with 5, ScaleRL's CISPO with 4-8.
    clip_eps: PPO clip epsilon in (0, 1); lower clip 1 - clip_eps (Schulman et al. 2017 eq. 7).
    clip_eps_high: upper clip epsilon > 0 (DAPO clip-higher, e.g. 0.28), None = clip_eps.
    is_mask_low: a >= 0, `is_mask` drops tokens with r < a (IcePop band; default 0.5).
    is_mask_high: b >= 1 (and b > a), `is_mask` drops tokens with r > b (default 5.0).
    is_mask_ratio: which ratio `is_mask`'s band [a, b] applies to: "behavior" (r = pi_theta /
      mu, the behaviour ratio: staleness, in-batch updates and engine mismatch together; the
      token-level MIS of Liu et al. 2025) or "proximal" (pi_prox / mu, pi_prox = the learner's
      policy before this batch's first update: on tokens of samples generated entirely by the
      current version this is exactly the engine mismatch at equal weights that IcePop's band
      targets, Ant Ling 2025; on stale tokens it also carries their staleness).
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
    aggregation: how per-token losses are reduced, one of AGGREGATIONS (normalisers per batch,
      see `token_loss.normalizer`): "token_mean" (sum over valid tokens / their count; DAPO
      token-level, Yu et al. 2025 eq. 8), "sequence_mean" (mean over each sample's valid
      tokens, then over samples; GRPO, Shao et al. 2024 eq. 3), "constant" (sum over valid
      tokens / (samples x max_completion_len); Dr. GRPO, Liu et al. 2025 Sec. 3.2).
    max_completion_len: the Dr. GRPO constant's per-sample length (tokens, >= 1): the
      longest completion the sampler may generate (its max_new_tokens). Required for
      "constant", invalid otherwise.
    log_ratio_clamp: bound in nats on |log ratio| before exp, in (0, 80] (default 20.0).
    hist_bins: number K >= 2 of lag histogram bins; bins 0..K-2 count lags exactly, bin K-1
      counts lag >= K-1 (default 17).
    kl: KL regularisation towards a reference policy, one of `kl_penalty.KL_MODES`: "off"
      (default), "loss" (kl_coef x the per-token estimate added to the loss, GRPO style) or
      "reward" (kl_coef x the per-token estimate of KL(mu || pi_ref) subtracted from the reward,
      summed to go, InstructGPT style); see `rlax_pipe.kl_penalty` for exactly what each
      estimates. The other kl_* fields are only valid when kl != "off".
    kl_estimator: "k1", "k2" or "k3" (Schulman 2020; default "k3", GRPO's).
    kl_coef: coefficient beta >= 0 of the KL term (nats -> loss / reward units; default 0.04,
      DeepSeekMath's GRPO beta, Shao et al. 2024 Sec. 4.2).
    kl_reference: None (default: the learner's initial params, e.g. the SFT warm start) or the
      path of an HF-format model directory (config.json + *.safetensors) of the same
      architecture to use as pi_ref. Held on the learner mesh with the params' shardings, in
      the model's compute dtype.
    kl_is_weight: with kl="loss", multiply each KL term by the held-constant importance weight
      pi_theta / mu, so that k1 / k3 estimate KL(pi_theta || pi_ref) although tokens come from
      mu (DeepSeek-V3.2's correction); default False (GRPO: no weight).
    router_replay: mixture-of-experts models: "off" (default: the learner routes every token
      with its own router) or "replay" (each completion token goes to the experts the sampler
      routed it to, recorded in `Rollout.routes`; the routing weights stay the learner's, so
      the router gets gradients; prompt tokens keep the learner's routing:
      `rlax_pipe.router_replay`). One of `router_replay.ROUTER_REPLAY_MODES`.
  """

  name: str = "tis_pg"
  truncation: float = 2.0
  clip_eps: float = 0.2
  clip_eps_high: float | None = None
  is_mask_low: float = 0.5
  is_mask_high: float = 5.0
  is_mask_ratio: str = "behavior"
  behavior_trunc: float | None = None
  max_lag: int | None = None
  lag_truncation: float | tuple[float, ...] | None = None
  aggregation: str = "token_mean"
  max_completion_len: int | None = None
  log_ratio_clamp: float = 20.0
  hist_bins: int = 17
  kl: str = "off"
  kl_estimator: str = "k3"
  kl_coef: float = 0.04
  kl_reference: str | None = None
  kl_is_weight: bool = False
  router_replay: str = "off"

  def __post_init__(self):
    if self.router_replay not in ROUTER_REPLAY_MODES:
      raise ValueError(f"--config.objective.router_replay={self.router_replay!r}; choose one of "
                       f"{ROUTER_REPLAY_MODES}.")
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
    if self.is_mask_ratio not in IS_MASK_RATIOS:
      raise ValueError(f"ObjectiveConfig.is_mask_ratio={self.is_mask_ratio!r}; choose one of "
                       f"{IS_MASK_RATIOS}.")
    if self.is_mask_ratio != "behavior" and self.name != "is_mask":
      raise ValueError(f"ObjectiveConfig.is_mask_ratio={self.is_mask_ratio!r} has no effect with "
                       f"name={self.name!r}; it is read by is_mask only.")
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
      if (isinstance(self.max_completion_len, bool) or not isinstance(self.max_completion_len, int)
          or self.max_completion_len < 1):
        raise ValueError(
            f"ObjectiveConfig.max_completion_len={self.max_completion_len!r} must be an int >= 1 "
            "(the sampler's max_new_tokens) when aggregation='constant'.")
    elif self.max_completion_len is not None:
      raise ValueError(
          f"ObjectiveConfig.max_completion_len={self.max_completion_len} is only used with "
          f"aggregation='constant' (got aggregation={self.aggregation!r}); set it to None.")
    if not 0 < self.log_ratio_clamp <= _MAX_LOG_RATIO_CLAMP:
      raise ValueError(f"ObjectiveConfig.log_ratio_clamp={self.log_ratio_clamp} must be in "
                       f"(0, {_MAX_LOG_RATIO_CLAMP}].")
    if isinstance(self.hist_bins, bool) or not isinstance(self.hist_bins, int) or (
        self.hist_bins < 2):
      raise ValueError(f"ObjectiveConfig.hist_bins={self.hist_bins!r} must be an int >= 2.")
    self._validate_kl()

  def _validate_kl(self):
    """Checks the kl_* fields; with kl="off" any non-default kl_* field is an error."""
    if self.kl not in kl_penalty.KL_MODES:
      raise ValueError(f"ObjectiveConfig.kl={self.kl!r}; choose one of {kl_penalty.KL_MODES}.")
    if self.kl_estimator not in kl_penalty.KL_ESTIMATORS:
      raise ValueError(f"ObjectiveConfig.kl_estimator={self.kl_estimator!r}; choose one of "
                       f"{kl_penalty.KL_ESTIMATORS}.")
    if not (isinstance(self.kl_coef, (int, float)) and math.isfinite(self.kl_coef)
            and self.kl_coef >= 0):
      raise ValueError(f"ObjectiveConfig.kl_coef={self.kl_coef!r} must be finite and >= 0.")
    if self.kl_reference is not None and not (isinstance(self.kl_reference, str)
                                              and self.kl_reference):
      raise ValueError(f"ObjectiveConfig.kl_reference={self.kl_reference!r} must be None or "
                       "the path of an HF-format model directory.")
    if self.kl == "off":
      defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name.startswith("kl_")}
      changed = [n for n, d in defaults.items() if getattr(self, n) != d]
      if changed:
        raise ValueError(f"ObjectiveConfig.{changed[0]}={getattr(self, changed[0])!r} has no "
                         "effect with kl='off'; set --config.objective.kl=loss or reward.")
    if self.kl_is_weight and self.kl != "loss":
      raise ValueError(f"ObjectiveConfig.kl_is_weight=True is only used with kl='loss' (got "
                       f"kl={self.kl!r}: the reward penalty is taken under mu, needs no weight).")

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


class TokenLoss(NamedTuple):
  """What an objective returns, per token (all [B, T]).

  Attributes:
    loss_BT: float per-token loss to minimize (nats-weighted advantage units); finite wherever
      the inputs are finite. Only valid positions are ever read.
    truncated_BT: bool, tokens whose weight or ratio was truncated or clipped (the objective's
      docstring says which event counts).
    kept_BT: bool tokens kept by an importance-ratio mask (their loss is already 0 where not
      kept, but they stay in the normaliser), or None when the objective rejects no token.
  """

  loss_BT: jax.Array
  truncated_BT: jax.Array
  kept_BT: jax.Array | None = None


def _ratio(logp_BT, other_logp_BT, cfg):
  return jnp.exp(offpolicy.clamped_log_ratio(logp_BT, other_logp_BT, cfg.log_ratio_clamp))


def _check(cfg, logp_BT, lag_BT):
  if not isinstance(cfg, ObjectiveConfig):
    raise TypeError(f"cfg must be an ObjectiveConfig; got {type(cfg).__name__}.")
  return offpolicy.lag_truncation_scale(lag_BT, cfg.lag_truncation,
                                        jnp.promote_types(logp_BT.dtype, jnp.float32))


_ARGS_DOC = """
  Args:
    logp_BT: float[B, T] log pi_theta(a_t|s_t) of the current policy (nats; differentiable).
    behavior_logp_BT: float[B, T] log mu(a_t|s_t) recorded by the sampler (nats).
    advantages_BT: float[B, T] per-token advantage (held constant).
    lag_BT: int[B, T] learner version minus the token's policy version (>= 0).
    cfg: ObjectiveConfig.
    prox_logp_BT: optional float[B, T] log pi_prox, the policy before this batch's first
      update (None = stop_gradient(logp_BT)); read by decoupled_ppo and by is_mask with
      is_mask_ratio="proximal".
    All inputs must be finite at every position (see `token_loss.select_valid`).

  Returns:
    TokenLoss (per-token loss, truncated and kept flags).

  Raises:
    TypeError: on a non-integer lag or a cfg of the wrong type.
"""


def _with_args_doc(fn):
  """Appends the Args/Returns/Raises section shared by every objective to fn's docstring."""
  fn.__doc__ = fn.__doc__.rstrip() + "\n" + _ARGS_DOC
  return fn


@_with_args_doc
def tis_pg(logp_BT, behavior_logp_BT, advantages_BT, lag_BT, cfg, *, prox_logp_BT=None):
  """Truncated importance-weighted policy gradient (PipelineRL default).

  l_t = -sg(min(r_t, c(lag_t))) * A_t * log pi_theta(a_t|s_t),  r_t = pi_theta / mu,
  with c(lag) = cfg.truncation * s(lag). This is the policy-gradient term of IMPALA with the
  truncated weight rho_t = min(rho_bar, r_t) (Espeholt et al. 2018 eq. 1 and Sec. 4.2) and the
  TIS correction of Yao et al. 2025; PipelineRL (Piche et al. 2025 Sec. 5) clamps at 5.
  truncated counts tokens with r_t > c(lag_t).
  """
  del prox_logp_BT
  scale = _check(cfg, logp_BT, lag_BT)
  ratio = _ratio(logp_BT, behavior_logp_BT, cfg)
  level = cfg.truncation * scale
  weight = jax.lax.stop_gradient(jnp.minimum(ratio, level))
  return TokenLoss(-weight * jax.lax.stop_gradient(advantages_BT) * logp_BT, ratio > level)


@_with_args_doc
def cispo(logp_BT, behavior_logp_BT, advantages_BT, lag_BT, cfg, *, prox_logp_BT=None):
  """Clipped IS-weight policy optimization, CISPO (MiniMax-M1, 2025 eq. 4).

  l_t = -sg(min(r_t, eps_max)) * A_t * log pi_theta(a_t|s_t),  r_t = pi_theta / mu,
  eps_max = cfg.truncation * s(lag), no lower bound (MiniMax-M1 leaves eps_low unset; ScaleRL,
  Khatri et al. 2025 Sec. 3.2, writes it sg(min(rho, eps_max)) and uses eps_max in 4-8).
  Unlike PPO, tokens beyond the trust region still receive gradient, with a capped weight.
  With the same truncation the estimator is `tis_pg`'s, so this calls it; it is registered
  separately so ablation tables name the recipe (set truncation to ScaleRL's 4-8 for CISPO).
  """
  return tis_pg(logp_BT, behavior_logp_BT, advantages_BT, lag_BT, cfg,
                prox_logp_BT=prox_logp_BT)


@_with_args_doc
def ppo_clip(logp_BT, behavior_logp_BT, advantages_BT, lag_BT, cfg, *, prox_logp_BT=None):
  """PPO clipped surrogate with the behavior policy as the old policy.

  l_t = -min(r_t A_t, clip(r_t, 1 - eps, 1 + eps_high) A_t),  r_t = pi_theta / mu
  (Schulman et al. 2017 eq. 7; asymmetric clip-higher of DAPO, Yu et al. 2025). This is the
  "naive PPO" of AReaL (Fu et al. 2025 eq. 4) when tokens are stale.
  With cfg.behavior_trunc = c_b, for A_t < 0 the surrogate becomes
  max(min(...), c A_t) with c = max(c_b * s(lag), 1 + eps_high): dual-clip PPO (Ye et al. 2020
  eq. 5), which truncates the otherwise unbounded ratio of negative-advantage tokens at c.
  truncated counts tokens whose clip (or dual clip) changes the surrogate's value.
  """
  del prox_logp_BT
  scale = _check(cfg, logp_BT, lag_BT)
  ratio = _ratio(logp_BT, behavior_logp_BT, cfg)
  adv = jax.lax.stop_gradient(advantages_BT)
  low, high = 1.0 - cfg.clip_eps, 1.0 + cfg.eps_high
  surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, low, high) * adv)
  clipped = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
  if cfg.behavior_trunc is not None:
    level = jnp.maximum(cfg.behavior_trunc * scale, high)
    dual = (adv < 0) & (ratio > level)
    surrogate = jnp.where(adv < 0, jnp.maximum(surrogate, level * adv), surrogate)
    clipped = clipped | dual
  return TokenLoss(-surrogate, clipped)


@_with_args_doc
def decoupled_ppo(logp_BT, behavior_logp_BT, advantages_BT, lag_BT, cfg, *, prox_logp_BT=None):
  """Decoupled PPO with a proximal policy (AReaL, Fu et al. 2025 eq. 5).

  l_t = -sg(w_t) * min(u_t A_t, clip(u_t, 1 - eps, 1 + eps_high) A_t),
  u_t = pi_theta / pi_prox,  w_t = pi_prox / mu, or min(w_t, behavior_trunc * s(lag)) when
  cfg.behavior_trunc is set (TIS applied to PPO's old/behavior ratio, Yao et al. 2025).
  pi_prox is the policy before this batch's first update (`LearnerConfig.num_minibatches` > 1
  gives later minibatches a u_t != 1); with prox_logp_BT=None it is stop_gradient(logp_BT), so
  u_t = 1 and the gradient is sg(w_t) A_t grad log pi_theta (the truncated-IS limit).
  Both ratios are clamped in log space. truncated counts tokens where w_t was truncated or the
  clip of u_t changes the surrogate.
  """
  scale = _check(cfg, logp_BT, lag_BT)
  prox = jax.lax.stop_gradient(logp_BT if prox_logp_BT is None else prox_logp_BT)
  behavior_weight = _ratio(prox, behavior_logp_BT, cfg)
  truncated = jnp.zeros(behavior_weight.shape, bool)
  if cfg.behavior_trunc is not None:
    level = cfg.behavior_trunc * scale
    truncated = behavior_weight > level
    behavior_weight = jnp.minimum(behavior_weight, level)
  u = _ratio(logp_BT, prox, cfg)
  adv = jax.lax.stop_gradient(advantages_BT)
  low, high = 1.0 - cfg.clip_eps, 1.0 + cfg.eps_high
  surrogate = jnp.minimum(u * adv, jnp.clip(u, low, high) * adv)
  clipped = ((adv > 0) & (u > high)) | ((adv < 0) & (u < low))
  return TokenLoss(-jax.lax.stop_gradient(behavior_weight) * surrogate, truncated | clipped)


@_with_args_doc
def is_mask(logp_BT, behavior_logp_BT, advantages_BT, lag_BT, cfg, *, prox_logp_BT=None):
  """Importance-ratio masking (IcePop, Ant Ling 2025; token-level MIS, Liu et al. 2025).

  l_t = -1[a <= rho_t <= b] * sg(r_t) * A_t * log pi_theta(a_t|s_t),  r_t = pi_theta / mu,
  [a, b] = [cfg.is_mask_low, cfg.is_mask_high]; the band's ratio rho_t is r_t with
  is_mask_ratio="behavior", or pi_prox / mu with "proximal" (the engine mismatch at equal
  weights on tokens of samples the current version generated, see `ObjectiveConfig`).
  Kept tokens carry the importance weight r_t (unbiased on the kept set); rejected tokens give
  exact zeros but stay in the normalizer (IcePop's objective divides by the full token count),
  and are counted in frac_masked. truncated is always False.
  """
  del lag_BT
  _check(cfg, logp_BT, jnp.zeros(logp_BT.shape, jnp.int32))
  ratio = _ratio(logp_BT, behavior_logp_BT, cfg)
  if cfg.is_mask_ratio == "proximal":
    prox = jax.lax.stop_gradient(logp_BT if prox_logp_BT is None else prox_logp_BT)
    band_ratio = _ratio(prox, behavior_logp_BT, cfg)
  else:
    band_ratio = ratio
  inside = (band_ratio >= cfg.is_mask_low) & (band_ratio <= cfg.is_mask_high)
  weight = jax.lax.stop_gradient(ratio)
  loss = -weight * jax.lax.stop_gradient(advantages_BT) * logp_BT
  return TokenLoss(jnp.where(inside, loss, 0.0), jnp.zeros(ratio.shape, bool), inside)


@_with_args_doc
def no_correction(logp_BT, behavior_logp_BT, advantages_BT, lag_BT, cfg, *, prox_logp_BT=None):
  """REINFORCE that treats stale tokens as on-policy (no IS correction).

  l_t = -A_t * log pi_theta(a_t|s_t) (Williams 1992 eq. 11 with a baseline folded into A_t).
  The baseline of the staleness ablations; mu only enters the diagnostics.
  """
  del behavior_logp_BT, prox_logp_BT
  _check(cfg, logp_BT, lag_BT)
  loss = -jax.lax.stop_gradient(advantages_BT) * logp_BT
  return TokenLoss(loss, jnp.zeros(loss.shape, bool))


@_with_args_doc
def untruncated_is(logp_BT, behavior_logp_BT, advantages_BT, lag_BT, cfg, *,
                   prox_logp_BT=None):
  """Per-token importance-weighted policy gradient without truncation.

  l_t = -sg(r_t) * A_t * log pi_theta(a_t|s_t),  r_t = pi_theta / mu (the unbiased
  per-decision IS estimator, Precup et al. 2000; "vanilla-IS" of Yao et al. 2025, their
  high-variance baseline). The only bound is log_ratio_clamp (r_t <= e^clamp).
  """
  del prox_logp_BT
  _check(cfg, logp_BT, lag_BT)
  weight = jax.lax.stop_gradient(_ratio(logp_BT, behavior_logp_BT, cfg))
  loss = -weight * jax.lax.stop_gradient(advantages_BT) * logp_BT
  return TokenLoss(loss, jnp.zeros(loss.shape, bool))


def gspo(logp_BT, behavior_logp_BT, advantages_BT, lag_BT, cfg, *, prox_logp_BT=None,
         segment_ids_BT=None, valid_BT=None):
  """Group Sequence Policy Optimization, GSPO (Zheng et al. 2025, eqs. 5-7 and 10-11).

  Sequence ratio (length-normalised, eq. 7), over the valid tokens V_i of sample i:
    s_i = (pi_theta(y_i|x) / mu(y_i|x))^(1/|V_i|) = exp(mean_{t in V_i} log(pi_theta / mu)_t),
  and the per-token loss of GSPO-token (eqs. 10-11),
    l_t = -min(s_it A_t, clip(s_it, 1 - eps, 1 + eps_high) A_t),
    s_it = sg(s_i) * pi_theta(a_t) / sg(pi_theta(a_t))   (value s_i; gradient s_i grad log pi),
  which with `aggregation="sequence_mean"` and an advantage constant over each sample (GRPO's)
  is exactly GSPO's objective -(1/G) sum_i min(s_i A_i, clip(s_i) A_i) and gradient (eq. 6, 8).
  The clip range is cfg.clip_eps / cfg.eps_high; the paper uses 3e-4 / 4e-4 (Sec. 5.1), far
  smaller than PPO's 0.2 because s_i is a per-token geometric mean.

  Composition with the pipeline (documented choices):
    * old policy = mu, the sampler's recorded log-probs. When versions change inside a sample,
      mu(y_i|x) = prod_t mu_{v_t}(a_t|s_t) is still exactly the probability with which y_i was
      generated, so s_i is the length-normalised ratio of pi_theta to the actual behaviour.
    * the lag mask applies: tokens with lag > max_lag (and non-completion tokens) are outside
      V_i, excluded from the mean and from the loss; a sample with no valid token contributes
      nothing.
    * truncation / lag_truncation / behavior_trunc (per-token importance-weight truncation) do
      not apply: GSPO bounds the sequence ratio by its clip, and truncating the per-token ratios
      inside the geometric mean would change what s_i means; `ObjectiveConfig` rejects them.
  truncated counts tokens whose clip is active (the whole sample's tokens, for one sign of A).

  Args:
    logp_BT, behavior_logp_BT, advantages_BT, lag_BT, cfg, prox_logp_BT: as for every objective
      (prox_logp_BT is unused).
    segment_ids_BT: optional int[B, T] sample id per token (None = one sample per row).
    valid_BT: optional bool[B, T] tokens of V_i (None = every token).

  Returns:
    TokenLoss (per-token loss, truncated flags).

  Raises:
    TypeError: on a non-integer lag or a cfg of the wrong type.
  """
  del prox_logp_BT
  _check(cfg, logp_BT, lag_BT)
  shape = logp_BT.shape
  valid = jnp.ones(shape, bool) if valid_BT is None else valid_BT
  dtype = jnp.promote_types(logp_BT.dtype, jnp.float32)
  log_ratio = offpolicy.clamped_log_ratio(logp_BT, behavior_logp_BT, cfg.log_ratio_clamp)
  log_ratio = jnp.where(valid, log_ratio.astype(dtype), jnp.zeros((), dtype))
  sums = offpolicy.per_sample(jnp.stack([log_ratio, valid.astype(dtype)], -1), segment_ids_BT)
  mean_S = sums[..., 0] / jnp.maximum(sums[..., 1], 1.0)
  seq_log_ratio = offpolicy.per_token(jax.lax.stop_gradient(mean_S), segment_ids_BT, shape[1])
  s = jnp.exp(jnp.clip(seq_log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp))
  s_token = s * jnp.exp(logp_BT - jax.lax.stop_gradient(logp_BT))
  adv = jax.lax.stop_gradient(advantages_BT)
  low, high = 1.0 - cfg.clip_eps, 1.0 + cfg.eps_high
  surrogate = jnp.minimum(s_token * adv, jnp.clip(s_token, low, high) * adv)
  clipped = ((adv > 0) & (s > high)) | ((adv < 0) & (s < low))
  return TokenLoss(-surrogate, clipped)


Objective = Callable[..., TokenLoss]

OBJECTIVES: dict[str, Objective] = {
    "tis_pg": tis_pg,
    "ppo_clip": ppo_clip,
    "cispo": cispo,
    "decoupled_ppo": decoupled_ppo,
    "is_mask": is_mask,
    "no_correction": no_correction,
    "untruncated_is": untruncated_is,
    "gspo": gspo,
}
# Objectives whose per-token loss depends on the other tokens of the sample: they also receive
# `segment_ids_BT` and `valid_BT` (keywords) from `token_loss.per_token_loss`.
SEQUENCE_OBJECTIVES: tuple[str, ...] = ("gspo",)

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
