"""Logit processing shared by the sampler and the learner, so both compute the same distribution.

The sampler draws tokens from `processed_logprobs(logits, cfg)` and records the log-prob of the
drawn token under it (the behaviour log-prob mu). The learner recomputes `token_logprobs` with the
same function and the same `SamplingConfig`, so pi and mu are log-probs of the same kind of
distribution (after temperature, top-k and top-p, renormalised, fp32).

Order of operations (as in common serving engines): temperature, then top-k, then top-p.
Tokens outside the support get log-prob `OUT_OF_SUPPORT` (finite, so that downstream code never
sees inf; ratios are clamped in the objectives).

Non-finite output-head columns (#27 item 1). With tied embeddings the output head is the
embedding's transpose, so a NaN or inf stored in a row no real token uses (the padding id, a
vocabulary-padding row) is also that id's output column: its logit is non-finite at every position
and, through the softmax normaliser, would poison every log-prob. By default (no setting) the
sampler and the learner therefore compute `nonfinite_columns(head)` (bool [V], a reduction over
the head, once per decode dispatch / once per learner forward) and block those ids exactly like
`SamplingConfig.excluded_ids`: their logits are selected out (log-prob OUT_OF_SUPPORT, never
sampled) and the learner selects their head columns to 0 before the matmul, so the backward pass
has no 0 * NaN. On finite weights the mask is all False and every result is bit-identical to the
unmasked computation (a select that picks the original value everywhere).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

OUT_OF_SUPPORT = -1e9


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How tokens are drawn.

  Attributes:
    temperature: softmax temperature (> 0); ignored when greedy.
    top_k: keep the k most likely tokens (0 = off). Ties at the k-th value are all kept.
    top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability
      mass reaches top_p (1.0 = off); the most likely token is always kept. In (0, 1]. Cut by
      sorted position (`top_p_support`): tokens tied at the cut-off are ranked by lower token
      id, so ties never widen the set.
    greedy: take the argmax; the sampling distribution is then a point mass (log-prob 0).
    excluded_ids: token ids out of use (e.g. the padding id, or vocabulary-padding rows beyond
      the tokenizer's ids), never sampled: their logits are selected out (`jnp.where`, before
      temperature, top-k and top-p) and they get log-prob OUT_OF_SUPPORT, and the learner
      selects their output-head columns to 0 before the logits matmul, so a NaN or inf stored in
      such a row of a tied embedding reaches no log-prob or gradient. Must not hold an id the
      policy has to produce (a stop id). Each id >= 0 (and < the vocabulary size, checked by the
      sampler engine). Default () = none.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  greedy: bool = False
  excluded_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if not self.temperature > 0:
      raise ValueError(f"SamplingConfig.temperature={self.temperature} must be > 0.")
    if self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k={self.top_k} must be >= 0 (0 = off).")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingConfig.top_p={self.top_p} must be in (0, 1].")
    ids = tuple(int(i) for i in self.excluded_ids)
    if any(i < 0 for i in ids):
      raise ValueError(f"SamplingConfig.excluded_ids={self.excluded_ids}: ids must be >= 0.")
    object.__setattr__(self, "excluded_ids", tuple(sorted(set(ids))))


def excluded_mask(vocab: int, cfg: SamplingConfig) -> jax.Array | None:
  """bool [V], True at `cfg.excluded_ids` (a constant), or None when none are excluded."""
  if not cfg.excluded_ids:
    return None
  return jnp.isin(jnp.arange(vocab, dtype=jnp.int32), jnp.asarray(cfg.excluded_ids, jnp.int32))


def nonfinite_columns(head_EV: jax.Array) -> jax.Array:
  """bool [V]: True where column v of the output head holds a NaN or an inf (gradient stopped).

  Such an id can only produce a non-finite logit, so it is blocked (`blocked_ids`). Cost: one
  elementwise test and one reduction over the E x V head (no matmul), per call.

  Args:
    head_EV: float [E, V] output projection (the transposed embedding when tied).

  Raises:
    ValueError: if head_EV is not 2-D.
  """
  if head_EV.ndim != 2:
    raise ValueError(f"nonfinite_columns: head {head_EV.shape} must be [E, V].")
  return ~jnp.all(jnp.isfinite(jax.lax.stop_gradient(head_EV)), axis=0)


def nonfinite_ids(head_EV: jax.Array) -> tuple[int, ...]:
  """The ids whose output-head column holds a NaN or an inf, read to the host (sorted).

  One reduction over the [E, V] head and one [V] bool transfer: for set-up (the learner calls
  it when its params are set), not for a step path.

  Raises:
    ValueError: if head_EV is not 2-D.
  """
  return tuple(int(i) for i in np.flatnonzero(np.asarray(jax.device_get(
      nonfinite_columns(head_EV)))))


def blocked_ids(vocab: int, cfg: SamplingConfig, nonfinite_V: jax.Array | None = None
                ) -> jax.Array | None:
  """bool [V], True at the ids never sampled: `cfg.excluded_ids` (a constant) or the ids whose
  head column is non-finite (`nonfinite_V`, bool [V], from `nonfinite_columns`); None when
  neither applies."""
  excluded = excluded_mask(vocab, cfg)
  if nonfinite_V is None:
    return excluded
  if nonfinite_V.shape != (vocab,):
    raise ValueError(f"nonfinite_V {nonfinite_V.shape} must be [{vocab}].")
  return nonfinite_V if excluded is None else excluded | nonfinite_V


def processed_logprobs(logits_V: jax.Array, cfg: SamplingConfig,
                       nonfinite_V: jax.Array | None = None) -> jax.Array:
  """Log-probs of the distribution actually sampled from, over the last axis.

  Args:
    logits_V: float logits [..., V] (any leading shape).
    cfg: sampling configuration (static).
    nonfinite_V: optional bool [V], ids whose head column is non-finite
      (`nonfinite_columns`): blocked like `cfg.excluded_ids`. None = none.

  Returns:
    float32 [..., V] normalised log-probs; out-of-support entries are `OUT_OF_SUPPORT`.
  """
  x = logits_V.astype(jnp.float32)
  vocab = x.shape[-1]
  excluded = blocked_ids(vocab, cfg, nonfinite_V)
  if excluded is not None:  # selected out: whatever those logits hold (NaN included)
    x = jnp.where(excluded, jnp.float32(OUT_OF_SUPPORT), x)
  if cfg.greedy:
    best = jnp.argmax(x, axis=-1)
    return jnp.where(jax.nn.one_hot(best, vocab, dtype=bool), jnp.float32(0.0),
                     jnp.float32(OUT_OF_SUPPORT))
  x = x / cfg.temperature
  if 0 < cfg.top_k < vocab:
    kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
    x = jnp.where(x >= kth, x, OUT_OF_SUPPORT)
  if cfg.top_p < 1.0:
    x = jnp.where(top_p_support(jax.lax.stop_gradient(x), cfg.top_p), x, OUT_OF_SUPPORT)
  logp = jax.nn.log_softmax(x, axis=-1)
  return jnp.maximum(logp, OUT_OF_SUPPORT)


def top_p_support(x_V: jax.Array, top_p: float) -> jax.Array:
  """The nucleus of top-p sampling: the smallest set of most likely tokens whose mass reaches
  `top_p`, cut by sorted position (Holtzman et al. 2020, "The Curious Case of Neural Text
  Degeneration", Sec. 3.1; as HF's TopPLogitsWarper and vLLM cut it).

  Tokens are ranked by value, ties by lower token id first (a deterministic rule, so the sampler
  and the learner get the same set from the same logits). The token at rank i is kept iff the
  mass of the tokens ranked before it is < top_p, so the rank-0 token is always kept and tokens
  tied with the last kept one are kept only up to that rank, never all of them (a value
  threshold would keep every tie, e.g. of bf16-rounded logits, and widen the set).

  Cost: one sort over the last axis, a softmax, two cumulative sums; no gather back to vocab
  order (the kept set is "value above the cut-off value, or tied with it and among the first
  ties by id").

  Args:
    x_V: float32 [..., V] scaled logits (entries outside an earlier support may be
      `OUT_OF_SUPPORT`; they carry no mass).
    top_p: nucleus mass in (0, 1].

  Returns:
    bool [..., V], True on the kept tokens (at least one per row).
  """
  sorted_desc = -jnp.sort(-x_V, axis=-1)
  probs = jax.nn.softmax(sorted_desc, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  # Kept ranks: a count (>= 1: mass_before is 0 at rank 0), so a rounding wiggle in the cumsum
  # cannot leave a hole.
  n_keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True, dtype=jnp.int32)
  cutoff = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
  above = x_V > cutoff
  tied = x_V == cutoff
  tie_slots = n_keep - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
  return above | (tied & (jnp.cumsum(tied, axis=-1, dtype=jnp.int32) <= tie_slots))


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


def sample(rng: jax.Array, logits_BV: jax.Array, cfg: SamplingConfig,
           nonfinite_V: jax.Array | None = None):
  """Draws one token per row and returns its behaviour log-prob.

  Args:
    rng: PRNG key.
    logits_BV: float [B, V] next-token logits.
    cfg: sampling configuration.
    nonfinite_V: optional bool [V] ids never drawn (non-finite head columns), as in
      `processed_logprobs`.

  Returns:
    (tokens int32 [B], logprobs float32 [B]) with logprobs under `processed_logprobs`.
  """
  logp = processed_logprobs(logits_BV, cfg, nonfinite_V)
  if cfg.greedy:
    tokens = jnp.argmax(logp, axis=-1)
  else:
    tokens = jax.random.categorical(rng, logp, axis=-1)
  tokens = tokens.astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def _chunk_logprobs(h_BCE, head_EV, targets_BC, cfg: SamplingConfig, constrain, bias_V):
  """Log-prob of each target under the processed distribution of one chunk's logits, and the
  distribution's entropy (gradient stopped). float32 [B, C] each.

  `bias_V` (float32 [V] or None) is OUT_OF_SUPPORT at the blocked ids and 0.0 elsewhere; their
  head columns are already 0 (`next_token_logprobs`), so their logits are exactly 0 and the sum
  is exactly OUT_OF_SUPPORT there and the logit itself (x + 0.0) everywhere else: the values a
  select gives (the sampler's `processed_logprobs`), at the cost of an add that fuses into the
  log-softmax (a select over [B, C, V] did not on XLA:CPU: +43 % bytes accessed measured)."""
  logits = jnp.einsum("bce,ev->bcv", h_BCE.astype(jnp.float32), head_EV.astype(jnp.float32))
  logits = constrain(logits, ("batch", "length", "vocab"))
  if bias_V is not None:
    logits = logits + bias_V[None, None, :]
  logp_all = processed_logprobs(logits, cfg)
  # A select-and-sum over V instead of a gather: with V split over tensor-parallel devices it
  # reduces to a [B, C] all-reduce, never an all-gather of the logits.
  hit = jnp.arange(logp_all.shape[-1], dtype=jnp.int32)[None, None, :] == targets_BC[..., None]
  logp = jnp.sum(jnp.where(hit, logp_all, 0.0), axis=-1)
  return logp, entropy(jax.lax.stop_gradient(logp_all))


def _chunked(h_BTE, head_EV, targets_BT, cfg, chunk_len, constrain, bias_V):
  """`_chunk_logprobs` over T in chunks of `chunk_len` (scan, rematerialised body)."""
  b, t, e = h_BTE.shape
  if chunk_len is None or chunk_len >= t:
    return _chunk_logprobs(h_BTE, head_EV, targets_BT, cfg, constrain, bias_V)
  n = -(-t // chunk_len)
  pad = n * chunk_len - t
  h = jnp.pad(h_BTE, ((0, 0), (0, pad), (0, 0)))
  tg = jnp.pad(targets_BT, ((0, 0), (0, pad)))
  h = jnp.swapaxes(h.reshape(b, n, chunk_len, e), 0, 1)  # [n, B, C, E]
  tg = jnp.swapaxes(tg.reshape(b, n, chunk_len), 0, 1)
  body = jax.checkpoint(
      lambda hc, tc: _chunk_logprobs(hc, head_EV, tc, cfg, constrain, bias_V))
  _, (logp, ent) = jax.lax.scan(lambda c, x: (c, body(*x)), None, (h, tg))
  unchunk = lambda x: jnp.swapaxes(x, 0, 1).reshape(b, n * chunk_len)[:, :t]
  return unchunk(logp), unchunk(ent)


def next_token_logprobs(h_BTE: jax.Array, head_EV: jax.Array, tokens_BT: jax.Array,
                        cfg: SamplingConfig, *, chunk_len: int | None = None,
                        batch_groups: int = 1, constrain=None,
                        block_nonfinite: bool = True) -> tuple[jax.Array, jax.Array]:
  """log pi(token t | tokens < t) and the entropy at t - 1, from hidden states, in chunks.

  The logits at t - 1 (fp32: h @ head) go through `processed_logprobs`, exactly as in the
  sampler; ids whose head column is non-finite (`nonfinite_columns`, computed once per call,
  outside the chunk loop) and `cfg.excluded_ids` are blocked as the sampler blocks them (log-prob
  OUT_OF_SUPPORT, the same values) and their head columns selected to 0. With `chunk_len`, positions are processed `chunk_len` at a time in a `lax.scan`
  whose body is rematerialised (`jax.checkpoint`): the forward keeps only [B, T] results and
  the backward recomputes each chunk's logits, so no [B, T, V] array is ever held (peak
  logits memory ~ [B, chunk_len, V] fp32 instead of [B, T, V]; the idea of the chunked /
  "fused" cross-entropy losses of large-vocabulary trainers).

  With `batch_groups` G > 1 the rows are split into G groups computed under `jax.vmap`, the
  group axis constrained to the "batch" logical axis: with rows sharded over G devices each
  device then accumulates the head's gradient over all chunks for its own rows only (a [G, E, V]
  carry split over G) and the cross-device sum happens once, after the last chunk, instead of
  once per chunk.

  Args:
    h_BTE: [B, T, E] final (normalised) hidden states, any float dtype.
    head_EV: [E, V] output projection (the transposed embedding when tied).
    tokens_BT: int32 [B, T] token ids.
    cfg: the sampler's SamplingConfig.
    chunk_len: positions per chunk (>= 1); None = one chunk, no remat (the naive
      full-logits computation). T is padded up to a multiple of it internally.
    batch_groups: G >= 1 row groups (the number of devices rows are split over); must divide
      B, else 1 is used.
    constrain: optional `constrain(x, logical_axes) -> x` sharding hook (logical names
      batch, length, embed, vocab); None = no constraint.
    block_nonfinite: find and block non-finite head columns in this call (default). The
      learner passes False: it finds them once on the host when its params are set
      (`Learner`, `nonfinite_ids`) and names them in `cfg.excluded_ids`, so on finite weights
      its step program is exactly the unmasked one (no per-call reduction over the head).

  Returns:
    (logp_BT float32, differentiable; entropy_BT float32 nats, gradient stopped). Position 0
    has no predecessor and gets 0 in both.

  Raises:
    ValueError: on shape mismatch or chunk_len < 1.
  """
  if h_BTE.ndim != 3 or tokens_BT.shape != h_BTE.shape[:2] or head_EV.shape[0] != h_BTE.shape[2]:
    raise ValueError(f"hidden {h_BTE.shape}, head {head_EV.shape}, tokens {tokens_BT.shape}: "
                     "need [B, T, E], [E, V], [B, T].")
  if chunk_len is not None and chunk_len < 1:
    raise ValueError(f"chunk_len={chunk_len} must be >= 1 or None.")
  constrain = constrain or (lambda x, *_, **__: x)
  b, t, e = h_BTE.shape
  blocked = blocked_ids(head_EV.shape[1], cfg,
                       nonfinite_columns(head_EV) if block_nonfinite else None)
  bias = None
  if blocked is not None:  # once per call, outside the chunk loop: their columns never meet h
    # (no 0 * NaN in the backward pass), and their logits get OUT_OF_SUPPORT by an add
    head_EV = jnp.where(blocked[None, :], jnp.zeros((), head_EV.dtype), head_EV)
    bias = jnp.where(blocked, jnp.float32(OUT_OF_SUPPORT), jnp.float32(0.0))
    cfg = dataclasses.replace(cfg, excluded_ids=())  # applied by the bias
  targets = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros((b, 1), tokens_BT.dtype)], axis=1)
  if batch_groups > 1 and b % batch_groups == 0:
    g = batch_groups
    h = constrain(h_BTE.reshape(g, b // g, t, e), ("batch", None, "length", "embed"))
    tg = constrain(targets.reshape(g, b // g, t), ("batch", None, "length"))
    # One copy of the head per group (each device already holds the gathered head, so this is
    # local): its cotangent is then per group, accumulated locally over the chunks, and summed
    # over the groups once, by the transpose of this broadcast.
    head = constrain(jnp.broadcast_to(head_EV, (g,) + head_EV.shape), ("batch", "embed", "vocab"))
    no_constraint = lambda x, *_, **__: x  # the vmapped group axis must stay split
    logp, ent = jax.vmap(
        lambda hg, wg, tgg: _chunked(hg, wg, tgg, cfg, chunk_len, no_constraint, bias)
    )(h, head, tg)
    logp, ent = (constrain(x.reshape(b, t), ("batch", "length")) for x in (logp, ent))
  else:
    logp, ent = _chunked(h_BTE, head_EV, targets, cfg, chunk_len, constrain, bias)
  zero = jnp.zeros((b, 1), jnp.float32)
  return (jnp.concatenate([zero, logp[:, :-1]], axis=1),
          jnp.concatenate([zero, ent[:, :-1]], axis=1))


def next_token_logprobs_from_logits(logits_BTV: jax.Array, tokens_BT: jax.Array,
                                    cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
  """`next_token_logprobs` from full logits [B, T, V] (for models without hidden states).

  Returns:
    (logp_BT float32, entropy_BT float32 with gradient stopped); position 0 gets 0 in both.

  Raises:
    ValueError: if logits are not [B, T, V] over the tokens' [B, T].
  """
  if logits_BTV.ndim != 3 or tokens_BT.shape != logits_BTV.shape[:2]:
    raise ValueError(f"logits {logits_BTV.shape} vs tokens {tokens_BT.shape}: need [B, T, V], "
                     "[B, T].")
  logp_all = processed_logprobs(logits_BTV[:, :-1], cfg)
  hit = (jnp.arange(logp_all.shape[-1], dtype=jnp.int32)[None, None, :]
         == tokens_BT[:, 1:, None])
  logp = jnp.sum(jnp.where(hit, logp_all, 0.0), axis=-1)
  ent = entropy(jax.lax.stop_gradient(logp_all))
  zero = jnp.zeros((tokens_BT.shape[0], 1), jnp.float32)
  return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, ent], axis=1)
