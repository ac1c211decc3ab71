"""Qwen3-MoE import / export against transformers' Qwen3MoeForCausalLM on CPU torch.

A tiny random Qwen3-MoE (3 layers, layer 1 dense via mlp_only_layers, 4 experts, top-2) saved
by transformers in both checkpoint layouts (per expert, as published and as save_pretrained
writes; fused gate_up_proj / down_proj, as transformers 5 holds them) is loaded here and run
on a right-padded batch; our export of random params is loaded by transformers. Logits <= 1e-4.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rlax_pipe.config import ModelConfig  # noqa: E402
from rlax_pipe.model import hf_io, transformer  # noqa: E402
# The right-padded parity batch, transformers' logits and the jitted forward of the dense HF tests.
from test_hf_io import LENGTHS, _batch, _forward, _hf_logits  # noqa: E402  pylint: disable=wrong-import-position

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

_HF = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
           max_position_embeddings=64, moe_intermediate_size=16, num_experts=4,
           num_experts_per_tok=2, mlp_only_layers=[1], tie_word_embeddings=False)
OUR_CFG = ModelConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                      head_dim=8, d_ff=48, rms_eps=1e-5, max_seq_len=64, qk_norm=True,
                      tie_embeddings=False, n_experts=4, n_experts_per_tok=2, moe_d_ff=16,
                      mlp_only_layers=(1,), norm_topk_prob=True)


def _hf_model(norm_topk_prob, seed=0):
  torch.manual_seed(seed)
  model = transformers.Qwen3MoeForCausalLM(
      transformers.Qwen3MoeConfig(**_HF, norm_topk_prob=norm_topk_prob)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.3)
  return model




def _compare(params, cfg, model, seed=0):
  tokens, positions, segments, valid = _batch(cfg.vocab_size, seed)
  ours, _ = _forward(params, jnp.asarray(tokens), jnp.asarray(positions), cfg,
                     segment_ids_BT=jnp.asarray(segments))
  theirs = _hf_logits(model, tokens, valid)
  assert np.abs(theirs[valid]).max() > 1.0  # a non-trivial comparison
  err = float(np.abs(np.asarray(ours)[valid] - theirs[valid]).max())
  assert err <= 1e-4, err
  return err


def test_import_both_layouts_matches_transformers(tmp_path):
  model = _hf_model(norm_topk_prob=False)
  model.save_pretrained(tmp_path / "per_expert")
  model.save_pretrained(tmp_path / "fused", save_original_format=False)
  names = json.loads((tmp_path / "per_expert" / "config.json").read_text())
  assert names.get("num_local_experts") == 4  # what transformers 5 writes for num_experts
  cfg, params = hf_io.load_hf_checkpoint(tmp_path / "per_expert")
  assert cfg == OUR_CFG.__class__(**{**OUR_CFG.__dict__, "norm_topk_prob": False})
  assert set(params) == {"embed", "final_norm", "lm_head", "layers", "moe_layers"}
  _compare(params, cfg, model)
  cfg_fused, params_fused = hf_io.load_hf_checkpoint(tmp_path / "fused")
  assert cfg_fused == cfg
  jax.tree.map(np.testing.assert_array_equal, params_fused, params)


def test_export_loads_in_transformers_with_same_logits(tmp_path):
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda path, spec: ((1.0 if path[-1].key.endswith("norm") else 0.0)
                          + rng.normal(0.0, 0.3, spec[0])).astype(np.float32),
      transformer.param_specs(OUR_CFG),
      is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[1], tuple))
  hf_io.save_hf_checkpoint(tmp_path, params, OUR_CFG, max_shard_bytes=20000)
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, dtype=torch.float32, output_loading_info=True)
  assert not any(info.values()), info  # no missing / unexpected / mismatched keys
  assert type(model).__name__ == "Qwen3MoeForCausalLM"
  assert model.config.norm_topk_prob and model.config.mlp_only_layers == [1]
  _compare(params, OUR_CFG, model.eval(), seed=1)
  cfg2, params2 = hf_io.load_hf_checkpoint(tmp_path)  # and back, bit-exact
  assert cfg2 == OUR_CFG
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_moe_config_errors():
  with pytest.raises(ValueError, match="num_experts or num_local_experts"):
    hf_io.config_from_hf({**_HF, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": None})
  with pytest.raises(ValueError, match="router_softmax"):
    hf_io.config_to_hf(ModelConfig(qk_norm=True, n_experts=4, router_softmax="topk"))
