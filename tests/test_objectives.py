"""Objectives: hand-computed golden values, finite differences, aggregation, lag rule, numerics."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import objectives
from rlax_pipe import offpolicy
from rlax_pipe.learner import token_loss
from rlax_pipe.objectives import ObjectiveConfig

NAMES = tuple(objectives.OBJECTIVES)


@functools.lru_cache(maxsize=None)
def _value_and_grad(name, cfg, jit):
  """f(logp, mu, adv, mask, lag, prox, seg) -> ((loss, diag), d loss / d logp) for `name`.

  Cached per (name, cfg, jit): tests that share shapes (B, T) = (2, 4), config and argument
  structure share one compilation, which keeps the file fast on a small CPU.
  """
  assert cfg.name == name

  def f(logp, mu, adv, mask, lag, prox, seg):
    return token_loss.objective_loss(logp, mu, adv, mask, lag, cfg, prox_logp_BT=prox,
                                     segment_ids_BT=seg)

  vg = jax.value_and_grad(f, has_aux=True)
  return jax.jit(vg) if jit else vg


def _loss_and_grad(name, jit, logp, mu, adv, mask, lag, *, cfg, prox=None, seg=None):
  return _value_and_grad(name, cfg, jit)(logp, mu, adv, mask, lag, prox, seg)


# Per-objective settings shared by the golden, lag, all-masked and extreme-value tests.
_SHARED_OVERRIDES = {"cispo": {"truncation": 5.0},
                     "is_mask": {"is_mask_low": 0.6, "is_mask_high": 2.5}}


def _shared_cfg(name, **extra):
  return ObjectiveConfig(name=name, max_lag=2, **{**_SHARED_OVERRIDES.get(name, {}), **extra})


# Golden batch, B=2, T=4. Row 0 holds the numbers; probabilities make every ratio round:
#   pi = [0.3, 0.2, 0.5, 0.1], mu = [0.1, 0.4, 0.5, 0.05]  ->  r = pi / mu = [3, 0.5, 1, 2]
#   A = [1, -1, 2, -2];  log pi = [-1.2039728, -1.6094379, -0.6931472, -2.3025851].
# Row 1 is fully masked and holds garbage (inf, NaN, 1e30), which must change nothing.
_INF, _NAN = np.inf, np.nan
PI = np.array([[0.3, 0.2, 0.5, 0.1], [0.0, _NAN, 1.0, 0.5]])
MU = np.array([[0.1, 0.4, 0.5, 0.05], [_INF, 0.0, 1e-30, _NAN]])
ADV = np.array([[1.0, -1.0, 2.0, -2.0], [_NAN, _INF, 1.0, -1e30]])
MASK = np.array([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])


def _golden_inputs():
  with np.errstate(divide="ignore", invalid="ignore"):
    logp, mu = np.log(PI), np.log(MU)
  return (jnp.asarray(logp, jnp.float32), jnp.asarray(mu, jnp.float32),
          jnp.asarray(ADV, jnp.float32), jnp.asarray(MASK, jnp.float32),
          jnp.zeros((2, 4), jnp.int32))


# name, extra config, loss, d loss / d logp of row 0, frac_truncated (token_mean over N = 4).
GOLDEN = [
    # tis_pg, c = 2: w = min(r, 2) = [2, .5, 1, 2]; sum w A logp
    #   = 2(-1.2039728) + .5(1.6094379) + 2(-.6931472) + 4(2.3025851) = 6.2208194; loss = -sum/4.
    #   grad = -w A / 4 = [-.5, .125, -.5, 1]; only r = 3 > 2 is truncated.
    ("tis_pg", {}, -1.5552048, [-0.5, 0.125, -0.5, 1.0], 0.25),
    # cispo with eps_max = 5: nothing truncated, w = r = [3, .5, 1, 2]:
    #   sum = 3(-1.2039728) + .8047190 - 1.3862944 + 9.2103404 = 5.0168466; loss = -sum/4.
    ("cispo", {}, -1.2542117, [-0.75, 0.125, -0.5, 1.0], 0.0),
    ("untruncated_is", {}, -1.2542117, [-0.75, 0.125, -0.5, 1.0], 0.0),
    # ppo_clip, eps = .2: min(rA, clip(r, .8, 1.2) A) = [1.2 (clip), -.8 (clip), 2, -4];
    #   sum = -1.6, loss = .4; gradient only through unclipped r A: -[0, 0, 2, -4] / 4.
    ("ppo_clip", {}, 0.4, [0.0, 0.0, -0.5, 1.0], 0.5),
    # ppo_clip + dual clip c = 1.5: token 3 (A < 0, r = 2 > 1.5) becomes 1.5 * -2 = -3, no grad.
    ("ppo_clip", {"behavior_trunc": 1.5}, 0.15, [0.0, 0.0, -0.5, 0.0], 0.75),
    # is_mask [a, b] = [.6, 2.5]: r = 3 and r = .5 are rejected; kept: 1*2*log .5, 2*-2*log .1
    #   sum = -1.3862944 + 9.2103404 = 7.824046, normalizer stays 4.
    ("is_mask", {}, -1.9560115, [0.0, 0.0, -0.5, 1.0], 0.0),
    # no_correction: sum A logp = -1.2039728 + 1.6094379 - 1.3862944 + 4.6051702 = 3.6243409.
    ("no_correction", {}, -0.90608523, [-0.25, 0.25, -0.5, 0.5], 0.0),
    # decoupled_ppo without prox: u = 1, so the value is -sum w A / 4 and the gradient is that of
    #   tis with w = r (untruncated): sum w A = 3 - .5 + 2 - 4 = .5; or with w = min(r, 2):
    #   sum w A = 2 - .5 + 2 - 4 = -.5.
    ("decoupled_ppo", {}, -0.125, [-0.75, 0.125, -0.5, 1.0], 0.0),
    ("decoupled_ppo", {"behavior_trunc": 2.0}, 0.125, [-0.5, 0.125, -0.5, 1.0], 0.25),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name,extra,loss,grad,frac_trunc", GOLDEN)
def test_golden_values(name, extra, loss, grad, frac_trunc, jit):
  (value, diag), g = _loss_and_grad(name, jit, *_golden_inputs(), cfg=_shared_cfg(name, **extra))
  np.testing.assert_allclose(value, loss, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(g, [grad, [0.0] * 4], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(diag.frac_truncated, frac_trunc, atol=1e-7)
  assert int(diag.tokens) == (2 if name == "is_mask" else 4)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("behavior_trunc,loss,frac_trunc", [(None, 0.045, 0.5),
                                                             (1.5, -0.055, 0.75)])
def test_decoupled_ppo_golden_with_prox(behavior_trunc, loss, frac_trunc, jit):
  # prox = [.2, .16, .4, .1]: w = prox/mu = [2, .4, .8, 2], u = pi/prox = [1.5, 1.25, 1.25, 1].
  #   A = [1, -1, 2, -2]: min(uA, clip(u, .8, 1.2)A) = [1.2 (clip), -1.25, 2.4 (clip), -2];
  #   w * surrogate = [2.4, -.5, 1.92, -4], sum -.18, loss .045; grad -w u A / 4 where
  #   unclipped: -[0, -.5, 0, -4] / 4. With behavior_trunc 1.5: w = [1.5, .4, .8, 1.5],
  #   w * surrogate = [1.8, -.5, 1.92, -3], sum .22, loss -.055 (w truncated at tokens 0, 3).
  # The masked row's proximal log-probs are garbage too.
  cfg = _shared_cfg("decoupled_ppo", behavior_trunc=behavior_trunc)
  prox = jnp.log(jnp.asarray([[0.2, 0.16, 0.4, 0.1], [_NAN, 0.0, _INF, 1.0]]))
  (value, diag), g = _loss_and_grad("decoupled_ppo", jit, *_golden_inputs(), cfg=cfg, prox=prox)
  np.testing.assert_allclose(value, loss, rtol=1e-5, atol=1e-7)
  w3 = 2.0 if behavior_trunc is None else 1.5
  np.testing.assert_allclose(g, [[0.0, 0.125, 0.0, w3 / 2.0], [0.0] * 4], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(diag.frac_truncated, frac_trunc)


def test_golden_diagnostics():
  entropy = jnp.asarray([[0.5, 1.0, 1.5, 2.0], [_NAN, _INF, 9.0, 9.0]])
  _, d = token_loss.objective_loss(*_golden_inputs(), _shared_cfg("tis_pg"),
                                   entropy_BT=entropy)
  # r = [3, .5, 1, 2]: mean 1.625, var 3.5625 - 1.625^2, ESS = 6.5^2 / (4 * 14.25).
  np.testing.assert_allclose(d.ratio_mean, 1.625, rtol=1e-6)
  np.testing.assert_allclose(d.ratio_var, 0.921875, rtol=1e-5)
  np.testing.assert_allclose([d.ratio_min, d.ratio_max], [0.5, 3.0], rtol=1e-6)
  np.testing.assert_allclose(d.ess, 42.25 / 57.0, rtol=1e-6)
  # k3 = r - 1 - log r = [2 - 1.0986123, -.5 + .6931472, 0, 1 - .6931472].
  np.testing.assert_allclose(d.kl_k3, 1.4013877 / 4, rtol=1e-6)
  # |log r| = [1.0986123, .6931472, 0, .6931472] (every token has lag 0).
  np.testing.assert_allclose(d.logp_mismatch_mean, 2.4849066 / 4, rtol=1e-6)
  np.testing.assert_allclose(d.logp_mismatch_max, 1.0986123, rtol=1e-6)
  np.testing.assert_allclose(d.entropy, 1.25)
  assert int(d.tokens) == 4 and float(d.frac_masked) == 0.0
  np.testing.assert_array_equal(d.lag_hist, [4] + [0] * 16)


def _fd_grad(f, x, h=1e-6):
  """Central finite differences of a scalar function of a float64 array."""
  x = np.asarray(x, np.float64)
  g = np.zeros_like(x)
  for idx in np.ndindex(*x.shape):
    e = np.zeros_like(x)
    e[idx] = h
    g[idx] = (float(f(x + e)) - float(f(x - e))) / (2 * h)
  return g


@pytest.mark.parametrize("name", NAMES)
def test_finite_difference_gradient(name):
  """Autodiff gradient w.r.t. log pi vs central differences, in float64.

  Objectives that hold an importance weight constant (stop_gradient) are differentiated along
  logp + h and behavior_logp + h together: the ratio, hence the weight, is unchanged, so the
  finite difference is exactly the weight-frozen derivative autodiff computes.
  """
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    logp = rng.normal(size=(2, 3)) - 1.5
    mu = logp + rng.normal(scale=0.5, size=(2, 3))
    prox = logp + rng.normal(scale=0.1, size=(2, 3))
    adv = rng.normal(size=(2, 3))
    if name in objectives.SEQUENCE_OBJECTIVES:  # GSPO-token is GSPO's gradient when the
      adv = np.repeat(adv[:, :1], 3, axis=1)    # advantage is constant over a sample
    mask = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    lag = np.array([[0, 1, 0], [2, 0, 5]], np.int32)
    cfg = ObjectiveConfig(name=name, max_lag=3, truncation=1.3,
                          is_mask_low=0.4, is_mask_high=2.0)
    fn = token_loss.objective_loss
    kwargs = {"prox_logp_BT": jnp.asarray(prox)} if name == "decoupled_ppo" else {}
    frozen = name in ("tis_pg", "cispo", "is_mask", "untruncated_is")

    @jax.jit
    def loss(x):
      other = mu + (x - logp) if frozen else jnp.asarray(mu)
      return fn(x, other, jnp.asarray(adv), jnp.asarray(mask), jnp.asarray(lag), cfg,
                **kwargs)[0]

    auto = jax.jit(jax.grad(lambda x: fn(x, jnp.asarray(mu), jnp.asarray(adv), jnp.asarray(mask),
                                         jnp.asarray(lag), cfg, **kwargs)[0]))(jnp.asarray(logp))
    assert auto.dtype == jnp.float64
    np.testing.assert_allclose(auto, _fd_grad(loss, logp), rtol=1e-6, atol=1e-8)
    assert auto[0, 2] == 0.0 and auto[1, 2] == 0.0  # masked and stale tokens


AGG_LOSS = np.array([[1.0, 2.0, 3.0, 4.0, 9.0], [5.0, 6.0, 7.0, 8.0, 9.0]], np.float32)
AGG_VALID = np.array([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], bool)
AGG_SEGMENTS = np.array([[1, 1, 2, 2, 3], [1, 1, 1, 2, 0]], np.int32)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("aggregation,normalizer,expected", [
    ("token_mean", None, 26.0 / 6.0),  # (1 + 2 + 3 + 5 + 7 + 8) / 6
    # samples (0,1): {1,2} -> 1.5; (0,2): {3} -> 3; (0,3) no valid token -> ignored;
    # (1,1): {5,7} -> 6 (same id as row 0's sample 1, but another sample); (1,2): {8} -> 8.
    ("sequence_mean", None, (1.5 + 3.0 + 6.0 + 8.0) / 4.0),
    # Dr. GRPO: 4 samples with a valid token x max completion length 5 = 20.
    ("constant", 5, 26.0 / 20.0),
])
def test_aggregation(aggregation, normalizer, expected, jit):
  cfg = ObjectiveConfig(aggregation=aggregation, max_completion_len=normalizer)
  agg = lambda l, v, s: token_loss.aggregate_loss(l, v, cfg, s)
  out = (jax.jit(agg) if jit else agg)(AGG_LOSS, AGG_VALID, AGG_SEGMENTS)
  np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_dr_grpo_constant_counts_every_completion_and_is_invariant_to_batch_size():
  """Denominator = samples x max completion length (Dr. GRPO); a sample whose only loss-mask
  token is too stale still counts as a sample of the batch. Doubling the batch (the same
  samples twice, as a learner-wait batch may grow) leaves every aggregation's loss unchanged."""
  mask = AGG_VALID.astype(np.float32).copy()
  mask[0, 4] = 1.0  # sample (0, 3): a completion token, but not valid (e.g. lag > max_lag)
  cfg = ObjectiveConfig(aggregation="constant", max_completion_len=384)
  out = token_loss.aggregate_loss(AGG_LOSS, AGG_VALID, cfg, AGG_SEGMENTS, mask_BT=mask)
  np.testing.assert_allclose(out, 26.0 / (5 * 384), rtol=1e-6)
  # The example of the issue: 64 samples of a 384-token budget -> 24576.
  n_samples = jnp.float32(64)
  counts = token_loss.Counts(tokens=jnp.float32(1000), samples=n_samples, completions=n_samples)
  assert float(token_loss.normalizer(counts, cfg)) == 24576.0
  twice = lambda x: np.concatenate([x, x])
  for aggregation, extra in (("token_mean", None), ("sequence_mean", None), ("constant", 7)):
    c = ObjectiveConfig(aggregation=aggregation, max_completion_len=extra)
    one = token_loss.aggregate_loss(AGG_LOSS, AGG_VALID, c, AGG_SEGMENTS, mask_BT=mask)
    two = token_loss.aggregate_loss(twice(AGG_LOSS), twice(AGG_VALID), c, twice(AGG_SEGMENTS),
                                    mask_BT=twice(mask))
    np.testing.assert_allclose(two, one, rtol=1e-6, err_msg=aggregation)


