"""HF import/export checked against the reference implementation: transformers on CPU torch.

Tiny random Llama / Qwen2 / Qwen3 models (every weight randomised, norms and biases included) are
saved by transformers, loaded by `hf_io`, and run by both implementations on a right-padded batch
of different lengths; exports are loaded back by us (bit-exact) and by transformers (same logits).
"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import numpy as st_numpy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rlax_pipe.config import ModelConfig  # noqa: E402
from rlax_pipe.model import hf_io, transformer  # noqa: E402

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

_TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
             max_position_embeddings=64)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(tie_word_embeddings=False, rope_theta=500000.0)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(tie_word_embeddings=False, num_key_value_heads=1)),
}
# The same three models in our terms (equal configs also let both logit tests share one compile).
_OURS = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
             rms_eps=1e-5, max_seq_len=64)
OUR_CFGS = {
    # transformers' LlamaConfig declares eos_token_id=2 by default; it is carried over.
    "llama": ModelConfig(**_OURS, tie_embeddings=False, rope_theta=500000.0, eos_token_ids=(2,)),
    "qwen2": ModelConfig(**_OURS, tie_embeddings=True, rope_theta=1e6, qkv_bias=True),
    "qwen3": ModelConfig(**{**_OURS, "n_kv_heads": 1}, tie_embeddings=False, qk_norm=True),
}
LENGTHS = (11, 5, 8)


def _hf_model(family, seed=0):
  """A tiny transformers model with every parameter randomised (norms around 1, not 1)."""
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(seed)
  model = model_cls(config_cls(**{**_TINY, **extra})).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.5 if p.ndim == 1 else 0.3)
  return model


def _batch(vocab, seed=0):
  """Right-padded batch: tokens, positions, segment ids (0 = pad), valid mask, all [B, T]."""
  rng = np.random.default_rng(seed)
  t = max(LENGTHS)
  valid = np.arange(t)[None, :] < np.array(LENGTHS)[:, None]
  tokens = np.where(valid, rng.integers(0, vocab, (len(LENGTHS), t)), 0).astype(np.int32)
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape)
  return tokens, positions, valid.astype(np.int32), valid


def _hf_logits(model, tokens, valid):
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                attention_mask=torch.from_numpy(valid.astype(np.int64)))
  return out.logits.float().numpy()


_forward = jax.jit(transformer.forward, static_argnums=3)


def _our_logits(params, cfg, tokens, positions, segments):
  logits, _ = _forward(
      params, jnp.asarray(tokens), jnp.asarray(positions), cfg,
      segment_ids_BT=jnp.asarray(segments))
  return np.asarray(logits)


def _random_params(cfg, seed=0):
  """Random numpy params in `cfg.param_dtype` (norms around 1, nothing exactly 0 or 1)."""
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(cfg.param_dtype)

  def leaf(path, spec):
    offset = 1.0 if path[-1].key.endswith("norm") else 0.0
    return (offset + rng.normal(0.0, 0.3, spec[0])).astype(dtype)

  return jax.tree_util.tree_map_with_path(
      leaf, transformer.param_specs(cfg),
      is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[1], tuple))


def _assert_same_logits(ours, theirs, valid):
  assert np.abs(theirs[valid]).max() > 1.0  # a non-trivial comparison
  np.testing.assert_allclose(ours[valid], theirs[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_matches_transformers_logits(family, tmp_path):
  model = _hf_model(family)
  model.save_pretrained(tmp_path, safe_serialization=True)
  cfg, params = hf_io.load_hf_checkpoint(tmp_path)
  assert cfg == OUR_CFGS[family]
  assert ("lm_head" in params) != cfg.tie_embeddings
  tokens, positions, segments, valid = _batch(cfg.vocab_size)
  _assert_same_logits(_our_logits(params, cfg, tokens, positions, segments),
                      _hf_logits(model, tokens, valid), valid)


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
  model = _hf_model("qwen3")
  model.save_pretrained(tmp_path / "single")
  model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
  assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) >= 3
  cfg_a, a = hf_io.load_hf_checkpoint(tmp_path / "single")
  cfg_b, b = hf_io.load_hf_checkpoint(tmp_path / "sharded")
  assert cfg_a == cfg_b
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_bf16_checkpoint_and_dtype_cast(tmp_path):
  model = _hf_model("qwen2").to(torch.bfloat16)
  model.save_pretrained(tmp_path)
  cfg, params = hf_io.load_hf_checkpoint(tmp_path)
  assert cfg.param_dtype == "bfloat16" and params["embed"].dtype == jnp.bfloat16
  want = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [H*D, E]
  np.testing.assert_array_equal(
      params["layers"]["wq"][1].astype(np.float32), want.T.reshape(32, 4, 8))
  cfg32, params32 = hf_io.load_hf_checkpoint(tmp_path, param_dtype="float32")
  assert cfg32 == dataclasses.replace(cfg, param_dtype="float32")
  assert all(a.dtype == np.float32 for a in jax.tree.leaves(params32))
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x.astype(np.float32), y),
               params, params32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(OUR_CFGS))
@pytest.mark.parametrize("max_shard_bytes", [None, 4000])
def test_export_import_round_trip_is_bit_exact(family, dtype, max_shard_bytes, tmp_path):
  cfg = dataclasses.replace(OUR_CFGS[family], param_dtype=dtype)
  params = _random_params(cfg)
  written = hf_io.save_hf_checkpoint(tmp_path, params, cfg, max_shard_bytes=max_shard_bytes)
  assert ((tmp_path / "model.safetensors.index.json") in written) == bool(max_shard_bytes)
  cfg2, params2 = hf_io.load_hf_checkpoint(tmp_path)
  assert cfg2 == cfg
  assert jax.tree.structure(params2) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, params, params2)
  assert all(a.dtype == jnp.dtype(dtype) for a in jax.tree.leaves(params2))


@pytest.mark.parametrize("family", sorted(OUR_CFGS))
def test_export_loads_in_transformers_with_same_logits(family, tmp_path):
  cfg = OUR_CFGS[family]
  params = _random_params(cfg)
  hf_io.save_hf_checkpoint(tmp_path, params, cfg, max_shard_bytes=6000,
                           extra_config={"eos_token_id": 2})
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, dtype=torch.float32, output_loading_info=True)
  assert not any(info.values()), info  # no missing / unexpected / mismatched keys
  assert type(model).__name__ == hf_io.architecture_for(cfg)
  tokens, positions, segments, valid = _batch(cfg.vocab_size, seed=1)
  _assert_same_logits(_our_logits(params, cfg, tokens, positions, segments),
                      _hf_logits(model.eval(), tokens, valid), valid)


def test_bf16_export_loads_in_transformers_bit_exact(tmp_path):
  cfg = dataclasses.replace(OUR_CFGS["llama"], param_dtype="bfloat16")
  params = _random_params(cfg)
  hf_io.save_hf_checkpoint(tmp_path, params, cfg)
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
  got = model.model.layers[0].self_attn.o_proj.weight  # [E, H*D]
  assert got.dtype == torch.bfloat16
  want = np.asarray(params["layers"]["wo"][0]).reshape(32, 32).T
  np.testing.assert_array_equal(got.detach().float().numpy(), want.astype(np.float32))


def test_load_places_arrays_with_given_shardings(tmp_path):
  cfg = OUR_CFGS["qwen3"]
  hf_io.save_hf_checkpoint(tmp_path, _random_params(cfg), cfg)
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  spec = jax.sharding.PartitionSpec
  shardings = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, spec()),
                           transformer.param_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
  shardings["layers"]["wq"] = jax.sharding.NamedSharding(mesh, spec(None, None, "b"))
  _, params = hf_io.load_hf_checkpoint(tmp_path, shardings=shardings)
  assert params["layers"]["wq"].sharding == shardings["layers"]["wq"]
  assert params["embed"].sharding == shardings["embed"]


def _exported(tmp_path, family="llama"):
  cfg = OUR_CFGS[family]
  hf_io.save_hf_checkpoint(tmp_path, _random_params(cfg), cfg)
  return tmp_path


def _edit_config(path, **changes):
  hf = json.loads((path / "config.json").read_text())
  hf.update(changes)
  (path / "config.json").write_text(json.dumps(hf))


def test_unsupported_architecture_error(tmp_path):
  _edit_config(_exported(tmp_path), architectures=["MistralForCausalLM"])
  with pytest.raises(ValueError, match="MistralForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
    hf_io.load_hf_checkpoint(tmp_path)


# RoPE scalings with a short original context (64) so that every regime of each formula is hit
# with head_dim 8 and theta 1e4 (wavelengths 6.3, 63, 628, 6283 tokens): llama3 keeps the first
# rate, blends the second and divides the last two; yarn ramps over the first two dimensions.
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("rope_type", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers_beyond_the_original_context(rope_type, tmp_path):
  """Logits at positions 300..310, beyond the original 64-token context and its scaled span."""
  family = "qwen3" if rope_type == "yarn" else "llama"
  config_cls, model_cls, extra = FAMILIES[family]
  params = {**ROPE_SCALINGS[rope_type], "rope_theta": 1e4}
  torch.manual_seed(1)
  model = model_cls(config_cls(**{**_TINY, **extra, "max_position_embeddings": 512,
                                  "rope_parameters": params})).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)
  model.save_pretrained(tmp_path, safe_serialization=True)
  cfg, ours = hf_io.load_hf_checkpoint(tmp_path)
  assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == rope_type
  assert hf_io.config_from_hf(hf_io.config_to_hf(cfg)) == cfg  # and it round-trips
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, cfg.vocab_size, (2, 11)).astype(np.int32)
  positions = np.broadcast_to(np.arange(300, 311, dtype=np.int32), tokens.shape)
  with torch.no_grad():
    theirs = model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                   position_ids=torch.from_numpy(positions.astype(np.int64))).logits.numpy()
  logits, _ = _forward(ours, jnp.asarray(tokens), jnp.asarray(positions), cfg)
  assert np.abs(theirs).max() > 1.0
  np.testing.assert_allclose(np.asarray(logits), theirs, atol=1e-4, rtol=0)


def test_legacy_rope_scaling_spelling_and_unsupported_types():
  base = hf_io.config_to_hf(OUR_CFGS["llama"])
  cfg = hf_io.config_from_hf({**base, "rope_parameters": None,
                              "rope_scaling": {"type": "linear", "factor": 2.0}})
  assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 2.0)
  llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0}  # original context defaults to max_position_embeddings
  cfg = hf_io.config_from_hf({**base, "rope_parameters": None, "rope_scaling": llama31})
  assert cfg.rope_scaling.original_max_position_embeddings == base["max_position_embeddings"]
  for bad in ({"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "longrope", "factor": 2.0},
              {"rope_type": "linear"}):
    with pytest.raises(ValueError, match="rope_scaling"):
      hf_io.config_from_hf({**base, "rope_parameters": None, "rope_scaling": bad})


def test_eos_ids_of_config_and_generation_config_are_carried(tmp_path):
  """Llama 3.1 Instruct style: one id in config.json, a list in generation_config.json."""
  path = _exported(tmp_path)
  _edit_config(path, eos_token_id=7)
  (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11, 13]}))
  cfg, _ = hf_io.load_hf_checkpoint(path)
  assert cfg.eos_token_ids == (7, 11, 13)
  assert hf_io.config_to_hf(cfg)["eos_token_id"] == [7, 11, 13]
  assert hf_io.eos_token_ids({"eos_token_id": None}, None) == ()
  with pytest.raises(ValueError, match="eos_token_id"):
    hf_io.eos_token_ids({"eos_token_id": [1, "2"]})
  with pytest.raises(ValueError, match="eos_token_ids"):
    dataclasses.replace(cfg, eos_token_ids=(cfg.vocab_size,))


def _edit_tensors(file, edit):
  """Rewrites a safetensors file with `edit(tensors)` applied to its dict of tensors."""
  tensors = st_numpy.load_file(file)
  edit(tensors)
  file.unlink()
  st_numpy.save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_tensor_error_names_tensor_and_files(tmp_path):
  model = _hf_model("qwen2")
  model.save_pretrained(tmp_path / "orig", max_shard_size="20KB")
  shutil.copytree(tmp_path / "orig", tmp_path / "broken")
  index = json.loads((tmp_path / "broken" / "model.safetensors.index.json").read_text())
  name = "model.layers.1.self_attn.k_proj.bias"
  _edit_tensors(tmp_path / "broken" / index["weight_map"][name], lambda t: t.pop(name))
  with pytest.raises(ValueError, match=rf"Missing tensor.*{name}.*model-00001-of-"):
    hf_io.load_hf_checkpoint(tmp_path / "broken")


def test_unexpected_tensor_error(tmp_path):
  path = _exported(tmp_path)
  _edit_tensors(path / "model.safetensors", lambda t: t.update(
      {"model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)}))
  with pytest.raises(ValueError, match="Unexpected tensor.*o_proj.bias"):
    hf_io.load_hf_checkpoint(path)


def test_tied_checkpoint_may_repeat_the_embedding_as_lm_head(tmp_path):
  path = _exported(tmp_path, "qwen2")  # tied
  _, want = hf_io.load_hf_checkpoint(path)
  file = path / "model.safetensors"
  _edit_tensors(file, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
  _, got = hf_io.load_hf_checkpoint(path)
  jax.tree.map(np.testing.assert_array_equal, want, got)
  _edit_tensors(file, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
  with pytest.raises(ValueError, match="lm_head.weight differs"):
    hf_io.load_hf_checkpoint(path)


@pytest.mark.parametrize("changes, field", [
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
     "use_sliding_window"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    (dict(architectures=None), "architectures"),
])
def test_unsupported_config_fields_are_named(changes, field):
  hf = hf_io.config_to_hf(OUR_CFGS["llama"])
  hf.pop("layer_types", None)
  with pytest.raises(ValueError, match=field):
    hf_io.config_from_hf({**hf, **changes})


def test_config_round_trip_and_legacy_fields():
  for cfg in OUR_CFGS.values():
    assert hf_io.config_from_hf(hf_io.config_to_hf(cfg)) == cfg
  legacy = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 24,
            "rope_theta": 5e5, "rope_scaling": None}
  cfg = hf_io.config_from_hf(legacy)
  assert (cfg.head_dim, cfg.n_kv_heads, cfg.rope_theta, cfg.max_seq_len) == (8, 2, 5e5, 2048)
  with pytest.raises(ValueError, match="cannot express"):
    hf_io.config_to_hf(OUR_CFGS["qwen2"], architecture="LlamaForCausalLM")


def test_export_refuses_bad_params_and_overwrite(tmp_path):
  cfg = OUR_CFGS["llama"]
  params = _random_params(cfg)
  bad = {**params, "layers": {**params["layers"], "bq": jnp.zeros((2, 4, 8))}}
  with pytest.raises(ValueError, match="layers/bq"):
    hf_io.save_hf_checkpoint(tmp_path / "a", bad, cfg)
  hf_io.save_hf_checkpoint(tmp_path / "b", params, cfg)
  with pytest.raises(FileExistsError):
    hf_io.save_hf_checkpoint(tmp_path / "b", params, cfg)
