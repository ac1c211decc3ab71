"""HF GPT-OSS (`GptOssForCausalLM`) checkpoints <-> the built-in model, for `hf_io` / `hf_config`.

GPT-OSS (OpenAI 2025, gpt-oss-20b / 120b model card; transformers `modeling_gpt_oss.py`) is a
mixture-of-experts decoder with: learned attention sinks per head, alternating sliding-window
(128 tokens) and full attention layers (`layer_types`), biases on q/k/v/o, YaRN RoPE
(truncate=false), a router with a bias whose softmax runs over the top-k logits, and experts with
biases and a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate) with gate <= limit and
|up| <= limit. Every layer is MoE.

Tensor mapping (HF name inside `model.layers.{i}.` -> ours in params["moe_layers"], layer i):
  input_layernorm.weight [E] -> attn_norm; post_attention_layernorm.weight [E] -> mlp_norm;
  self_attn.{q,k,v}_proj.weight [N*D, E] -> w{q,k,v} [E, N, D]; .bias [N*D] -> b{q,k,v} [N, D];
  self_attn.o_proj.weight [E, H*D] -> wo [H, D, E]; .bias [E] -> bo; self_attn.sinks [H] -> sinks;
  mlp.router.weight [X, E] -> router [E, X]; mlp.router.bias [X] -> router_bias;
  mlp.experts.gate_up_proj [X, E, 2F] (gate and up INTERLEAVED on the last axis: gate = [..., 0::2],
    up = [..., 1::2]) -> experts_gate, experts_up [X, E, F]; gate_up_proj_bias [X, 2F] (same
    interleave) -> experts_gate_bias, experts_up_bias [X, F];
  mlp.experts.down_proj [X, F, E] -> experts_down; down_proj_bias [X, E] -> experts_down_bias.
The published checkpoints store gate_up_proj / down_proj as MXFP4 `*_blocks` + `*_scales` (uint8,
`quantization_config.quant_method = "mxfp4"`); import dequantizes them (`mxfp4.dequantize`) to
[X, 2F, E] / [X, E, F], the transposes of the tensors above. Export writes the unquantized
(bf16 / f32) layout, which transformers loads without a quantization config.

Letters: E embed, H heads, N heads of a projection, D head dim, X experts, F expert width.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from rlax_pipe.config import ModelConfig
from rlax_pipe.model import mxfp4

ARCHITECTURE = "GptOssForCausalLM"
# transformers' GptOssConfig defaults for fields a config.json may omit.
_DEFAULTS = {"head_dim": 64, "sliding_window": 128, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 131072, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
             "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
             "rope_theta": 150000.0}
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


def is_gpt_oss(cfg: ModelConfig) -> bool:
  """Whether `cfg` is a GPT-OSS-style model (clamped-SwiGLU experts), exported as GptOss."""
  return cfg.expert_activation == "gpt_oss"


def config_from_hf(hf_config: Mapping[str, Any], *, param_dtype: str, eos_ids: tuple[int, ...],
                   rope: Callable[[Mapping[str, Any]], tuple]) -> ModelConfig:
  """Maps a GptOss config.json dict to a `ModelConfig` (see the module docstring).

  Args:
    hf_config: the parsed config.json (architectures == ["GptOssForCausalLM"]).
    param_dtype: ModelConfig.param_dtype of the result.
    eos_ids: the end-of-sequence ids (`hf_config.eos_token_ids`).
    rope: `hf_config._rope`, (theta, RopeScaling) of a config dict.

  Raises:
    ValueError: a missing required field, a quantization other than mxfp4, an activation other
      than silu (each named).
  """
  required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size", "num_local_experts")
  missing = [k for k in required if hf_config.get(k) is None]
  if missing:
    raise ValueError(f"config.json lacks required field(s) {missing} for {ARCHITECTURE}.")
  quant = hf_config.get("quantization_config")
  if quant is not None and quant.get("quant_method") != "mxfp4":
    raise ValueError(f"config.json field 'quantization_config'={quant}: only quant_method "
                     "'mxfp4' (dequantized on import) is supported for GPT-OSS.")
  if hf_config.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json field 'hidden_act'={hf_config['hidden_act']!r}: GPT-OSS "
                     "experts use the clamped SwiGLU ('silu').")
  get = lambda k: hf_config[k] if hf_config.get(k) is not None else _DEFAULTS[k]
  n_layers, n_heads = int(hf_config["num_hidden_layers"]), int(hf_config["num_attention_heads"])
  layer_types = hf_config.get("layer_types") or [
      "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
  rope_cfg = dict(hf_config)
  if not rope_cfg.get("rope_parameters") and not rope_cfg.get("rope_scaling"):
    rope_cfg["rope_parameters"] = dict(_DEFAULT_ROPE)
  if rope_cfg.get("rope_theta") is None and (rope_cfg.get("rope_parameters") or {}).get(
      "rope_theta") is None:
    rope_cfg["rope_theta"] = _DEFAULTS["rope_theta"]
  rope_cfg.setdefault("max_position_embeddings", _DEFAULTS["max_position_embeddings"])
  theta, scaling = rope(rope_cfg)
  bias = bool(get("attention_bias"))
  n_kv = hf_config.get("num_key_value_heads")
  f = int(hf_config["intermediate_size"])
  return ModelConfig(
      vocab_size=int(hf_config["vocab_size"]), d_model=int(hf_config["hidden_size"]),
      n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads if n_kv is None else int(n_kv),
      head_dim=int(get("head_dim")), d_ff=f, rope_theta=theta, rope_scaling=scaling,
      rms_eps=float(get("rms_norm_eps")), qkv_bias=bias, o_bias=bias, attention_sinks=True,
      sliding_window=int(get("sliding_window")), layer_types=tuple(layer_types),
      tie_embeddings=bool(get("tie_word_embeddings")), param_dtype=param_dtype,
      max_seq_len=int(get("max_position_embeddings")), eos_token_ids=eos_ids,
      n_experts=int(hf_config["num_local_experts"]),
      n_experts_per_tok=int(get("num_experts_per_tok")), moe_d_ff=f, router_softmax="topk",
      router_bias=True, expert_bias=True, expert_activation="gpt_oss",
      swiglu_alpha=float(get("swiglu_alpha")), swiglu_limit=float(get("swiglu_limit")))


def check_expressible(cfg: ModelConfig) -> None:
  """Raises a ValueError naming the field unless GptOssForCausalLM can express `cfg`."""
  want = dict(attention_sinks=True, qk_norm=False, router_softmax="topk", router_bias=True,
              expert_bias=True, expert_activation="gpt_oss", o_bias=cfg.qkv_bias)
  bad = {k: getattr(cfg, k) for k, v in want.items() if getattr(cfg, k) != v}
  if cfg.n_experts < 2 or not all(cfg.layer_is_moe):
    bad["n_experts / layer_is_moe"] = (cfg.n_experts, cfg.layer_is_moe)
  if cfg.sliding_window is None:
    bad["sliding_window"] = None
  if bad:
    raise ValueError(f"{ARCHITECTURE} cannot express ModelConfig fields {bad}; it needs "
                     f"{want}, every layer MoE and a sliding_window.")


def config_to_hf(cfg: ModelConfig, dtype: str, rope_fields: dict[str, Any]) -> dict[str, Any]:
  """The GptOss config.json dict of `cfg` (inverse of `config_from_hf`).

  Args:
    cfg: a GPT-OSS-style ModelConfig (`check_expressible`).
    dtype: the checkpoint dtype name.
    rope_fields: the rope_theta / rope_scaling / rope_parameters entries (`hf_config`).
  """
  check_expressible(cfg)
  out = {
      "architectures": [ARCHITECTURE], "model_type": "gpt_oss",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.moe_d_ff, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": cfg.qkv_bias, "attention_dropout": 0.0,
      "sliding_window": cfg.sliding_window,
      "layer_types": list(cfg.layer_types) or ["full_attention"] * cfg.n_layers,
      "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_per_tok,
      "swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit,
      "router_aux_loss_coef": 0.0, "output_router_logits": False,
      "torch_dtype": dtype, "dtype": dtype, **rope_fields,
  }
  if cfg.eos_token_ids:
    ids = list(cfg.eos_token_ids)
    out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
  return out


# ------------------------------------------------------------------------------------------------
# Tensors.


def hf_tensor_names(cfg: ModelConfig, names: set[str]) -> set[str]:
  """The HF tensor names a GptOss checkpoint of `cfg` holds; the experts' gate_up_proj and
  down_proj are replaced by their `_blocks` / `_scales` when `names` (the file's) has those."""
  out = {"model.embed_tokens.weight", "model.norm.weight"}
  if not cfg.tie_embeddings:
    out.add("lm_head.weight")
  for i in range(cfg.n_layers):
    pre = f"model.layers.{i}."
    out |= {pre + n for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.sinks", "mlp.router.weight", "mlp.router.bias",
        "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias")}
    if cfg.qkv_bias:
      out |= {pre + f"self_attn.{p}_proj.bias" for p in "qkvo"}
    for proj in ("gate_up_proj", "down_proj"):
      base = f"{pre}mlp.experts.{proj}"
      out |= ({base + "_blocks", base + "_scales"} if base + "_blocks" in names else {base})
  return out


