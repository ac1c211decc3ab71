"""Mixture-of-experts shapes in the cost model: active vs total parameters, experts read per
decode step, and the simulator's what-if on an MoE shape."""

import itertools

import numpy as np
import pytest

from rlax_pipe import costs
from rlax_pipe.sim import whatif


def _brute_force_hit(x, k, b):
  """E[# distinct experts] over every equally likely k-subset choice of b tokens (exact)."""
  subsets = list(itertools.combinations(range(x), k))
  total = 0
  for choice in itertools.product(subsets, repeat=b):
    total += len(set().union(*choice))
  return total / len(subsets) ** b


@pytest.mark.parametrize("x,k,b", [(5, 2, 1), (5, 2, 3), (6, 3, 2), (4, 1, 4), (4, 4, 2)])
def test_expected_experts_hit_matches_enumeration(x, k, b):
  assert costs.expected_experts_hit(x, k, b) == pytest.approx(_brute_force_hit(x, k, b),
                                                              rel=1e-12)


def test_expected_experts_hit_limits_and_errors():
  assert costs.expected_experts_hit(128, 8, 0) == 0.0
  assert costs.expected_experts_hit(128, 8, 1) == pytest.approx(8.0)
  assert costs.expected_experts_hit(128, 8, 10_000) == pytest.approx(128.0)
  with pytest.raises(ValueError, match="experts_per_tok"):
    costs.expected_experts_hit(4, 5, 1)
  with pytest.raises(ValueError, match="tokens"):
    costs.expected_experts_hit(4, 2, -1)


def test_published_moe_shapes_active_and_total():
  q = costs.QWEN3_30B_A3B_SHAPE
  # per layer: attention 2*2048*32*128 + 2*2048*4*128, router 2048*128, expert 3*2048*768.
  attn, router, expert = 2 * 2048 * 4096 + 2 * 2048 * 512, 2048 * 128, 3 * 2048 * 768
  head = 2048 * 151936
  assert q.matmul_params == 48 * (attn + router + 8 * expert) + head
  assert q.stored_matmul_params == 48 * (attn + router + 128 * expert) + head
  assert q.weight_bytes == 2 * (q.stored_matmul_params + head)
  assert q.expert_bytes == 2 * 48 * 128 * expert
  assert q.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
  # The model card: 30.5B total, 3.3B activated.
  assert q.weight_bytes / 2 / 1e9 == pytest.approx(30.5, abs=0.05)
  assert (q.matmul_params + head) / 1e9 == pytest.approx(3.3, abs=0.06)
  g = costs.GPT_OSS_20B_SHAPE
  # The model card: 21B total (20.9), 3.6B active (one of the two E x V matrices counted).
  assert g.weight_bytes / 2 / 1e9 == pytest.approx(20.9, abs=0.1)
  assert g.matmul_params / 1e9 == pytest.approx(3.6, abs=0.05)
  # 12 full-attention layers per token; 12 sliding layers read at most 128 tokens per slot.
  assert g.kv_bytes_per_token == 12 * 2 * 8 * 64 * 2
  assert g.window_kv_bytes_per_slot == 12 * 128 * 2 * 8 * 64 * 2


def test_moe_decode_reads_the_experts_its_tokens_hit():
  q = costs.QWEN3_30B_A3B_SHAPE
  m = costs.analytic_cost_model(q, "H200", sampler_tp=1, learner_devices=8, train_row_len=4096)
  bw = 4.8e12 * 0.8
  assert m.decode_step_s == pytest.approx((q.weight_bytes - q.expert_bytes) / bw, rel=1e-12)
  assert m.expert_step_s == pytest.approx(q.expert_bytes / bw, rel=1e-12)
  for b in (1, 4, 64):
    step = costs.EngineStep(dispatches=1, decode_steps=1, slot_steps=b, live_token_steps=0)
    _, rest = m.engine_step(step)
    hit = costs.expected_experts_hit(128, 8, b) / 128
    want = (m.engine_step_s + m.dispatch_s + m.decode_step_s
            + m.expert_step_s * hit)
    assert rest == pytest.approx(want, abs=2 ** -30)  # quantized to 2^-30 s
  # One slot reads k/X = 1/16 of the experts; 64 slots nearly all of them.
  assert costs.expected_experts_hit(128, 8, 64) / 128 > 0.98
  # The learner multiplies through active params; the optimizer walks all of them.
  assert m.train_token_s == pytest.approx(
      (6 * q.matmul_params + q.attn_flops_per_token_per_ctx * 4096) / (8 * 989.5e12 * 0.4),
      rel=1e-12)
  assert m.flop_slot_step_s == pytest.approx(2 * q.matmul_params / (989.5e12 * 0.5), rel=1e-12)
  dense_like = costs.analytic_cost_model(
      costs.ModelShape(q.matmul_params, q.weight_bytes, q.kv_bytes_per_token,
                       q.attn_flops_per_token_per_ctx), "H200", sampler_tp=1,
      learner_devices=8, train_row_len=4096)
  assert m.train_step_s > dense_like.train_step_s  # 30.5B, not 3.3B, parameters updated


