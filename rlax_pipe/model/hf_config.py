"""HF `config.json` <-> `ModelConfig` (Llama / Qwen2 / Qwen3 / Qwen3-MoE / GPT-OSS causal LMs),
for `hf_io`.

Reads every field that changes the forward pass (sizes, RoPE base and scaling, norms, biases,
tying) and the end-of-sequence ids of config.json and generation_config.json; refuses, naming
the field, anything the built-in model cannot run (sliding windows, biases it has no weights
for, other activations, quantization, other RoPE types) outside GPT-OSS, whose mapping (sinks,
sliding windows, attention biases, experts, MXFP4) lives in `hf_gpt_oss`.
"""

from __future__ import annotations

from typing import Any, Mapping

from rlax_pipe.config import ModelConfig, RopeScaling
from rlax_pipe.model import hf_gpt_oss, rotary

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "GptOssForCausalLM")
_MODEL_TYPE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
# HF's class defaults for fields a config.json may omit.
_DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "Qwen2ForCausalLM": 32768,
                          "Qwen3ForCausalLM": 32768, "Qwen3MoeForCausalLM": 32768}
_QWEN3_MOE = "Qwen3MoeForCausalLM"


def _moe_fields(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """Qwen3-MoE's MoE fields -> ModelConfig kwargs (HF class defaults where absent).

  num_experts (published configs) or num_local_experts (what transformers 5 writes) -> n_experts;
  num_experts_per_tok, moe_intermediate_size -> moe_d_ff, norm_topk_prob (default false),
  decoder_sparse_step (1), mlp_only_layers ([]). Routing is softmax over all experts, no router
  bias. router_aux_loss_coef / output_router_logits are training settings of transformers (its
  loss is k times `moe.load_balance_loss`) and are not imported: set the learner's coefficient
  in ModelConfig.
  """
  counts = {hf_config[k] for k in ("num_experts", "num_local_experts")
            if hf_config.get(k) is not None}
  if len(counts) != 1:
    raise ValueError(f"config.json for {_QWEN3_MOE} needs one expert count, num_experts or "
                     f"num_local_experts; got {sorted(counts)}.")
  return dict(
      n_experts=int(counts.pop()),
      n_experts_per_tok=int(hf_config.get("num_experts_per_tok", 8)),
      moe_d_ff=int(hf_config.get("moe_intermediate_size", 768)),
      norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
      decoder_sparse_step=int(hf_config.get("decoder_sparse_step", 1)),
      mlp_only_layers=tuple(int(i) for i in (hf_config.get("mlp_only_layers") or ())),
      router_softmax="all", router_bias=False)


def _architecture(hf_config: Mapping[str, Any]) -> str:
  archs = hf_config.get("architectures")
  if not isinstance(archs, list) or len(archs) != 1:
    raise ValueError(f"config.json field 'architectures'={archs!r}: expected exactly one of "
                     f"{SUPPORTED_ARCHITECTURES}.")
  if archs[0] not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"Unsupported architecture {archs[0]!r} (config.json 'architectures'); "
                     f"supported: {SUPPORTED_ARCHITECTURES}.")
  return archs[0]