def test_sequence_mean_weights_samples_equally_in_objective():
  """Every sample counts equally, so a token of a short sample weighs more."""
  cfg = ObjectiveConfig(name="no_correction", aggregation="sequence_mean")
  logp = jnp.full((2, 4), -1.0)
  one = jnp.ones((2, 4))
  seg = jnp.asarray([[1, 1, 1, 2], [1, 1, 1, 1]], jnp.int32)
  _, g = _loss_and_grad("no_correction", False, logp, logp, one, one,
                        jnp.zeros((2, 4), jnp.int32), cfg=cfg, seg=seg)
  # Three samples of 3, 1 and 4 tokens: d loss / d logp = -1 / (3 * |sample|).
  np.testing.assert_allclose(g, [[-1 / 9, -1 / 9, -1 / 9, -1 / 3], [-1 / 12] * 4], rtol=1e-6)


def test_sequence_mean_requires_segment_ids():
  cfg = ObjectiveConfig(aggregation="sequence_mean")
  with pytest.raises(ValueError, match="segment_ids_BT"):
    token_loss.objective_loss(*_golden_inputs(), cfg)
  with pytest.raises(ValueError, match="segment_ids_BT"):
    token_loss.objective_loss(*_golden_inputs(), ObjectiveConfig(aggregation="constant",
                                                                 max_completion_len=4))


