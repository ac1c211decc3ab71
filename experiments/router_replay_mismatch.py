"""Sampler / learner log-prob mismatch on a tiny MoE, with and without router replay.

The paged sampler decodes in bf16 and records its routes (`Rollout.routes`); the learner
recomputes the completions' log-probs in fp32 from the same fp32 params, routing each token
itself (replay off) or with the sampler's experts (replay on). Then a few Adam steps of the
completions' negative log-likelihood move the params to versions 1..max_lag and the learner's
log-probs at version v are compared with the sampler's at version 0 (lag = v), again with and
without replay. Reported per setting: mean and max |log pi - log mu| over completion tokens,
mean k3 KL(mu || pi) (Schulman 2020), and the share of recorded (token, MoE layer) routings
whose expert set the learner's own router would pick differently.

  python experiments/router_replay_mismatch.py --out=/tmp/replay_mismatch.json
"""

import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.model import transformer
from rlax_pipe.pipeline import batching
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine

_OUT = flags.DEFINE_string("out", None, "JSON file for the numbers (printed anyway).")
_SAMPLES = flags.DEFINE_integer("samples", 16, "Completions sampled at version 0.")
_MAX_LAG = flags.DEFINE_integer("max_lag", 3, "Learner versions after the sampler's.")
_LR = flags.DEFINE_float("lr", 3e-3, "Adam learning rate of the steps between versions.")
_SEED = flags.DEFINE_integer("seed", 0, "Init and sampling seed.")

MODEL = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=16, d_ff=96, n_experts=8, n_experts_per_tok=2, moe_d_ff=48,
                    max_seq_len=48)


def _learner(params, batch, routes):
  """fp32 log-probs [B, L] and the learner's own routes [B, L, L_moe, k]."""
  logits, _, moe = transformer.forward(
      params, jnp.asarray(batch.tokens), jnp.asarray(batch.positions), MODEL,
      segment_ids_BT=jnp.asarray(batch.segment_ids), return_moe=True,
      routes_BTLk=None if routes is None else jnp.asarray(routes, jnp.int32))
  logp, _ = logprobs_lib.next_token_logprobs_from_logits(
      logits, jnp.asarray(batch.tokens), logprobs_lib.SamplingConfig())
  return np.asarray(logp), np.asarray(moe.routes_BTLk)


def _stats(logp, batch, own_routes):
  m = batch.loss_mask > 0
  d = logp[m] - batch.behavior_logprobs[m]  # log pi - log mu
  fed = np.all(batch.routes >= 0, axis=-1)  # [B, L, L_moe] recorded routings
  flips = np.any(np.sort(own_routes, -1) != np.sort(batch.routes.astype(np.int32), -1), -1)
  return {"mean_abs": float(np.mean(np.abs(d))), "max_abs": float(np.max(np.abs(d))),
          "k3_kl": float(np.mean(np.exp(d) - 1 - d)),
          "route_flip_frac": float(np.mean(flips[fed]))}


def main(_):
  params = jax.jit(lambda: transformer.init_params(MODEL, jax.random.key(_SEED.value)))()
  sampler_model = ModelConfig(**{**MODEL.__dict__, "compute_dtype": "bfloat16"})
  cfg = SamplerConfig(num_slots=8, page_size=8, num_pages=96, max_seq_len=48,
                      max_new_tokens=24, seed=_SEED.value)
  engine = SamplerEngine(sampler_model, cfg, params)
  rng = np.random.default_rng(_SEED.value)
  for i in range(_SAMPLES.value):
    engine.submit(Request(prompt_tokens=rng.integers(1, MODEL.vocab_size, 4 + i % 8),
                          sample_id=i, group_id=i))
  rollouts = engine.run_to_completion()
  batch = batching.pack_rollouts(rollouts, np.zeros(len(rollouts)), seq_len=48)
  mask = jnp.asarray(batch.loss_mask)
  tx = optax.adam(_LR.value)
  opt = tx.init(params)

  @jax.jit
  def sft_step(params, opt):
    def nll(p):
      logits, _ = transformer.forward(p, jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
                                      MODEL, segment_ids_BT=jnp.asarray(batch.segment_ids))
      logp, _ = logprobs_lib.next_token_logprobs_from_logits(
          logits, jnp.asarray(batch.tokens), logprobs_lib.SamplingConfig())
      return -jnp.sum(logp * mask) / jnp.sum(mask)
    g = jax.grad(nll)(params)
    upd, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, upd), opt

  rows = []
  for lag in range(_MAX_LAG.value + 1):
    for mode, routes in (("off", None), ("replay", batch.routes)):
      logp, own = _learner(params, batch, routes)
      rows.append({"lag": lag, "router_replay": mode, **_stats(logp, batch, own)})
      print(json.dumps(rows[-1]))
    params, opt = sft_step(params, opt)
  out = {"model": MODEL.__dict__ | {"rope_scaling": None}, "samples": len(rollouts),
         "completion_tokens": int(batch.loss_mask.sum()), "sampler": "bf16 compute, fp32 params",
         "learner": "fp32", "lr": _LR.value, "rows": rows}
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