def _rope(hf_config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from the legacy `rope_scaling` or the v5 `rope_parameters` field."""
  max_positions = hf_config.get("max_position_embeddings")
  scalings = {}
  for field in ("rope_scaling", "rope_parameters"):
    params = hf_config.get(field)
    if params:
      scalings[field] = rotary.scaling_from_hf(params, max_positions, field)
  if len(scalings) == 2 and scalings["rope_scaling"] != scalings["rope_parameters"]:
    raise ValueError(f"config.json disagrees with itself: rope_scaling="
                     f"{hf_config['rope_scaling']} but rope_parameters="
                     f"{hf_config['rope_parameters']}.")
  if hf_config.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"config.json field 'partial_rotary_factor'="
                     f"{hf_config['partial_rotary_factor']} is not supported (only 1.0).")
  nested = (hf_config.get("rope_parameters") or {}).get("rope_theta")
  top = hf_config.get("rope_theta")
  if nested is not None and top is not None and float(nested) != float(top):
    raise ValueError(f"config.json disagrees with itself: rope_theta={top} but "
                     f"rope_parameters.rope_theta={nested}.")
  theta = nested if nested is not None else top
  scaling = next(iter(scalings.values()), None)
  return (10000.0 if theta is None else float(theta)), scaling


def eos_token_ids(*configs: Mapping[str, Any] | None) -> tuple[int, ...]:
  """Every `eos_token_id` of the given config dicts (an int or a list each), in order, once.

  E.g. Llama 3.1 Instruct: config.json 128001 and generation_config.json [128001, 128008,
  128009] -> (128001, 128008, 128009). None dicts and missing / null fields are skipped.

  Raises:
    ValueError: on an id that is not a non-negative int.
  """
  out: list[int] = []
  for cfg in configs:
    value = (cfg or {}).get("eos_token_id")
    for i in ([] if value is None else value if isinstance(value, list) else [value]):
      if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise ValueError(f"eos_token_id {value!r}: ids must be non-negative ints.")
      if i not in out:
        out.append(i)
  return tuple(out)


def _check_full_attention(hf_config: Mapping[str, Any], n_layers: int) -> None:
  """Raises unless every layer uses full causal attention (no sliding windows)."""
  layer_types = hf_config.get("layer_types")
  if layer_types is not None:
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
      raise ValueError(f"config.json field 'layer_types' contains {other}: only "
                       f"'full_attention' layers are supported (no sliding windows).")
    return
  if hf_config.get("use_sliding_window") and hf_config.get("sliding_window") is not None:
    if hf_config.get("max_window_layers", 0) < n_layers:
      raise ValueError(
          "config.json field 'use_sliding_window'=true with sliding_window="
          f"{hf_config['sliding_window']} and max_window_layers="
          f"{hf_config.get('max_window_layers')}: sliding-window attention is not supported.")


def config_from_hf(hf_config: Mapping[str, Any], *, param_dtype: str = "float32",
                   generation_config: Mapping[str, Any] | None = None) -> ModelConfig:
  """Maps a HF `config.json` dict (Llama / Qwen2 / Qwen3 / GPT-OSS causal LM) to a `ModelConfig`.

  GPT-OSS configs are mapped by `hf_gpt_oss.config_from_hf` (sinks, sliding windows, experts).

  Reads hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default: no
  GQA), head_dim (default hidden_size / num_attention_heads), intermediate_size, vocab_size,
  rope_theta and the RoPE scaling (legacy `rope_scaling` or v5 `rope_parameters`; types
  linear, llama3, yarn -> `RopeScaling`), rms_norm_eps, tie_word_embeddings,
  max_position_embeddings (-> max_seq_len), and eos_token_id of config.json and of
  generation_config.json (ints or lists -> eos_token_ids, their union). Qwen2 always has q/k/v
  biases; Qwen3 and Qwen3-MoE always have q/k norms; Qwen3-MoE's expert fields are read by
  `_moe_fields`. Other fields (dropout, initializer range, ...) do not
  affect the forward and are ignored.

  Args:
    hf_config: the parsed config.json.
    param_dtype: `ModelConfig.param_dtype` of the result ("float32", "bfloat16", "float16").
    generation_config: the parsed generation_config.json, if the checkpoint has one.

  Returns:
    The matching `ModelConfig` (compute_dtype left at its default).

  Raises:
    ValueError: unsupported architecture (the message lists the supported ones), a missing
      required field, or an unsupported feature (the message names the field): a RoPE type
      other than default / linear / llama3 / yarn, sliding windows, attention_bias / mlp_bias
      on Llama / Qwen3, an activation other than SiLU, quantization.

  Example:
    >>> cfg = config_from_hf(json.load(open("ckpt/config.json")))
  """
  arch = _architecture(hf_config)
  if arch == hf_gpt_oss.ARCHITECTURE:
    return hf_gpt_oss.config_from_hf(hf_config, param_dtype=param_dtype,
                                     eos_ids=eos_token_ids(hf_config, generation_config),
                                     rope=_rope)
  required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size")
  missing = [k for k in required if hf_config.get(k) is None]
  if missing:
    raise ValueError(f"config.json lacks required field(s) {missing} for {arch}.")
  if hf_config.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json field 'hidden_act'={hf_config['hidden_act']!r}: only 'silu' "
                     "(SwiGLU) is supported.")
  if hf_config.get("quantization_config") is not None:
    raise ValueError("config.json field 'quantization_config' is set: quantized checkpoints are "
                     "not supported.")
  if hf_config.get("mlp_bias"):
    raise ValueError("config.json field 'mlp_bias'=true is not supported (no MLP biases).")
  if arch != "Qwen2ForCausalLM" and hf_config.get("attention_bias"):
    raise ValueError(f"config.json field 'attention_bias'=true is not supported for {arch}: it "
                     "adds an o_proj bias, which ModelConfig has no field for.")
  n_layers = int(hf_config["num_hidden_layers"])
  _check_full_attention(hf_config, n_layers)
  hidden, n_heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
  head_dim = hf_config.get("head_dim")
  if head_dim is None:
    if hidden % n_heads:
      raise ValueError(f"config.json has no 'head_dim' and hidden_size={hidden} is not a multiple"
                       f" of num_attention_heads={n_heads}.")
    head_dim = hidden // n_heads
  n_kv = hf_config.get("num_key_value_heads")
  theta, scaling = _rope(hf_config)
  return ModelConfig(
      vocab_size=int(hf_config["vocab_size"]),
      d_model=hidden,
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=n_heads if n_kv is None else int(n_kv),
      head_dim=int(head_dim),
      d_ff=int(hf_config["intermediate_size"]),
      rope_theta=theta,
      rope_scaling=scaling,
      rms_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
      qkv_bias=arch == "Qwen2ForCausalLM",
      qk_norm=arch in ("Qwen3ForCausalLM", _QWEN3_MOE),
      tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
      param_dtype=param_dtype,
      max_seq_len=int(hf_config.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch])),
      eos_token_ids=eos_token_ids(hf_config, generation_config),
      **(_moe_fields(hf_config) if arch == _QWEN3_MOE else {}),
  )


def architecture_for(cfg: ModelConfig) -> str:
  """The HF architecture that expresses `cfg`: Qwen3-MoE if it has experts, Qwen3 if qk_norm,
  Qwen2 if qkv_bias, else Llama.

  Raises:
    ValueError: if cfg has both qkv_bias and qk_norm (no supported HF architecture has both), or
      experts that Qwen3-MoE cannot express (it needs qk_norm, no qkv_bias, router_softmax="all",
      no router bias).
  """
  if hf_gpt_oss.is_gpt_oss(cfg):
    return hf_gpt_oss.ARCHITECTURE
  if cfg.n_experts:
    if not cfg.qk_norm or cfg.qkv_bias or cfg.router_softmax != "all" or cfg.router_bias:
      raise ValueError(f"No supported HF architecture expresses this MoE ModelConfig: "
                       f"{_QWEN3_MOE} needs qk_norm=True, qkv_bias=False, router_softmax='all', "
                       f"router_bias=False (got {cfg.qk_norm}, {cfg.qkv_bias}, "
                       f"{cfg.router_softmax!r}, {cfg.router_bias}).")
    return _QWEN3_MOE
  if cfg.qkv_bias and cfg.qk_norm:
    raise ValueError("ModelConfig with both qkv_bias and qk_norm has no HF architecture among "
                     f"{SUPPORTED_ARCHITECTURES}.")
  if cfg.qk_norm:
    return "Qwen3ForCausalLM"
  return "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"


def _rope_fields(cfg: ModelConfig) -> dict[str, Any]:
  """config.json's rope_theta, legacy rope_scaling and v5 rope_parameters entries of cfg."""
  return {
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None if cfg.rope_scaling is None else rotary.scaling_to_hf(cfg.rope_scaling),
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta} if (
          cfg.rope_scaling is None) else {**rotary.scaling_to_hf(cfg.rope_scaling),
                                          "rope_theta": cfg.rope_theta},
  }


