"""GPT-OSS parity with transformers' GptOssForCausalLM on a tiny random config: import (dense and
MXFP4 experts), export reloaded by transformers, cached decode == full forward, YaRN rope."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rlax_pipe.model import hf_io, mxfp4, rotary, transformer  # noqa: E402
from rlax_pipe.model.kv_cache import DenseKVCache  # noqa: E402

# The tests' programs are tiny and compile-bound: LLVM at -O0 compiles them faster and
# computes the same values (no fast-math either way).
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

HF_CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                 num_experts_per_tok=2, sliding_window=3, max_position_embeddings=64,
                 tie_word_embeddings=False, attention_bias=True)
T = 11


def _hf_model(seed=0):
  torch.manual_seed(seed)
  cfg = transformers.GptOssConfig(**HF_CONFIG)
  cfg._attn_implementation = "eager"
  model = transformers.GptOssForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      scale = 1.0 if "norm" in name else 0.3
      p.copy_(torch.randn_like(p) * scale + (1.0 if "norm" in name else 0.0))
  return model


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.numpy()


def _ours(params, cfg, tokens):
  pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).astype(np.int32)
  logits, _ = jit(lambda p, t: transformer.forward(p, t, jnp.asarray(pos), cfg))(
      params, jnp.asarray(tokens, jnp.int32))
  return np.asarray(logits)


TOKENS = np.random.default_rng(0).integers(0, 64, (2, T))


def test_import_matches_transformers_and_cached_decode_matches_full_forward(tmp_path):
  model = _hf_model()
  assert model.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
  model.save_pretrained(tmp_path)
  cfg, params = hf_io.load_hf_checkpoint(tmp_path)
  assert cfg.attention_sinks and cfg.sliding_window == 3 and cfg.expert_activation == "gpt_oss"
  ours = _ours(params, cfg, TOKENS)
  err = np.abs(ours - _hf_logits(model, TOKENS)).max()
  assert err <= 1e-4, err
  cache = DenseKVCache.init(cfg.n_layers, 2, 16, cfg.n_kv_heads, cfg.head_dim)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
  step = jit(lambda p, t, q, c: transformer.forward(p, t, q, cfg, cache=c))
  logits, cache = step(params, jnp.asarray(TOKENS[:, :4]), pos[:, :4], cache)
  outs = [logits]
  for t in range(4, T):
    logits, cache = step(params, jnp.asarray(TOKENS[:, t:t + 1]), pos[:, t:t + 1], cache)
    outs.append(logits)
  decode_err = np.abs(np.concatenate(outs, axis=1) - ours).max()
  assert decode_err <= 1e-4, decode_err  # same budget as the parity with transformers


def test_export_is_loaded_by_transformers(tmp_path):
  model = _hf_model(1)
  model.save_pretrained(tmp_path / "src")
  cfg, params = hf_io.load_hf_checkpoint(tmp_path / "src")
  rng = np.random.default_rng(1)  # fresh weights of our own, so nothing is copied through
  params = jax.tree.map(lambda a: (rng.normal(size=a.shape) * 0.3).astype(np.float32), params)
  hf_io.save_hf_checkpoint(tmp_path / "out", params, cfg)
  assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gpt_oss"
  reloaded = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "out",
                                                           attn_implementation="eager").eval()
  err = np.abs(_ours(params, cfg, TOKENS) - _hf_logits(reloaded, TOKENS)).max()
  assert err <= 1e-4, err
  cfg2, params2 = hf_io.load_hf_checkpoint(tmp_path / "out")
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_mxfp4_checkpoint_imports_dequantized(tmp_path):
  """A checkpoint written the way the published gpt-oss ones are: experts as *_blocks/*_scales
  uint8 ([X, out, in/32, 16] / [X, out, in/32]) and quantization_config mxfp4."""
  from safetensors.torch import load_file, save_file
  model = _hf_model(2)
  with torch.no_grad():  # put the experts on the MXFP4 grid, then store them quantized
    for layer in model.model.layers:
      for proj in ("gate_up_proj", "down_proj"):
        w = getattr(layer.mlp.experts, proj)
        blocks, scales = mxfp4.quantize(w.numpy().transpose(0, 2, 1))
        w.copy_(torch.from_numpy(mxfp4.dequantize(blocks, scales).transpose(0, 2, 1).copy()))
  model.save_pretrained(tmp_path)
  tensors = load_file(tmp_path / "model.safetensors")
  for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
    blocks, scales = mxfp4.quantize(tensors.pop(name).numpy().transpose(0, 2, 1))
    tensors[name + "_blocks"] = torch.from_numpy(blocks.reshape(*scales.shape, 16))
    tensors[name + "_scales"] = torch.from_numpy(scales)
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  config = json.loads((tmp_path / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "mxfp4",
                                   "modules_to_not_convert": ["model.layers.*.self_attn",
                                                              "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"]}
  (tmp_path / "config.json").write_text(json.dumps(config))
  cfg, params = hf_io.load_hf_checkpoint(tmp_path, param_dtype="float32")
  err = np.abs(_ours(params, cfg, TOKENS) - _hf_logits(model, TOKENS)).max()
  assert err <= 1e-4, err


def test_gpt_oss_yarn_matches_transformers():
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  hf = transformers.GptOssConfig(head_dim=64)  # the published rope: yarn, factor 32, no truncate
  inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
  scaling = rotary.scaling_from_hf(hf.rope_parameters, hf.max_position_embeddings,
                                   "rope_parameters")
  assert scaling.truncate is False and scaling.beta_fast == 32 and scaling.beta_slow == 1
  ours, our_factor = rotary.inverse_frequencies(64, hf.rope_parameters["rope_theta"], scaling)
  np.testing.assert_allclose(ours, inv.numpy(), rtol=3e-7)
  assert our_factor == pytest.approx(factor, rel=1e-12)
