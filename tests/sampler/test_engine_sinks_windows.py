"""Engine with a GPT-OSS-style model (sinks, sliding-window layers, q/k/v/o biases, biased
clamped-SwiGLU experts): paged decode log-probs equal the full-sequence forward, across page
boundaries, with a window shorter than a page and one loop step per page (so windowed layers
skip whole chunks)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import model
from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig, token_logprobs
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine

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


@functools.partial(jax.jit, static_argnames=("cfg",))
def _full_logprobs(params, tokens_NL, cfg):
  n, l = tokens_NL.shape
  positions = jnp.broadcast_to(jnp.arange(l)[None], (n, l))
  logits, _ = model.forward(params, tokens_NL, positions, cfg)
  return token_logprobs(logits[:, :-1], tokens_NL[:, 1:], SAMPLING)


def test_paged_decode_matches_full_forward_with_sinks_windows_and_experts():
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0.0, 0.4, a.shape).astype(np.float32)),
                        model.abstract_params(MODEL))
  engine = SamplerEngine(MODEL, CFG, params)
  assert engine.impl == "reference"
  prompts = [rng.integers(0, 64, n) for n in (1, 5, 9, 13)]
  for i, p in enumerate(prompts):
    engine.submit(Request(prompt_tokens=p, sample_id=i, group_id=i, prompt_index=i,
                          max_new_tokens=14))
  rollouts = engine.run_to_completion()
  tokens = np.zeros((4, MODEL.max_seq_len), np.int32)
  for r in rollouts:
    seq = np.concatenate([r.prompt_tokens, r.completion_tokens])
    tokens[r.sample_id, :len(seq)] = seq
  ref = np.asarray(_full_logprobs(params, tokens, MODEL))
  err = 0.0
  for r in rollouts:
    p = len(r.prompt_tokens)
    assert r.num_completion_tokens == min(14, MODEL.max_seq_len - p)
    err = max(err, float(np.abs(r.behavior_logprobs
                                - ref[r.sample_id, p - 1:p - 1 + r.num_completion_tokens]).max()))
  assert err < 1e-5, err
