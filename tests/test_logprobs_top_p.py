"""Top-k / top-p processing against an independent float64 numpy reference (#27 item 6).

The reference is written from the definition: top-k keeps every token >= the k-th largest value
(ties kept, as HF and vLLM); top-p then keeps "the smallest set of most likely tokens whose mass
reaches top_p", ranking tokens by value and ties by lower token id.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import logprobs


def _reference_support(logits, temperature, top_k, top_p):
  """bool [R, V] kept tokens, float64, one row at a time."""
  z = np.asarray(logits, np.float64) / temperature
  keep = np.ones(z.shape, bool)
  for r in range(z.shape[0]):
    row = z[r]
    if 0 < top_k < row.size:
      kth = np.sort(row)[::-1][top_k - 1]
      keep[r] = row >= kth
    if top_p < 1.0:
      live = np.nonzero(keep[r])[0]
      p = np.exp(row[live] - row[live].max())
      p /= p.sum()
      order = sorted(range(live.size), key=lambda j: (-row[live[j]], live[j]))
      kept, mass = [], 0.0
      for j in order:
        if mass >= top_p:
          break
        kept.append(live[j])
        mass += p[j]
      keep[r] = False
      keep[r, kept] = True
  return keep


def _reference_logprobs(logits, temperature, top_k, top_p):
  keep = _reference_support(logits, temperature, top_k, top_p)
  z = np.where(keep, np.asarray(logits, np.float64) / temperature, -np.inf)
  z = z - z.max(-1, keepdims=True)
  return keep, z - np.log(np.exp(z).sum(-1, keepdims=True))


def _clear_of_boundaries(logits, temperature, top_k, top_p, margin=1e-4):
  """True if no cumulative mass (float64) lies within `margin` of top_p, so fp32 and fp64 agree
  on where the nucleus ends (the case under test is ties, not rounding at the boundary)."""
  keep = _reference_support(logits, temperature, top_k, 1.0)
  z = np.where(keep, np.asarray(logits, np.float64) / temperature, -np.inf)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  c = np.cumsum(-np.sort(-p, axis=-1), axis=-1)
  return bool(np.all(np.abs(c - top_p) > margin))


def _check(logits, temperature=1.0, top_k=0, top_p=1.0, rows=None):
  """Compares `processed_logprobs` with the reference on `rows` (default all); returns the
  reference's kept set [R, V]."""
  cfg = logprobs.SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
  got = np.asarray(jax.jit(lambda x: logprobs.processed_logprobs(x, cfg))(logits))
  keep, want = _reference_logprobs(np.asarray(logits.astype(jnp.float32)), temperature, top_k,
                                   top_p)
  rows = np.arange(keep.shape[0]) if rows is None else rows
  got, keep, want = got[rows], keep[rows], want[rows]
  np.testing.assert_array_equal(got > logprobs.OUT_OF_SUPPORT / 2, keep)
  np.testing.assert_allclose(got[keep], want[keep], rtol=1e-5, atol=1e-5)
  assert np.all(got[~keep] == logprobs.OUT_OF_SUPPORT)
  return keep


def test_ties_at_the_cut_off_are_kept_only_up_to_the_mass():
  # Three tokens tied at the cut-off (mass 0.684, then 0.0925 each): the nucleus needs two of
  # them, the lowest ids.
  logits = jnp.asarray([[0.0, 3.0, 1.0, 1.0, 1.0, -2.0],
                        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], jnp.float32)
  keep = _check(logits, top_p=0.8)
  assert keep[0].tolist() == [False, True, True, True, False, False]
  assert keep[1].tolist() == [True, True, True, True, True, False]  # 5 x 1/6 >= 0.8
  # A value threshold (the old rule) kept all ties: 4 and 6 tokens.