def _stale_batch():
  """B=2, T=4 with two tokens past max_lag=2 holding hostile values, and a clean twin batch.

  Returns (hostile, clean, stale): tuples (logp, mu, adv, mask, lag) and the bool[2, 4] stale
  positions. The twin has the stale tokens removed from the loss mask and ordinary values.
  """
  rng = np.random.default_rng(1)
  logp = rng.normal(size=(2, 4)).astype(np.float32) - 1.0
  mu = (logp + 0.1 * rng.normal(size=(2, 4))).astype(np.float32)  # r inside is_mask's band
  adv = rng.normal(size=(2, 4)).astype(np.float32)
  mask = np.ones((2, 4), np.float32)
  lag = np.array([[0, 1, 3, 2], [7, 0, 1, 2]], np.int32)
  stale = lag > 2
  clean = tuple(map(jnp.asarray, (logp, mu, adv, np.where(stale, 0.0, mask), lag)))
  logp_h = np.where(stale, -np.inf, logp).astype(np.float32)
  mu_h = np.where(stale, np.float32(1e30), mu).astype(np.float32)
  adv_h = np.where(stale, np.nan, adv).astype(np.float32)
  hostile = tuple(map(jnp.asarray, (logp_h, mu_h, adv_h, mask, lag)))
  return hostile, clean, stale


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", NAMES)
def test_max_lag_removes_stale_tokens_from_loss_and_gradient(name, jit):
  hostile, clean, stale = _stale_batch()
  cfg = _shared_cfg(name)
  (loss_h, diag_h), grad_h = _loss_and_grad(name, jit, *hostile, cfg=cfg)
  (loss_c, diag_c), grad_c = _loss_and_grad(name, jit, *clean, cfg=cfg)
  assert np.isfinite(loss_h) and np.all(np.isfinite(grad_h))
  np.testing.assert_array_equal(loss_h, loss_c)
  np.testing.assert_array_equal(grad_h, grad_c)
  assert np.all(np.asarray(grad_h)[stale] == 0.0)
  assert np.any(np.asarray(grad_h)[~stale] != 0.0)
  for field in ("ratio_mean", "ratio_var", "ess", "kl_k3", "tokens", "logp_mismatch_max"):
    np.testing.assert_array_equal(getattr(diag_h, field), getattr(diag_c, field))
  # The histogram still sees the stale tokens (lags 3 and 7); frac_masked reports them.
  np.testing.assert_array_equal(diag_h.lag_hist[:8], [2, 2, 2, 1, 0, 0, 0, 1])
  assert int(diag_h.tokens) == 6
  np.testing.assert_allclose(diag_h.frac_masked, 2 / 8)