def config_to_hf(cfg: ModelConfig, *, architecture: str | None = None,
                 dtype: str | None = None) -> dict[str, Any]:
  """The HF `config.json` dict for `cfg` (inverse of `config_from_hf`).

  Writes both the legacy (rope_theta, rope_scaling, torch_dtype) and the transformers v5
  (rope_parameters, dtype) field names so old and new readers agree.

  Args:
    cfg: model configuration.
    architecture: one of SUPPORTED_ARCHITECTURES; None = `architecture_for(cfg)`.
    dtype: dtype name recorded as the checkpoint dtype; None = cfg.param_dtype.

  Returns:
    A JSON-serialisable dict.

  Raises:
    ValueError: unknown architecture, or one that cannot express cfg (Llama has neither q/k/v
      biases nor q/k norms, Qwen2 always has the biases, Qwen3 always has the norms).
  """
  arch = architecture_for(cfg) if architecture is None else architecture
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"Unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}.")
  dtype = cfg.param_dtype if dtype is None else dtype
  if arch == hf_gpt_oss.ARCHITECTURE or hf_gpt_oss.is_gpt_oss(cfg):
    if arch != hf_gpt_oss.ARCHITECTURE:
      raise ValueError(f"{arch} cannot express a GPT-OSS ModelConfig (expert_activation="
                       f"'gpt_oss'); use {hf_gpt_oss.ARCHITECTURE}.")
    return hf_gpt_oss.config_to_hf(cfg, dtype, _rope_fields(cfg))
  if cfg.attention_sinks or cfg.o_bias or cfg.layer_windows is not None:
    raise ValueError(f"{arch} cannot express attention sinks, an o_proj bias or sliding-window "
                     f"layers; only {hf_gpt_oss.ARCHITECTURE} has them (with its experts).")
  if (cfg.qkv_bias != (arch == "Qwen2ForCausalLM")
      or cfg.qk_norm != (arch in ("Qwen3ForCausalLM", _QWEN3_MOE))
      or (cfg.n_experts > 0) != (arch == _QWEN3_MOE)):
    raise ValueError(f"{arch} cannot express ModelConfig(qkv_bias={cfg.qkv_bias}, "
                     f"qk_norm={cfg.qk_norm}, n_experts={cfg.n_experts}); use "
                     f"{architecture_for(cfg)}.")
  out = {
      "architectures": [arch],
      "model_type": _MODEL_TYPE[arch],
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.rms_eps,
      **_rope_fields(cfg),
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_dropout": 0.0,
      "torch_dtype": dtype,
      "dtype": dtype,
  }
  if cfg.eos_token_ids:
    ids = list(cfg.eos_token_ids)
    out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
  if arch != "Qwen2ForCausalLM":
    out["attention_bias"] = False
  if arch == "LlamaForCausalLM":
    out["mlp_bias"] = False
  else:
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
               layer_types=["full_attention"] * cfg.n_layers)
  if arch == _QWEN3_MOE:
    out.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_per_tok,
               moe_intermediate_size=cfg.moe_d_ff, norm_topk_prob=cfg.norm_topk_prob,
               decoder_sparse_step=cfg.decoder_sparse_step,
               mlp_only_layers=list(cfg.mlp_only_layers), output_router_logits=False)
  return out