def test_bf16_rounded_logits_match_the_reference():
  """bf16-rounded logits (many exact ties, at the cut-off too) under five (top_k, top_p,
  temperature) settings; rows whose cumulative mass lies within 1e-4 of top_p are left out
  (there fp32 and fp64 may round to different sides; ties are what is under test)."""
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(0, 2.0, (64, 192)), jnp.float32).astype(jnp.bfloat16)
  x = np.asarray(logits.astype(jnp.float32))
  cut_in_ties = 0
  for top_k, top_p, temperature in [(0, 0.3, 1.0), (0, 0.9, 0.7), (5, 0.6, 1.0),
                                    (40, 0.95, 1.3), (3, 0.999, 1.0)]:
    rows = np.asarray([r for r in range(x.shape[0])
                       if _clear_of_boundaries(x[r:r + 1], temperature, top_k, top_p)])
    assert rows.size > 32
    keep = _check(logits, temperature, top_k, top_p, rows)
    # Rows where the cut fell inside a tie group: a value threshold would have kept more.
    xr = x[rows]
    threshold = np.min(np.where(keep, xr, np.inf), -1, keepdims=True)
    cut_in_ties += int(np.sum((xr >= threshold).sum(-1) > keep.sum(-1)))
  assert cut_in_ties >= 10, cut_in_ties


def test_top_k_ties_kept_then_top_p_on_the_renormalised_rest():
  logits = jnp.asarray([[4.0, 2.0, 2.0, 2.0, 0.0, 0.0],
                        [3.0, 1.0, 1.0, 1.0, 1.0, 0.5]], jnp.float32)
  keep = _check(logits, top_k=2, top_p=1.0)   # ties at the k-th value all kept
  assert keep.sum(-1).tolist() == [4, 5]
  # Renormalised over top-k's set: row 0 0.711 then 0.096 x 3; row 1 0.649 then 0.088 x 4.
  keep = _check(logits, top_k=2, top_p=0.85)
  assert keep[0].tolist() == [True, True, True, False, False, False]
  assert keep[1].tolist() == [True, True, True, True, False, False]


def test_learner_and_sampler_compute_the_same_set():
  """`token_logprobs` (the learner) and `sample` (the sampler) use one kept set."""
  cfg = logprobs.SamplingConfig(top_p=0.7)
  logits = jnp.asarray(np.random.default_rng(3).normal(0, 0.4, (8, 3, 24)),
                       jnp.float32).astype(jnp.bfloat16)
  flat = logits.reshape(24, 24)
  tokens, mu = jax.jit(lambda k, x: logprobs.sample(k, x, cfg))(jax.random.key(0), flat)
  pi = jax.jit(lambda x, t: logprobs.token_logprobs(x, t, cfg))(logits, tokens.reshape(8, 3))
  np.testing.assert_array_equal(np.asarray(pi).ravel(), np.asarray(mu))
  keep = _reference_support(np.asarray(flat.astype(jnp.float32)), 1.0, 0, 0.7)
  assert keep[np.arange(24), np.asarray(tokens)].all()


def test_gradient_flows_only_through_kept_logits():
  cfg = logprobs.SamplingConfig(top_p=0.6)
  logits = jnp.asarray([[2.0, 1.0, 1.0, 1.0, -1.0]], jnp.float32)
  g = jax.jit(jax.grad(lambda x: logprobs.processed_logprobs(x, cfg)[0, 0]))(logits)
  np.testing.assert_array_equal(np.asarray(g[0, 3:]), 0.0)
  assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("greedy", [False, True])
def test_excluded_ids_are_selected_out_whatever_their_logits_hold(greedy):
  """`excluded_ids`: out of the support (OUT_OF_SUPPORT), the rest renormalised as if the ids
  were absent; NaN / inf logits at those ids change nothing (#27 item 1)."""
  cfg = logprobs.SamplingConfig(temperature=0.8, top_p=0.9, greedy=greedy,
                                excluded_ids=(5, 0, 5))
  assert cfg.excluded_ids == (0, 5)
  rng = np.random.default_rng(4)
  clean = rng.normal(0, 1, (6, 12)).astype(np.float32)
  poisoned = clean.copy()
  poisoned[:, 0], poisoned[:3, 5], poisoned[3:, 5] = np.nan, np.inf, -np.inf
  f = jax.jit(lambda x: logprobs.processed_logprobs(x, cfg))
  got, ref = np.asarray(f(poisoned)), np.asarray(f(clean))
  np.testing.assert_array_equal(got, ref)
  assert np.all(got[:, [0, 5]] == logprobs.OUT_OF_SUPPORT)
  if not greedy:
    keep = [i for i in range(12) if i not in (0, 5)]
    _, want = _reference_logprobs(clean[:, keep], 0.8, 0, 0.9)
    np.testing.assert_allclose(got[:, keep][want > -np.inf], want[want > -np.inf], atol=1e-5)
  with pytest.raises(ValueError, match="excluded_ids"):
    logprobs.SamplingConfig(excluded_ids=(-1,))
