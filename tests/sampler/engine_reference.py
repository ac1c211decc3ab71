"""Set-up shared by the engine tests (test_sampler_engine, test_multi_turn_engine,
test_engine_sinks_windows, test_moe_engine): random weights drawn with numpy (nothing to
compile) and the independent reference for the engine's behaviour log-probs, the full-sequence
forward of the same model, teacher-forced on each rollout's tokens.

Every engine built from the same (model, sampler) configs shares its compiled programs already
(the device loop's programs are module-level jits with static configs); the reference program
here is likewise compiled once per (model config, sampling, rows)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import model
from rlax_pipe.logprobs import token_logprobs


def random_params(cfg, rng, scale):
  """Weights of model `cfg`, every leaf drawn N(0, scale^2) in float32 from the numpy
  generator `rng` (leaf order of `model.abstract_params`; the draws advance `rng`)."""
  return jax.tree.map(lambda a: jnp.asarray(rng.normal(0.0, scale, a.shape).astype(np.float32)),
                      model.abstract_params(cfg))


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"))
def full_logprobs(params, tokens_NL, cfg, sampling):
  """float32 [N, L-1]: log-prob of token t+1 (under `sampling`'s temperature / top-k / top-p)
  after the full-sequence forward over tokens 0..t of int32 `tokens_NL` [N, L]."""
  n, l = tokens_NL.shape
  positions = jnp.broadcast_to(jnp.arange(l)[None], (n, l))
  logits, _ = model.forward(params, tokens_NL, positions, cfg)
  return token_logprobs(logits[:, :-1], tokens_NL[:, 1:], sampling)


def reference_logprobs(params, rollouts, cfg, sampling, rows):
  """Teacher-forced log-probs of each rollout's completion under `params`: a list of float32
  [num_completion_tokens] arrays, in the rollouts' order. The rollouts are padded into batches
  of `rows` rows of `cfg.max_seq_len` tokens (one compiled program per `rows`)."""
  out = []
  for i in range(0, len(rollouts), rows):
    chunk = rollouts[i:i + rows]
    tokens = np.zeros((rows, cfg.max_seq_len), np.int32)
    for row, r in enumerate(chunk):
      seq = np.concatenate([r.prompt_tokens, r.completion_tokens])
      tokens[row, :len(seq)] = seq
    lp = np.asarray(full_logprobs(params, tokens, cfg, sampling))
    out += [lp[row, len(r.prompt_tokens) - 1:][:r.num_completion_tokens]
            for row, r in enumerate(chunk)]
  return out