def layer_from_hf(read: Callable[[str], np.ndarray], names: set[str], i: int,
                  cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Layer i's params (our names and layouts, no layer axis) from HF tensors via `read(name)`.

  MXFP4 experts (`{proj}_blocks` + `{proj}_scales` in `names`) are dequantized to float32.

  Raises:
    ValueError: a tensor of the wrong shape (named, with the shape config.json implies).
  """
  e, h, k, d = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  x, f = cfg.n_experts, cfg.moe_d_ff
  pre = f"model.layers.{i}."

  def get(name, shape):
    arr = read(pre + name)
    if tuple(arr.shape) != shape:
      raise ValueError(f"Tensor {pre + name!r} has shape {tuple(arr.shape)}; config.json "
                       f"implies {shape}.")
    return np.asarray(arr)

  def experts(proj, dense_shape, rows, cols):
    """[X, in, out] of gate_up_proj / down_proj, dense or dequantized from MXFP4."""
    if pre + f"mlp.experts.{proj}_blocks" not in names:
      return get(f"mlp.experts.{proj}", dense_shape)
    blocks = get(f"mlp.experts.{proj}_blocks", (x, rows, cols // 32, 16))
    scales = get(f"mlp.experts.{proj}_scales", (x, rows, cols // 32))
    return mxfp4.dequantize(blocks, scales, name=pre + proj).transpose(0, 2, 1)

  out = {
      "attn_norm": get("input_layernorm.weight", (e,)),
      "mlp_norm": get("post_attention_layernorm.weight", (e,)),
      "wq": get("self_attn.q_proj.weight", (h * d, e)).T.reshape(e, h, d),
      "wk": get("self_attn.k_proj.weight", (k * d, e)).T.reshape(e, k, d),
      "wv": get("self_attn.v_proj.weight", (k * d, e)).T.reshape(e, k, d),
      "wo": get("self_attn.o_proj.weight", (e, h * d)).T.reshape(h, d, e),
      "sinks": get("self_attn.sinks", (h,)),
      "router": get("mlp.router.weight", (x, e)).T,
      "router_bias": get("mlp.router.bias", (x,)),
  }
  if cfg.qkv_bias:
    out.update(bq=get("self_attn.q_proj.bias", (h * d,)).reshape(h, d),
               bk=get("self_attn.k_proj.bias", (k * d,)).reshape(k, d),
               bv=get("self_attn.v_proj.bias", (k * d,)).reshape(k, d),
               bo=get("self_attn.o_proj.bias", (e,)))
  gate_up = experts("gate_up_proj", (x, e, 2 * f), 2 * f, e)
  gate_up_bias = get("mlp.experts.gate_up_proj_bias", (x, 2 * f))
  out.update(experts_gate=gate_up[..., 0::2], experts_up=gate_up[..., 1::2],
             experts_gate_bias=gate_up_bias[:, 0::2], experts_up_bias=gate_up_bias[:, 1::2],
             experts_down=experts("down_proj", (x, f, e), e, f),
             experts_down_bias=get("mlp.experts.down_proj_bias", (x, e)))
  return out


def layer_to_hf(lp: Mapping[str, np.ndarray], i: int, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """HF tensors (contiguous, unquantized) of layer i's params `lp` (inverse of layer_from_hf)."""
  e, h, k, d = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  pre = f"model.layers.{i}."

  def interleave(gate, up):
    out = np.empty(gate.shape[:-1] + (2 * gate.shape[-1],), gate.dtype)
    out[..., 0::2], out[..., 1::2] = gate, up
    return out

  c = np.ascontiguousarray
  out = {
      "input_layernorm.weight": lp["attn_norm"],
      "post_attention_layernorm.weight": lp["mlp_norm"],
      "self_attn.q_proj.weight": lp["wq"].reshape(e, h * d).T,
      "self_attn.k_proj.weight": lp["wk"].reshape(e, k * d).T,
      "self_attn.v_proj.weight": lp["wv"].reshape(e, k * d).T,
      "self_attn.o_proj.weight": lp["wo"].reshape(h * d, e).T,
      "self_attn.sinks": lp["sinks"],
      "mlp.router.weight": lp["router"].T,
      "mlp.router.bias": lp["router_bias"],
      "mlp.experts.gate_up_proj": interleave(lp["experts_gate"], lp["experts_up"]),
      "mlp.experts.gate_up_proj_bias": interleave(lp["experts_gate_bias"],
                                                  lp["experts_up_bias"]),
      "mlp.experts.down_proj": lp["experts_down"],
      "mlp.experts.down_proj_bias": lp["experts_down_bias"],
  }
  if cfg.qkv_bias:
    out.update({"self_attn.q_proj.bias": lp["bq"].reshape(h * d),
                "self_attn.k_proj.bias": lp["bk"].reshape(k * d),
                "self_attn.v_proj.bias": lp["bv"].reshape(k * d),
                "self_attn.o_proj.bias": lp["bo"]})
  return {pre + n: c(v) for n, v in out.items()}
