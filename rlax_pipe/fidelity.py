"""Gradient fidelity: how well an objective's gradient on stale samples matches the true one.

The quantity the staleness claims are about is the gradient a batch gives, not the accuracy a
short run ends at (WORKSPACE_NOTES.md, issue 16: final accuracy varies 5-10 points from seed to
seed while the objectives differ by 0-6). For a policy pi_v, the *true* (on-policy) gradient is
g* = grad_theta J(theta_v), estimated by the mean of M independent on-policy batch gradients; a
*stale* batch is sampled by mu = pi_{v-k} and an objective turns it into an estimate g_i of g*.
This module measures, from N such per-batch gradients (flattened, float[N, P]):

  * cosine similarity cos(g_i, g*) per batch (mean over batches, t interval);
  * relative bias along the true direction, b_par = (mean_i <g_i, u> - |g*|) / |g*| with
    u = g* / |g*| (negative = the estimate is shrunk, e.g. by truncation; interval from the
    per-batch projections and the on-policy estimate's own projection error);
  * relative bias norm |mean_i g_i - g*| / |g*| (point value, and the part of it that noise alone
    explains: sqrt(tr C / N + tr C* / M) / |g*|, the "noise floor");
  * per-batch variance: tr Cov(g_i) / |g*|^2 and Var(<g_i, u>) / |g*|^2 (the projection on the
    true gradient), with intervals from the per-batch squared deviations;
  * any per-batch scalar diagnostic (ESS, truncated fraction) as a mean with a t interval.

Everything here is pure numpy in float64 (N and P are small: a tiny model's flattened gradient);
the gradients themselves come from `objective_gradients`, a pure JAX function of a model.
Interval convention: 95% two-sided Student t over the independent units (batches), a normal
approximation for sums of independent errors (delta method), stated per metric.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from scipy import stats as scipy_stats

from rlax_pipe.learner import token_loss
from rlax_pipe.objectives import ObjectiveConfig

Z95 = 1.959963984540054


class Interval(NamedTuple):
  """A point value with its 95% interval [low, high] (NaN bounds when undefined, e.g. N < 2)."""

  value: float
  low: float
  high: float

  def separates_from(self, other: "Interval") -> bool:
    """True when the two intervals do not overlap (a strict separation)."""
    return bool(self.high < other.low or other.high < self.low)


def mean_interval(x_N: np.ndarray) -> Interval:
  """Mean of float[N] samples with a 95% Student-t interval (N - 1 degrees of freedom).

  Raises:
    ValueError: if x is not one-dimensional or is empty.
  """
  x = np.asarray(x_N, np.float64)
  if x.ndim != 1 or x.size == 0:
    raise ValueError(f"mean_interval: expected a non-empty 1-D array; got shape {x.shape}.")
  m = float(np.mean(x))
  if x.size < 2:
    return Interval(m, float("nan"), float("nan"))
  half = float(scipy_stats.t.ppf(0.975, x.size - 1) * np.std(x, ddof=1) / np.sqrt(x.size))
  return Interval(m, m - half, m + half)


class TrueGradient(NamedTuple):
  """The on-policy gradient estimate g* at one version and its own error.

  Attributes:
    mean_P: float64[P] mean of the M on-policy batch gradients (the estimate of g*).
    num_batches: M.
    trace_cov: tr Cov of one on-policy batch gradient (unbiased, ddof=1).
    norm: |g*| corrected for the noise of the mean: sqrt(|mean|^2 - tr_cov / M), or |mean| when
      that correction is not positive (the mean is then mostly noise: rel_se >= 1 says so).
    rel_se: standard error of the mean as a fraction of |g*|: sqrt(tr_cov / M) / norm (the
      relative error the reference itself carries; small means the comparisons are limited by the
      stale batches, not by the reference).
    proj_var: variance of the leave-one-out projection <g_j, u_-j> of one on-policy batch on the
      true direction (for the interval of the parallel bias).
  """

  mean_P: np.ndarray
  num_batches: int
  trace_cov: float
  norm: float
  rel_se: float
  proj_var: float


def true_gradient(g_MP: np.ndarray) -> TrueGradient:
  """Estimates g* and its error from M >= 2 independent on-policy batch gradients float[M, P].

  Raises:
    ValueError: if g is not [M, P] with M >= 2, or is not finite.
  """
  g = np.asarray(g_MP, np.float64)
  if g.ndim != 2 or g.shape[0] < 2:
    raise ValueError(f"true_gradient: expected float[M, P] with M >= 2 on-policy batches; got "
                     f"shape {g.shape}.")
  if not np.all(np.isfinite(g)):
    raise ValueError("true_gradient: the on-policy gradients hold non-finite values.")
  m = g.shape[0]
  mean = g.mean(axis=0)
  trace_cov = float(np.sum((g - mean) ** 2) / (m - 1))
  sq = float(mean @ mean)
  norm = float(np.sqrt(sq - trace_cov / m if sq > trace_cov / m else sq))
  loo = (mean[None, :] * m - g) / (m - 1)  # [M, P] leave-one-out means
  loo_u = loo / np.maximum(np.linalg.norm(loo, axis=1, keepdims=True), 1e-300)
  proj = np.sum(g * loo_u, axis=1)
  rel_se = float(np.sqrt(trace_cov / m) / norm) if norm > 0 else float("inf")
  return TrueGradient(mean, m, trace_cov, norm, rel_se, float(np.var(proj, ddof=1)))


class Fidelity(NamedTuple):
  """Fidelity of N per-batch gradients against a `TrueGradient` (all relative to |g*|).

  Attributes:
    cosine: mean over batches of cos(g_i, g*), t interval over batches.
    cosine_of_mean: cos(mean_i g_i, g*) (point value; noise shrinks it for small N).
    bias_parallel: (mean_i <g_i, u> - |g*|) / |g*|; interval: normal, with the variance of the
      per-batch projections / N plus the on-policy projection variance / M.
    bias_norm: |mean_i g_i - g*| / |g*| (point value).
    bias_noise_floor: sqrt(tr C / N + tr C* / M) / |g*|: what bias_norm would be from noise
      alone (an unbiased estimator has bias_norm of this size).
    trace_var: tr Cov(g_i) / |g*|^2 per batch; interval: t over the per-batch squared
      deviations N / (N - 1) |g_i - mean|^2 (approximate: they are weakly dependent).
    proj_var: Var(<g_i, u>) / |g*|^2; interval as trace_var on the projections.
    num_batches: N.
  """

  cosine: Interval
  cosine_of_mean: float
  bias_parallel: Interval
  bias_norm: float
  bias_noise_floor: float
  trace_var: Interval
  proj_var: Interval
  num_batches: int


def fidelity(g_NP: np.ndarray, true: TrueGradient) -> Fidelity:
  """Compares N >= 2 per-batch gradients float[N, P] with the on-policy estimate `true`.

  Raises:
    ValueError: if g is not [N, P] with N >= 2 and P = true's size, is not finite, or if the
      true gradient's norm is 0 (no direction to compare with).
  """
  g = np.asarray(g_NP, np.float64)
  if g.ndim != 2 or g.shape[0] < 2 or g.shape[1] != true.mean_P.shape[0]:
    raise ValueError(f"fidelity: expected float[N >= 2, P={true.mean_P.shape[0]}]; got shape "
                     f"{g.shape}.")
  if not np.all(np.isfinite(g)):
    raise ValueError("fidelity: the batch gradients hold non-finite values (an objective "
                     "without truncation can overflow; lower log_ratio_clamp).")
  if not true.norm > 0:
    raise ValueError("fidelity: the on-policy gradient estimate has norm 0 (or only noise); "
                     "use more on-policy batches.")
  n = g.shape[0]
  gs = true.mean_P
  scale = true.norm
  u = gs / np.linalg.norm(gs)
  norms = np.linalg.norm(g, axis=1)
  cos = (g @ gs) / np.maximum(norms * np.linalg.norm(gs), 1e-300)
  mean = g.mean(axis=0)
  cos_mean = float(mean @ gs / max(np.linalg.norm(mean) * np.linalg.norm(gs), 1e-300))
  proj = g @ u  # [N]
  b = (float(np.mean(proj)) - scale) / scale
  half = Z95 * np.sqrt(np.var(proj, ddof=1) / n + true.proj_var / true.num_batches) / scale
  dev2 = np.sum((g - mean) ** 2, axis=1) * n / (n - 1)
  tr = mean_interval(dev2 / scale**2)
  pdev = (proj - proj.mean()) ** 2 * n / (n - 1)
  pv = mean_interval(pdev / scale**2)
  floor = float(np.sqrt(tr.value * scale**2 / n + true.trace_cov / true.num_batches) / scale)
  return Fidelity(
      cosine=mean_interval(cos), cosine_of_mean=cos_mean,
      bias_parallel=Interval(b, b - half, b + half),
      bias_norm=float(np.linalg.norm(mean - gs) / scale), bias_noise_floor=floor,
      trace_var=tr, proj_var=pv, num_batches=n)


def per_batch(g_NP: np.ndarray, true: TrueGradient) -> dict[str, np.ndarray]:
  """Per-batch scalars against g*, for paired comparisons of objectives on the same batches.

  Returns float64[N] arrays: "cosine" cos(g_i, g*); "parallel" <g_i, u> / |g*| (1 = the true
  length along the true direction); "sq_error" |g_i - g*|^2 / |g*|^2 (per-batch relative mean
  squared error: bias^2 + variance, plus the reference's own error tr C* / M / |g*|^2, which
  is the same for every objective and cancels in a paired difference).
  """
  g = np.asarray(g_NP, np.float64)
  gs = true.mean_P
  u = gs / np.linalg.norm(gs)
  return dict(cosine=(g @ gs) / np.maximum(np.linalg.norm(g, axis=1) * np.linalg.norm(gs),
                                           1e-300),
              parallel=(g @ u) / true.norm,
              sq_error=np.sum((g - gs) ** 2, axis=1) / true.norm**2)


def pooled(values: Sequence[Interval]) -> Interval:
  """Mean of independent estimates (e.g. one per checkpoint) with a normal 95% interval.

  Each estimate's half-width is read as 1.96 standard errors; the mean's standard error is
  sqrt(sum se_i^2) / n. NaN bounds propagate.

  Raises:
    ValueError: on an empty sequence.
  """
  if not values:
    raise ValueError("pooled: no estimates to pool.")
  v = np.array([x.value for x in values], np.float64)
  se = np.array([(x.high - x.low) / (2 * Z95) for x in values], np.float64)
  m = float(v.mean())
  half = float(Z95 * np.sqrt(np.sum(se**2)) / len(values))
  return Interval(m, m - half, m + half)


# ---------------------------------------------------------------------------------------------
# Reference-free, paired statistics (no on-policy g* needed beyond a scale).
#
# With SNR ~0.1 per 16-sample batch, a g* estimate precise to 10% needs ~10^4 on-policy samples
# per target. What the claims compare can instead be read from the stale batches alone, every
# objective on the *same* N batches, through the Gram matrix of the O x N gradients:
#   * U(y) = sum_{i != j} <y_i, y_j> / (N (N - 1)): unbiased estimate of |E y|^2 for
#     independent y_1..y_N (a U-statistic, Hoeffding 1948; = |mean|^2 - tr Cov / N);
#   * V(y) = tr Cov(y) (ddof 1): the per-batch variance;
#   * bias^2 of objective o against the anchor a (untruncated token-level IS, whose expectation
#     is the on-policy gradient up to the state-distribution shift, which no token-level
#     objective corrects): U(g_o - g_a); mean squared error MSE_o = U(g_o - g_a) + V(g_o)
#     (bias^2 + variance; for o = a: V(g_a));
#   * per-batch energy |g_i|^2 (= variance + |E g|^2 in expectation) and the paired log energy
#     ratio log(|g_o,i|^2 / |g_ref,i|^2) of two objectives on the same batch (the variance
#     inflation the importance weights add, e.g. untruncated IS over no correction).
# Intervals: jackknife pseudo-values over batches (Quenouille-Tukey; Efron & Stein 1981 for the
# variance estimate) with a Student t interval; paired differences of two objectives are taken
# on their pseudo-values (the jackknife is linear in them). Quantities are divided by `scale2`,
# the mean on-policy per-batch energy E|g_on|^2 at the target (one unit for every lag).


def gram(g_KP: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
  """float64[K, K] Gram matrix <g_k, g_l> of K flattened gradients float[K, P] (chunked over P,
  accumulated in float64).

  Raises:
    ValueError: if g is not two-dimensional or holds non-finite values.
  """
  g = np.asarray(g_KP)
  if g.ndim != 2:
    raise ValueError(f"gram: expected float[K, P]; got shape {g.shape}.")
  out = np.zeros((g.shape[0], g.shape[0]), np.float64)
  for a in range(0, g.shape[1], chunk):
    x = np.asarray(g[:, a:a + chunk], np.float64)
    if not np.all(np.isfinite(x)):
      raise ValueError("gram: the gradients hold non-finite values.")
    out += x @ x.T
  return out


def u_sq_mean(k_NN: np.ndarray) -> float:
  """Unbiased |E y|^2 from the Gram matrix of N >= 2 independent y_i: mean over i != j of
  <y_i, y_j>."""
  n = k_NN.shape[0]
  return float((k_NN.sum() - np.trace(k_NN)) / (n * (n - 1)))


def trace_cov(k_NN: np.ndarray) -> float:
  """tr Cov(y) (ddof 1) from the Gram matrix of N >= 2 vectors y_i."""
  n = k_NN.shape[0]
  return float((np.trace(k_NN) - k_NN.sum() / n) / (n - 1))


def jackknife_pseudo(stat: Callable[[np.ndarray], float], k_NN: np.ndarray) -> np.ndarray:
  """float64[N] jackknife pseudo-values N s(all) - (N - 1) s(all but i) of a statistic of the
  Gram matrix (N >= 3: each leave-one-out set must keep two vectors). Their mean is the
  bias-corrected estimate, their t interval its 95% interval (`mean_interval`)."""
  n = k_NN.shape[0]
  if n < 3:
    raise ValueError(f"jackknife_pseudo: needs N >= 3 batches; got {n}.")
  full = stat(k_NN)
  loo = np.empty(n)
  for i in range(n):
    keep = np.delete(np.arange(n), i)
    loo[i] = stat(k_NN[np.ix_(keep, keep)])
  return n * full - (n - 1) * loo


def combo_gram(g_gram: np.ndarray, num_objectives: int, coeff_O: np.ndarray) -> np.ndarray:
  """float64[N, N] Gram matrix of y_i = sum_o coeff_o g_{o,i} from the [O N, O N] Gram matrix of
  the gradients ordered objective-major (row o * N + i)."""
  o = num_objectives
  n = g_gram.shape[0] // o
  g4 = g_gram.reshape(o, n, o, n)
  return np.einsum("a,aibj,b->ij", np.asarray(coeff_O, np.float64), g4,
                   np.asarray(coeff_O, np.float64))


def paired_stats(g_gram: np.ndarray, num_objectives: int, anchor: int,
                 scale2: float) -> list[dict[str, np.ndarray]]:
  """Reference-free statistics of O objectives on the same N batches (see the section comment).

  Args:
    g_gram: float64[O N, O N] Gram matrix of the per-batch gradients, objective-major.
    num_objectives: O.
    anchor: index of the anchor objective (untruncated IS) the biases are measured against.
    scale2: the unit (mean on-policy per-batch energy E|g_on|^2 at the target), > 0.

  Returns:
    Per objective a dict of float64[N] arrays: "energy" |g_i|^2 / scale2; "bias2", "var",
    "mse" jackknife pseudo-values of U(g_o - g_a), V(g_o), their sum (/ scale2).

  Raises:
    ValueError: on a Gram matrix not [O N, O N] with N >= 3, or scale2 <= 0.
  """
  o = num_objectives
  if g_gram.ndim != 2 or g_gram.shape[0] != g_gram.shape[1] or g_gram.shape[0] % o:
    raise ValueError(f"paired_stats: expected a square [O N, O N] Gram matrix with O={o}; got "
                     f"{g_gram.shape}.")
  if not scale2 > 0:
    raise ValueError(f"paired_stats: scale2={scale2} must be > 0 (the on-policy batches had "
                     "no gradient: every group's rewards were equal).")
  out = []
  for j in range(o):
    e_o = np.eye(o)[j]
    k_o = combo_gram(g_gram, o, e_o)
    k_d = combo_gram(g_gram, o, e_o - np.eye(o)[anchor])
    bias2 = jackknife_pseudo(u_sq_mean, k_d) / scale2
    var = jackknife_pseudo(trace_cov, k_o) / scale2
    out.append(dict(energy=np.diag(k_o) / scale2, bias2=bias2, var=var, mse=bias2 + var))
  return out


def log_energy_ratio(energy_a: np.ndarray, energy_b: np.ndarray) -> np.ndarray:
  """float64[n] log(|g_a,i|^2 / |g_b,i|^2) over the batches where both are > 0 (a batch whose
  groups all had equal rewards has no gradient under any objective and is left out)."""
  a, b = np.asarray(energy_a, np.float64), np.asarray(energy_b, np.float64)
  ok = (a > 0) & (b > 0)
  return np.log(a[ok] / b[ok])


def flatten(tree: Any) -> jax.Array:
  """The leaves of a gradient pytree as one float32[P] vector (ravel_pytree order)."""
  return ravel_pytree(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree))[0]


class BatchDiagnostics(NamedTuple):
  """Per-objective scalars of one batch (each float32[O], O = number of objectives).

  Attributes:
    ess: normalized ESS of the untruncated ratios over valid tokens (offpolicy.ObjectiveDiagnostics).
    frac_truncated: fraction of valid tokens the objective truncated or clipped.
    ratio_var: variance of the behaviour ratio over valid tokens.
    kl_k3: mean k3 estimate of KL(mu || pi) per valid token (nats).
  """

  ess: jax.Array
  frac_truncated: jax.Array
  ratio_var: jax.Array
  kl_k3: jax.Array


def objective_gradients(logp_fn: Callable[[Any], jax.Array], params: Any, batch: dict,
                        version: int | jax.Array,
                        cfgs: Sequence[ObjectiveConfig]) -> tuple[jax.Array, BatchDiagnostics]:
  """Each objective's gradient at `params` on one batch, flattened: float32[O, P].

  Every objective's loss is a function of the per-token log-probs logp_BT only, so its
  parameter gradient is the vector-Jacobian product of logp(params) with c_BT = dloss/dlogp:
  one forward pass, one dloss/dlogp per objective, and one VJP per objective (chain rule; the
  same value `jax.grad` of the composed loss gives, checked in tests). The proximal log-probs of
  decoupled PPO are the current ones held constant (one gradient step: pi_prox = pi_theta).

  Args:
    logp_fn: params -> float32[B, T] log pi_theta of batch["tokens"] at each position (nats), as
      the learner computes it (e.g. `next_token_logprobs_from_logits` of the model's logits).
    params: the policy's parameters (a pytree).
    batch: numpy/jax arrays of one `TrainBatch` [B, T]: loss_mask, behavior_logprobs,
      policy_versions, advantages, segment_ids (and whatever logp_fn reads).
    version: learner version v the gradient is taken at (lag = v - policy_versions).
    cfgs: the O objective configurations.

  Returns:
    (float32[O, P] gradients of the losses to minimize, `BatchDiagnostics`).
  """
  logp, vjp = jax.vjp(logp_fn, params)
  mask = jnp.asarray(batch["loss_mask"], jnp.float32)
  lag = (version - jnp.asarray(batch["policy_versions"])).astype(jnp.int32)
  mu = jnp.asarray(batch["behavior_logprobs"], jnp.float32)
  adv = jnp.asarray(batch["advantages"], jnp.float32)
  seg = jnp.asarray(batch["segment_ids"], jnp.int32)
  prox = jax.lax.stop_gradient(logp)
  grads, diags = [], []
  for cfg in cfgs:
    def loss(lp, cfg=cfg):
      return token_loss.objective_loss(lp, mu, adv, mask, lag, cfg, prox_logp_BT=prox,
                                       segment_ids_BT=seg)
    coeff, diag = jax.grad(loss, has_aux=True)(logp)
    grads.append(flatten(vjp(coeff)[0]))
    diags.append(diag)
  stack = lambda f: jnp.stack([getattr(d, f) for d in diags]).astype(jnp.float32)
  return jnp.stack(grads), BatchDiagnostics(ess=stack("ess"), frac_truncated=stack(
      "frac_truncated"), ratio_var=stack("ratio_var"), kl_k3=stack("kl_k3"))


def fidelity_row(fid: Fidelity) -> dict[str, Any]:
  """A JSON-ready dict of a `Fidelity` (intervals as [value, low, high])."""
  return {k: (list(v) if isinstance(v, Interval) else v) for k, v in fid._asdict().items()}