def test_max_lag_zero_keeps_only_fresh_tokens_and_none_keeps_all():
  _, (logp, mu, adv, mask, lag), _ = _stale_batch()
  mask = jnp.ones_like(mask)
  _, d0 = token_loss.objective_loss(logp, mu, adv, mask, lag, ObjectiveConfig(max_lag=0))
  _, dn = token_loss.objective_loss(logp, mu, adv, mask, lag, ObjectiveConfig(max_lag=None))
  assert int(d0.tokens) == 2 and int(dn.tokens) == 8


@pytest.mark.parametrize("name", NAMES)
def test_all_masked_batch_gives_zero_loss_and_zero_gradient(name):
  inf, nan = np.inf, np.nan
  logp = jnp.asarray([[-inf, -1e4, 3.0, 0.0], [nan, 0.0, -1.0, 1e30]], jnp.float32)
  mu = jnp.asarray([[0.0, inf, -1e30, -inf], [-inf, nan, 1.0, 0.0]], jnp.float32)
  adv = jnp.asarray([[nan, 1.0, inf, 0.0], [1.0, -1.0, 0.0, -inf]], jnp.float32)
  mask = jnp.asarray([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
  lag = jnp.asarray([[0, 0, 0, 3], [0, 0, 0, 9]], jnp.int32)  # mask-1 tokens are too stale
  (loss, diag), grad = _loss_and_grad(name, True, logp, mu, adv, mask, lag,
                                      cfg=_shared_cfg(name))
  assert float(loss) == 0.0
  np.testing.assert_array_equal(grad, np.zeros((2, 4)))
  # Statistics of an empty token set are absent (NaN), never a fake 0; counts say why.
  assert int(diag.tokens) == int(diag.valid_tokens) == int(diag.mismatch_tokens) == 0
  for field, count in offpolicy.DIAGNOSTIC_COUNTS.items():
    value = getattr(diag, field)
    assert np.isnan(value) if int(getattr(diag, count)) == 0 else np.isfinite(value), field
  assert float(diag.frac_masked) == 1.0 and int(diag.mask_tokens) == 2


@pytest.mark.parametrize("name", NAMES)
def test_extreme_log_probs_stay_finite(name):
  """Valid tokens with log-ratios of +-1e4 are clamped before exp; masked garbage is exact 0."""
  logp = jnp.asarray([[-1e4, -1.0, -0.5, -jnp.inf], [-3.0, -30.0, -1e4, 0.0]], jnp.float32)
  mu = jnp.asarray([[-1.0, -1e4, -0.5, jnp.nan], [-1e4, -1e4, -3.0, -1e30]], jnp.float32)
  adv = jnp.asarray([[1.0, -1.0, 0.5, 2.0], [-1.0, 1.0, -2.0, 1.0]], jnp.float32)
  mask = jnp.asarray([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
  lag = jnp.zeros((2, 4), jnp.int32)
  (loss, diag), grad = _loss_and_grad(name, True, logp, mu, adv, mask, lag,
                                      cfg=_shared_cfg(name))
  assert np.isfinite(loss) and np.all(np.isfinite(grad))
  assert grad[0, 3] == 0.0 and grad[1, 3] == 0.0
  np.testing.assert_allclose(diag.ratio_max, math.exp(20.0), rtol=1e-5)
  np.testing.assert_allclose(diag.ratio_min, math.exp(-20.0), rtol=1e-5)
  for field, value in zip(diag._fields, diag):
    assert np.all(np.isfinite(value)) or field == "entropy", field  # no entropy given: NaN


# The remaining small tests run eagerly on (2, 4) arrays, reusing the op cache of the eager runs
# above instead of compiling a program each.


def _per_token(cfg, logp, mu, adv, lag):
  """(d sum_t l_t / d logp, truncated) of the per-token objective itself (no masking)."""
  fn = objectives.get_objective(cfg.name)
  grad = jax.grad(lambda x: jnp.sum(fn(x, mu, adv, lag, cfg).loss_BT))(logp)
  return grad, fn(logp, mu, adv, lag, cfg).truncated_BT


def test_log_ratio_clamp_caps_untruncated_weight():
  logp = jnp.full((2, 4), -1.0)
  mu = jnp.asarray([[-40.0, -1.0, 38.0, -3.0], [-1.0, -1.0, -1.0, -1.0]])
  one, zero = jnp.ones((2, 4)), jnp.zeros((2, 4), jnp.int32)
  cfg = ObjectiveConfig(name="untruncated_is", log_ratio_clamp=3.0)
  g, _ = _per_token(cfg, logp, mu, one, zero)
  np.testing.assert_allclose(-g[0], [math.exp(3.0), 1.0, math.exp(-3.0), math.exp(2.0)],
                             rtol=1e-6)


@pytest.mark.parametrize("lag_truncation,levels", [
    (0.5, [2.0, 1.0, 0.5, 0.25]),  # c * 0.5 ** lag
    ((1.0, 0.75), [2.0, 1.5, 1.5, 1.5]),  # table; the last entry covers every larger lag
])
def test_lag_dependent_truncation_level(lag_truncation, levels):
  """With r = 4 everywhere, tis_pg's weight min(r, c(lag)) equals the level c(lag)."""
  logp = jnp.full((2, 4), -1.0)
  mu = logp - jnp.log(4.0)
  one = jnp.ones((2, 4))
  lag = jnp.asarray([[0, 1, 2, 3], [0, 1, 2, 3]], jnp.int32)
  cfg = ObjectiveConfig(truncation=2.0, lag_truncation=lag_truncation)
  g, truncated = _per_token(cfg, logp, mu, one, lag)
  np.testing.assert_allclose(-g, [levels, levels], rtol=1e-6)
  assert bool(jnp.all(truncated))


def test_lag_truncation_scales_behavior_trunc_in_decoupled_ppo():
  logp = jnp.full((2, 4), -1.0)
  mu = logp - jnp.log(4.0)
  one = jnp.ones((2, 4))
  lag = jnp.asarray([[0, 2, 1, 9], [0, 0, 0, 0]], jnp.int32)
  cfg = ObjectiveConfig(name="decoupled_ppo", behavior_trunc=3.0, lag_truncation=0.5)
  g, _ = _per_token(cfg, logp, mu, one, lag)
  # w = min(4, 3 * .5 ** lag) = [3, .75, 1.5, 3 / 512]
  np.testing.assert_allclose(-g[0], [3.0, 0.75, 1.5, 3.0 / 512], rtol=1e-6)


def test_cispo_equals_tis_pg_with_same_truncation():
  _, clean, _ = _stale_batch()
  a = token_loss.objective_loss(*clean, ObjectiveConfig(name="tis_pg", truncation=1.1))
  b = token_loss.objective_loss(*clean, ObjectiveConfig(name="cispo", truncation=1.1))
  np.testing.assert_array_equal(a[0], b[0])


def test_on_policy_objectives_agree():
  """At pi = mu (prox = pi), IS variants reduce to REINFORCE and PPO's gradient equals it."""
  _, (logp, _, adv, mask, lag), _ = _stale_batch()
  grads = {}
  for name in NAMES:
    grads[name] = jax.grad(lambda x, name=name: token_loss.objective_loss(
        x, jax.lax.stop_gradient(x), adv, mask, lag, ObjectiveConfig(name=name))[0])(logp)
  for name in NAMES:
    np.testing.assert_allclose(grads[name], grads["no_correction"], rtol=1e-6, atol=1e-7)


def test_registry_and_typo():
  assert set(NAMES) == {"tis_pg", "ppo_clip", "cispo", "decoupled_ppo", "is_mask",
                        "no_correction", "untruncated_is", "gspo"}
  assert objectives.get_objective("tis_pg") is objectives.tis_pg
  with pytest.raises(ValueError, match="tis_pg") as err:
    objectives.get_objective("tis-pg")
  for name in NAMES:
    assert name in str(err.value)
  with pytest.raises(ValueError, match="ObjectiveConfig.name"):
    ObjectiveConfig(name="ppo")


@pytest.mark.parametrize("overrides,field", [
    ({"truncation": 0.0}, "truncation"),
    ({"truncation": math.inf}, "truncation"),
    ({"clip_eps": 1.0}, "clip_eps"),
    ({"clip_eps_high": -0.1}, "clip_eps_high"),
    ({"is_mask_low": 1.5}, "is_mask_low"),
    ({"is_mask_high": 0.9}, "is_mask_high"),
    ({"behavior_trunc": 2.0}, "behavior_trunc"),  # tis_pg has no behavior ratio factor
    ({"name": "ppo_clip", "behavior_trunc": 0.5}, "behavior_trunc"),
    ({"max_lag": -1}, "max_lag"),
    ({"max_lag": 1.5}, "max_lag"),
    ({"lag_truncation": 1.5}, "lag_truncation"),
    ({"lag_truncation": [1.0, 0.5]}, "lag_truncation"),
    ({"lag_truncation": ()}, "lag_truncation"),
    ({"name": "no_correction", "lag_truncation": 0.5}, "lag_truncation"),
    ({"name": "ppo_clip", "lag_truncation": 0.5}, "lag_truncation"),
    ({"aggregation": "mean"}, "aggregation"),
    ({"aggregation": "constant"}, "max_completion_len"),
    ({"aggregation": "constant", "max_completion_len": 4.5}, "max_completion_len"),
    ({"max_completion_len": 4}, "max_completion_len"),
    ({"is_mask_ratio": "engine"}, "is_mask_ratio"),
    ({"is_mask_ratio": "proximal"}, "is_mask_ratio"),  # tis_pg has no ratio band
    ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
    ({"log_ratio_clamp": 100.0}, "log_ratio_clamp"),
    ({"hist_bins": 1}, "hist_bins"),
])
def test_config_validation_names_the_field(overrides, field):
  with pytest.raises(ValueError, match=f"ObjectiveConfig.{field}"):
    ObjectiveConfig(**overrides)


def test_config_is_hashable_and_frozen():
  cfg = ObjectiveConfig(name="ppo_clip", clip_eps_high=0.28, lag_truncation=(1.0, 0.5),
                        behavior_trunc=3.0)
  assert hash(cfg) == hash(dataclasses.replace(cfg))
  assert cfg.eps_high == 0.28 and ObjectiveConfig().eps_high == 0.2
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.name = "tis_pg"  # type: ignore[misc]


@pytest.mark.parametrize("bad,error", [
    ({"logp_BT": jnp.zeros((4,))}, ValueError),
    ({"mask_BT": jnp.ones((1, 3))}, ValueError),
    ({"lag_BT": jnp.zeros((2, 4))}, TypeError),
    ({"advantages_BT": jnp.zeros((2, 4), jnp.int32)}, TypeError),
])
def test_input_checks(bad, error):
  logp, mu, adv, mask, lag = _golden_inputs()
  args = dict(logp_BT=logp, behavior_logp_BT=mu, advantages_BT=adv, mask_BT=mask, lag_BT=lag)
  args.update(bad)
  with pytest.raises(error):
    token_loss.objective_loss(**args, cfg=ObjectiveConfig())
