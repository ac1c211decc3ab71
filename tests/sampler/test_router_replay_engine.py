"""Router replay end to end on a tiny MoE (fp32): the paged sampler records, per generated
token, the experts of the decode step that produced it; packed into a batch and replayed by the
learner's forward, the learner's log-probs equal the sampler's behaviour log-probs to fp32
rounding, and corrupting the routes changes them (the replay is used)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe import router_replay
from rlax_pipe.config import ModelConfig
from rlax_pipe.model import transformer
from rlax_pipe.pipeline import batching
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine

MOE = ModelConfig(vocab_size=48, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16,
                  d_ff=48, n_experts=6, n_experts_per_tok=2, moe_d_ff=24, mlp_only_layers=(1,),
                  max_seq_len=32)
CFG = SamplerConfig(num_slots=4, page_size=4, num_pages=24, max_seq_len=32, max_new_tokens=10)


# One program for both calls (not eager op by op); LLVM -O0: compile-bound, same values.
@functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
def _logprobs(params, tokens, positions, segment_ids, routes):
  logits, _ = transformer.forward(params, tokens, positions, MOE, segment_ids_BT=segment_ids,
                                  routes_BTLk=routes)
  return logprobs_lib.next_token_logprobs_from_logits(logits, tokens, CFG.sampling)[0]


def _learner_logprobs(params, batch, routes):
  return np.asarray(_logprobs(params, jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
                              jnp.asarray(batch.segment_ids), jnp.asarray(routes, jnp.int32)))


def test_replayed_routes_reproduce_the_sampler_logprobs():
  params = transformer.init_params(MOE, jax.random.key(3))
  engine = SamplerEngine(MOE, CFG, params)
  rng = np.random.default_rng(0)
  for i in range(4):
    engine.submit(Request(prompt_tokens=rng.integers(1, MOE.vocab_size, 3 + 2 * i), sample_id=i,
                          group_id=0))
  rollouts = engine.run_to_completion()
  assert len(rollouts) == 4
  for r in rollouts:
    assert r.routes.dtype == np.int8  # 6 experts
    assert r.routes.shape == (r.num_completion_tokens, 2, 2)  # 2 MoE layers (layer 1 dense)
  batch = batching.pack_rollouts(rollouts, np.zeros(4), seq_len=32)
  mask = batch.loss_mask > 0
  got = _learner_logprobs(params, batch, batch.routes)
  np.testing.assert_allclose(got[mask], batch.behavior_logprobs[mask], atol=2e-5)
  # the replay is what the learner used: other experts at the recorded positions change them
  fed = batch.routes >= 0  # [B, L, L_moe, k]: the positions with recorded routes
  assert np.any(fed)
  wrong = np.where(fed, (batch.routes + 1) % MOE.n_experts, router_replay.NO_ROUTE)
  other = _learner_logprobs(params, batch, wrong)
  assert np.max(np.abs(other[mask] - batch.behavior_logprobs[mask])) > 1e-3
