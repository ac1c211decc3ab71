"""Claim (c) on a large real vocabulary: the bf16-sampler / fp32-learner log-prob mismatch.

The tiny arithmetic policy (278-token vocabulary) has a bf16 mismatch of ~0.002 nats per token,
4 orders of magnitude below its staleness mismatch (WORKSPACE_NOTES.md, issue 16). Yao et al.
2025 see the mismatch matter on large vocabularies and long completions. This measures it on a
reduced-depth Qwen3 shape (Qwen3-0.6B's width, heads, qk-norm and its 151,936-token vocabulary,
`n_layers` layers), random-initialised with the logit scale set so that the fp32 policy's
per-token entropy is `target_entropy` nats (a trained model's, not a random one's ~log V):

  draw tokens from the bfloat16-compute model's processed distribution (the behaviour log-probs
  the sampler would record), score the same tokens with the float32 model (the learner), and
  report per token: mean |log pi - log mu|, the ratio
  r = pi / mu's variance, the fraction with r > c for c in (2, 5) (what TIS would truncate) and
  with r < 0.5, ESS, and the fp32 entropy. No weights are downloaded.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe import offpolicy
from rlax_pipe.config import ModelConfig
from rlax_pipe.model import Transformer
from rlax_pipe.model import transformer

QWEN3_VOCAB = 151936


def qwen3_reduced(n_layers: int = 1, max_seq_len: int = 160) -> ModelConfig:
  """Qwen3-0.6B's shape (d 1024, 16 q / 8 kv heads of 128, d_ff 3072, qk-norm, tied
  embeddings, vocab 151,936, rope theta 1e6) with `n_layers` layers."""
  return ModelConfig(vocab_size=QWEN3_VOCAB, d_model=1024, n_layers=n_layers, n_heads=16,
                     n_kv_heads=8, head_dim=128, d_ff=3072, rope_theta=1e6, qk_norm=True,
                     tie_embeddings=True, max_seq_len=max_seq_len)


def measure(cfg: ModelConfig, rows: int = 2, positions: int = 32, temperature: float = 1.0,
            target_entropy: float = 2.0, seed: int = 0) -> dict:
  """The mismatch statistics of the module docstring (JSON-ready dict).

  Contexts are random token sequences [rows, positions]; at every position t the bf16 model's
  processed next-token distribution mu(.|s_t) is computed in one parallel forward pass, a token
  a_t ~ mu is drawn, and the fp32 model scores log pi(a_t|s_t) in a second pass (per-token
  mismatch for given contexts; the contexts are not self-generated, which keeps the cost at two
  forward passes instead of one per token).
  """
  t0 = time.perf_counter()
  params = transformer.init_params(cfg, jax.random.key(seed))
  fp32 = Transformer(cfg)
  bf16 = fp32.with_compute_dtype("bfloat16")
  sampling = logprobs_lib.SamplingConfig(temperature=temperature)
  rng = np.random.default_rng(seed)
  ctx = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(rows, positions)).astype(np.int32))
  pos = jnp.broadcast_to(jnp.arange(positions), (rows, positions))
  base = params["embed"]

  @jax.jit
  def dists(p, scale):
    p = dict(p, embed=p["embed"] * scale)
    mu = jax.vmap(jax.vmap(lambda l: logprobs_lib.processed_logprobs(l, sampling)))(
        bf16.forward(p, ctx, pos)[0].astype(jnp.float32))
    pi = jax.vmap(jax.vmap(lambda l: logprobs_lib.processed_logprobs(l, sampling)))(
        fp32.forward(p, ctx, pos)[0].astype(jnp.float32))
    ent = -jnp.mean(jnp.sum(jnp.exp(pi) * pi, -1))
    return mu, pi, ent

  lo, hi = 1.0, 256.0  # the fp32 entropy falls as the tied embedding's scale grows
  for _ in range(8):
    mid = float(np.sqrt(lo * hi))
    lo, hi = (mid, hi) if float(dists(params, mid)[2]) > target_entropy else (lo, mid)
  scale = float(np.sqrt(lo * hi))
  mu, pi, ent = dists(params, scale)
  a = jax.random.categorical(jax.random.key(seed + 1), mu)  # [rows, positions] ~ mu
  take = lambda x: np.asarray(jnp.take_along_axis(x, a[..., None], -1)[..., 0], np.float64)
  d = take(pi) - take(mu)
  r = np.exp(d)
  return dict(
      shape=dataclasses.asdict(cfg), rows=rows, positions=positions, temperature=temperature,
      embed_scale=scale, fp32_entropy_mean=float(ent),
      abs_logp_mismatch_mean=float(np.abs(d).mean()),
      abs_logp_mismatch_p99=float(np.quantile(np.abs(d), 0.99)),
      abs_logp_mismatch_max=float(np.abs(d).max()), ratio_var=float(r.var()),
      frac_ratio_gt_2=float((r > 2).mean()), frac_ratio_gt_5=float((r > 5).mean()),
      frac_ratio_lt_half=float((r < 0.5).mean()),
      ess=float(offpolicy.normalized_ess(jax.nn.logsumexp(d), jax.nn.logsumexp(2 * d), d.size)),
      tokens=int(r.size),
      seconds=time.perf_counter() - t0)
