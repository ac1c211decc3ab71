"""Logit processing shared by the sampler and the learner, so both compute the same distribution.

The sampler draws tokens from `processed_logprobs(logits, cfg)` and records the log-prob of the
drawn token under it (the behaviour log-prob mu). The learner recomputes `token_logprobs` with the
same function and the same `SamplingConfig`, so pi and mu are log-probs of the same kind of
distribution (after temperature, top-k and top-p, renormalised, fp32).

Order of operations (as in common serving engines): temperature, then top-k, then top-p.
Tokens outside the support get log-prob `OUT_OF_SUPPORT` (finite, so that downstream code never
sees inf; ratios are clamped in the objectives).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

OUT_OF_SUPPORT = -1e9


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How tokens are drawn.

  Attributes:
    temperature: softmax temperature (> 0); ignored when greedy.
    top_k: keep the k most likely tokens (0 = off). Ties at the k-th value are all kept.
    top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability
      mass reaches top_p (1.0 = off); the most likely token is always kept. In (0, 1].
    greedy: take the argmax; the sampling distribution is then a point mass (log-prob 0).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  greedy: bool = False

  def __post_init__(self):
    if not self.temperature > 0:
      raise ValueError(f"SamplingConfig.temperature={self.temperature} must be > 0.")
    if self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k={self.top_k} must be >= 0 (0 = off).")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingConfig.top_p={self.top_p} must be in (0, 1].")


def processed_logprobs(logits_V: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Log-probs of the distribution actually sampled from, over the last axis.

  Args:
    logits_V: float logits [..., V] (any leading shape).
    cfg: sampling configuration (static).

  Returns:
    float32 [..., V] normalised log-probs; out-of-support entries are `OUT_OF_SUPPORT`.
  """
  x = logits_V.astype(jnp.float32)
  vocab = x.shape[-1]
  if cfg.greedy:
    best = jnp.argmax(x, axis=-1)
    return jnp.where(jax.nn.one_hot(best, vocab, dtype=bool), jnp.float32(0.0),
                     jnp.float32(OUT_OF_SUPPORT))
  x = x / cfg.temperature
  if 0 < cfg.top_k < vocab:
    kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
    x = jnp.where(x >= kth, x, OUT_OF_SUPPORT)
  if cfg.top_p < 1.0:
    sorted_desc = -jnp.sort(-x, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < cfg.top_p  # first entry always kept (mass_before = 0)
    threshold = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x >= threshold, x, OUT_OF_SUPPORT)
  logp = jax.nn.log_softmax(x, axis=-1)
  return jnp.maximum(logp, OUT_OF_SUPPORT)


def token_logprobs(logits_BTV: jax.Array, tokens_BT: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """Log-prob of `tokens_BT[b, t]` under the processed distribution of `logits_BTV[b, t]`.

  Args:
    logits_BTV: float [B, T, V] logits that predict each token (already shifted by the caller).
    tokens_BT: int32 [B, T] token ids.
    cfg: sampling configuration.

  Returns:
    float32 [B, T].
  """
  if logits_BTV.ndim != 3 or tokens_BT.shape != logits_BTV.shape[:2]:
    raise ValueError(f"token_logprobs: logits {logits_BTV.shape} vs tokens {tokens_BT.shape}.")
  logp = processed_logprobs(logits_BTV, cfg)
  return jnp.take_along_axis(logp, tokens_BT[..., None], axis=-1)[..., 0]


def entropy(logp_V: jax.Array) -> jax.Array:
  """Entropy -sum p log p over the last axis of normalised log-probs (fp32, nats)."""
  p = jnp.exp(logp_V)
  return -jnp.sum(jnp.where(p > 0, p * logp_V, 0.0), axis=-1)


def sample(rng: jax.Array, logits_BV: jax.Array, cfg: SamplingConfig):
  """Draws one token per row and returns its behaviour log-prob.

  Args:
    rng: PRNG key.
    logits_BV: float [B, V] next-token logits.
    cfg: sampling configuration.

  Returns:
    (tokens int32 [B], logprobs float32 [B]) with logprobs under `processed_logprobs`.
  """
  logp = processed_logprobs(logits_BV, cfg)
  if cfg.greedy:
    tokens = jnp.argmax(logp, axis=-1)
  else:
    tokens = jax.random.categorical(rng, logp, axis=-1)
  tokens = tokens.astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
