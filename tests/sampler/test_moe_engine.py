"""The paged sampler serves MoE layers: every prefill / decode token is routed by its own layer's
router, and the engine's behaviour log-probs equal the full-sequence forward of the same MoE
model (mixed dense / MoE layers, page boundaries, preemptions)."""

import numpy as np

from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine

from engine_reference import random_params, reference_logprobs  # this directory

MOE = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=48, max_seq_len=32, n_experts=4, n_experts_per_tok=2, moe_d_ff=16,
                  mlp_only_layers=(0,))
SAMPLING = SamplingConfig(temperature=0.8)
CFG = SamplerConfig(num_slots=4, page_size=4, num_pages=10, max_seq_len=32, max_new_tokens=12,
                    min_prefill_bucket=16, prefill_rows=2, sampling=SAMPLING)


def test_moe_engine_matches_full_forward():
  rng = np.random.default_rng(0)
  params = random_params(MOE, rng, 0.4)
  engine = SamplerEngine(MOE, CFG, params)
  requests = [Request(prompt_tokens=rng.integers(0, MOE.vocab_size, n), sample_id=i,
                      group_id=i, prompt_index=i, max_new_tokens=12)
              for i, n in enumerate((1, 5, 9, 14, 3, 17))]
  for r in requests:
    engine.submit(r)
  rollouts = engine.run_to_completion()
  assert sorted(r.sample_id for r in rollouts) == list(range(6))
  refs = reference_logprobs(params, rollouts, MOE, SAMPLING, rows=8)
  err = max(float(np.abs(r.behavior_logprobs - ref).max()) for r, ref in zip(rollouts, refs))
  assert err < 1e-5, err
  assert sum(r.num_completion_tokens for r in rollouts) >= 50
