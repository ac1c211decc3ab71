"""Engine with a GPT-OSS-style model (sinks, sliding-window layers, q/k/v/o biases, biased
clamped-SwiGLU experts): paged decode log-probs equal the full-sequence forward, across page
boundaries, with a window shorter than a page and one loop step per page (so windowed layers
skip whole chunks)."""

import numpy as np

from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine

from engine_reference import random_params, reference_logprobs  # this directory

# GPT-OSS in miniature: sinks, windows, q/k/v/o biases, top-k-softmax router with bias, clamped
# SwiGLU experts with biases (limit 1 so the clamp is active at these scales).
MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=48, max_seq_len=32, qkv_bias=True, o_bias=True, attention_sinks=True,
                    sliding_window=3, layer_types=("sliding_attention", "full_attention",
                                                   "sliding_attention"),
                    n_experts=4, n_experts_per_tok=2, moe_d_ff=16, router_softmax="topk",
                    router_bias=True, expert_bias=True, expert_activation="gpt_oss",
                    swiglu_limit=1.0)
SAMPLING = SamplingConfig(temperature=1.0)
CFG = SamplerConfig(num_slots=4, page_size=4, num_pages=40, max_seq_len=32, max_new_tokens=14,
                    min_prefill_bucket=16, prefill_rows=2, sampling=SAMPLING,
                    attention_chunk_tokens=4)


def test_paged_decode_matches_full_forward_with_sinks_windows_and_experts():
  rng = np.random.default_rng(0)
  params = random_params(MODEL, rng, 0.4)
  engine = SamplerEngine(MODEL, CFG, params)
  assert engine.impl == "reference"
  prompts = [rng.integers(0, 64, n) for n in (1, 5, 9, 13)]
  for i, p in enumerate(prompts):
    engine.submit(Request(prompt_tokens=p, sample_id=i, group_id=i, prompt_index=i,
                          max_new_tokens=14))
  rollouts = engine.run_to_completion()
  err = 0.0
  for r, ref in zip(rollouts, reference_logprobs(params, rollouts, MODEL, SAMPLING, rows=4)):
    assert r.num_completion_tokens == min(14, MODEL.max_seq_len - len(r.prompt_tokens))
    assert ref.shape == (r.num_completion_tokens,)
    err = max(err, float(np.abs(r.behavior_logprobs - ref).max()))
  assert err < 1e-5, err