def test_moe_decode_run_equals_engine_steps_exactly():
  m = costs.analytic_cost_model(costs.GPT_OSS_20B_SHAPE, "H100", sampler_tp=1,
                                learner_devices=8, train_row_len=2048)
  assert m.slot_step_s > 0 and m.expert_step_s > 0
  run = m.decode_run(5, active=7, live0=100, installs_first=1, steps=4)
  for j in range(5):
    live = 4 * (100 + 7 * 4 * j) + 7 * 4 * 3 // 2
    _, rest = m.engine_step(costs.EngineStep(installs=int(j == 0), dispatches=1, decode_steps=4,
                                             slot_steps=28, live_token_steps=live))
    assert run[j] == rest


def test_cost_model_rejects_inconsistent_moe_fields():
  with pytest.raises(ValueError, match="moe_top_k"):
    costs.CostModel(expert_step_s=1e-3, moe_experts=4, moe_top_k=0)
  with pytest.raises(ValueError, match="n_experts"):
    costs.ModelShape.from_dims(vocab_size=8, d_model=4, n_layers=1, n_heads=1, n_kv_heads=1,
                               head_dim=4, d_ff=4, tie_embeddings=True, param_bytes=2,
                               kv_bytes=2, n_experts=2, experts_per_tok=3, moe_d_ff=4,
                               moe_layers=1)


def test_whatif_on_an_moe_shape_sizes_the_learner_by_total_params():
  c = whatif.Cluster(num_devices=64, chip="H200", model=costs.QWEN3_30B_A3B_SHAPE)
  assert c.shape is costs.QWEN3_30B_A3B_SHAPE
  want = -(-16 * costs.QWEN3_30B_A3B_SHAPE.stored_matmul_params // (0.7 * 141e9))
  assert whatif.min_learner_devices(c) == want
  assert whatif.costs(c, 8).expert_step_s > 0
  assert whatif.engine_slots(c) >= 1


def test_model_shape_of_an_moe_model_config_matches_the_published_dims():
  got = costs.ModelShape.of(costs.QWEN3_30B_A3B, "qwen3-30b-a3b")
  assert got == costs.QWEN3_30B_A3B_SHAPE
  c = whatif.Cluster(num_devices=64, chip="H200", model=costs.QWEN3_30B_A3B)
  assert c.shape.expert_bytes == costs.QWEN3_30B_A3B_SHAPE.expert_bytes


def test_learner_mfu_counts_active_params_of_an_moe():
  from rlax_pipe.learner import flops  # pylint: disable=g-import-not-at-top
  q = costs.QWEN3_30B_A3B
  assert flops.matmul_params(q) == costs.QWEN3_30B_A3B_SHAPE.matmul_params
  assert flops.matmul_params(costs.LLAMA_3_8B) == costs.ModelShape.of(
      costs.LLAMA_3_8B).matmul_params  # dense: unchanged


def test_gpt_oss_20b_preset_is_its_config_json_and_has_the_cost_shape():
  """costs.GPT_OSS_20B equals what the HF reader makes of gpt-oss-20b's config.json fields (as
  published: MXFP4 experts, YaRN, sinks, alternating windows), and its cost shape is
  GPT_OSS_20B_SHAPE (active / total params, windowed KV) field for field."""
  import dataclasses
  from rlax_pipe.model import hf_config
  hf = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
        "rms_norm_eps": 1e-5, "rope_theta": 150000, "attention_bias": True,
        "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "max_position_embeddings": 131072, "initial_context_length": 4096,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "torch_dtype": "bfloat16", "hidden_act": "silu", "router_aux_loss_coef": 0.9}
  got = hf_config.config_from_hf(hf, param_dtype="bfloat16")
  want = costs.GPT_OSS_20B
  assert dataclasses.replace(got, compute_dtype=want.compute_dtype,
                             eos_token_ids=want.eos_token_ids) == want
  shape = costs.ModelShape.of(costs.GPT_OSS_20B, "gpt-oss-20b")
  assert shape == costs.GPT_OSS_20B_SHAPE
