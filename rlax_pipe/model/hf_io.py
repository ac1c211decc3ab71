"""Hugging Face checkpoint import and export (safetensors; Llama / Qwen2 / Qwen3 causal LMs).

Reads a `save_pretrained` directory (`config.json` plus `model.safetensors`, or the sharded
`model.safetensors.index.json` with its shards) into a `ModelConfig` and a params tree in the
layout of `transformer.param_specs`, and writes the reverse so a trained policy can be served by
any HF-compatible engine. No pickle and no torch: safetensors files are parsed here (8-byte
little-endian header length, JSON header of name -> dtype, shape, byte offsets, raw data) and
memory-mapped with numpy, so F32, F16 and BF16 (the `bfloat16` dtype JAX registers with numpy)
take one path whatever the installed safetensors supports (its numpy reader rejects BF16 unless
ml_dtypes is registered). Writing uses `safetensors.numpy.save_file`.

Layouts: HF `nn.Linear` weights are [out, in]; ours keep the input axes first and split the head
axes, e.g. q_proj [H*D, E] -> wq [E, H, D], o_proj [E, H*D] -> wo [H, D, E], gate_proj [F, E] ->
w_gate [E, F], lm_head [V, E] -> lm_head [E, V]. Per-layer tensors are stacked on a leading L axis.
HF's RoPE (`rotate_half`) uses the same half-split convention as `transformer.rope`, so q/k need
no permutation.

GPT-OSS (`GptOssForCausalLM`: sinks, sliding windows, attention biases, experts with biases,
MXFP4 expert weights dequantized on import) maps through `hf_gpt_oss`.

Supported: Llama, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm) and Qwen3-MoE (Qwen3 attention; MoE
layers per decoder_sparse_step / mlp_only_layers, router `mlp.gate` [X, E], experts read per
expert `mlp.experts.{j}.{gate,up,down}_proj` as published and as save_pretrained writes them, or
fused `mlp.experts.gate_up_proj` [X, 2F, E] / `down_proj` [X, E, F] as transformers 5 holds them;
written per expert) with SiLU MLPs, RoPE unscaled or
with linear / llama3 / yarn scaling (Llama 3.1-3.3, Qwen2.5 / Qwen3 long-context configs), full
attention in every layer, tied or untied embeddings; the EOS ids of config.json and
generation_config.json are carried into `ModelConfig.eos_token_ids` (`hf_config`). Anything else
(another RoPE type, sliding windows, attention_bias / mlp_bias on Llama or Qwen3, which would need
o_proj / MLP biases, another activation, quantized weights) raises a ValueError naming the field.

Letters: E embed, H heads, K kv heads, D head dim, F mlp, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe.config import ModelConfig
from rlax_pipe.model import hf_gpt_oss, transformer
# Config mapping lives in hf_config; re-exported here, the module users import.
from rlax_pipe.model.hf_config import (  # pylint: disable=unused-import
    SUPPORTED_ARCHITECTURES, architecture_for, config_from_hf, config_to_hf, eos_token_ids)

_CONFIG_FILE = "config.json"
_GENERATION_FILE = "generation_config.json"
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "U8": "uint8"}  # U8: MXFP4 blocks / scales of GPT-OSS experts
_MAX_HEADER_BYTES = 100 * 2**20
# Non-parameter buffers some older exports contain; recomputed from rope_theta, so skipped.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# Our top-level name -> (HF name, layout kind). Kinds: an int n = HF Linear [out, in], transposed,
# whose first n axes in our layout are the input axes; "vec" = a vector (ours may split it, e.g.
# bq [H, D] <-> [H*D]); "same" = identical layout (the embedding table [V, E]).
TOP_TENSORS = {
    "embed": ("model.embed_tokens.weight", "same"),
    "final_norm": ("model.norm.weight", "vec"),
    "lm_head": ("lm_head.weight", 1),
}
# Our per-layer name -> (HF name inside `model.layers.{i}.`, layout kind as above).
LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", "vec"),
    "wq": ("self_attn.q_proj.weight", 1),
    "wk": ("self_attn.k_proj.weight", 1),
    "wv": ("self_attn.v_proj.weight", 1),
    "bq": ("self_attn.q_proj.bias", "vec"),
    "bk": ("self_attn.k_proj.bias", "vec"),
    "bv": ("self_attn.v_proj.bias", "vec"),
    "q_norm": ("self_attn.q_norm.weight", "vec"),
    "k_norm": ("self_attn.k_norm.weight", "vec"),
    "wo": ("self_attn.o_proj.weight", 2),
    "mlp_norm": ("post_attention_layernorm.weight", "vec"),
    "w_gate": ("mlp.gate_proj.weight", 1),
    "w_up": ("mlp.up_proj.weight", 1),
    "w_down": ("mlp.down_proj.weight", 1),
    "router": ("mlp.gate.weight", 1),
}
# MoE expert weights (Qwen3-MoE): ours [X, ...] per layer; HF per expert j (the layout of the
# published checkpoints and of transformers' save_pretrained) inside `model.layers.{i}.`:
_EXPERT_TENSORS = {
    "experts_gate": "mlp.experts.{j}.gate_proj.weight",  # [F, E] <- ours [E, F]
    "experts_up": "mlp.experts.{j}.up_proj.weight",      # [F, E]
    "experts_down": "mlp.experts.{j}.down_proj.weight",  # [E, F] <- ours [F, E]
}
# ... or fused, as transformers 5 holds them in memory (save_pretrained(save_original_format=
# False) writes this): gate_up_proj [X, 2F, E] (gate rows first), down_proj [X, E, F].
_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_DOWN = "mlp.experts.down_proj"


# ------------------------------------------------------------------------------------------------
# Safetensors reading.


class _TensorRef(NamedTuple):
  """Where one tensor lives: file, numpy dtype, shape, absolute byte range."""
  file: pathlib.Path
  dtype: np.dtype
  shape: tuple[int, ...]
  start: int
  end: int


def _read_header(file: pathlib.Path) -> dict[str, _TensorRef]:
  """Parses one safetensors header into name -> _TensorRef, validating sizes and offsets."""
  size = file.stat().st_size
  with open(file, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    if n <= 0 or n > _MAX_HEADER_BYTES or 8 + n > size:
      raise ValueError(f"{file} is not a valid safetensors file (header length {n}).")
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  refs = {}
  for name, entry in header.items():
    if entry["dtype"] not in _ST_DTYPES:
      raise ValueError(f"Tensor {name!r} in {file} has dtype {entry['dtype']}; supported: "
                       f"{sorted(_ST_DTYPES)}.")
    dtype = jnp.dtype(_ST_DTYPES[entry["dtype"]])
    shape = tuple(int(s) for s in entry["shape"])
    begin, end = (int(o) for o in entry["data_offsets"])
    if end - begin != math.prod(shape) * dtype.itemsize or 8 + n + end > size:
      raise ValueError(f"Tensor {name!r} in {file}: offsets {begin}..{end} do not fit shape "
                       f"{shape} {entry['dtype']} or the file size {size}.")
    refs[name] = _TensorRef(file, dtype, shape, 8 + n + begin, 8 + n + end)
  return refs


def _read_tensor(ref: _TensorRef) -> np.ndarray:
  """Memory-maps one tensor (little-endian bytes reinterpreted in place; read-only)."""
  if sys.byteorder != "little":
    raise NotImplementedError("Reading safetensors requires a little-endian host.")
  raw = np.memmap(ref.file, dtype=np.uint8, mode="r", offset=ref.start,
                  shape=(ref.end - ref.start,))
  return raw.view(ref.dtype).reshape(ref.shape)


def _checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
  """The safetensors file(s) of a checkpoint directory (single file first, as HF does)."""
  if (path / _SINGLE_FILE).is_file():
    return [path / _SINGLE_FILE]
  if (path / _INDEX_FILE).is_file():
    index = json.loads((path / _INDEX_FILE).read_text())
    files = [path / name for name in sorted(set(index["weight_map"].values()))]
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
      raise FileNotFoundError(f"{path / _INDEX_FILE} lists shard(s) that do not exist: {absent}.")
    return files
  raise FileNotFoundError(f"No {_SINGLE_FILE} or {_INDEX_FILE} in {path} (pickled .bin "
                          "checkpoints are not supported; re-save with safe_serialization=True).")


def _index_tensors(files: list[pathlib.Path]) -> dict[str, _TensorRef]:
  refs: dict[str, _TensorRef] = {}
  for file in files:
    for name, ref in _read_header(file).items():
      if name in refs:
        raise ValueError(f"Tensor {name!r} appears in both {refs[name].file} and {file}.")
      refs[name] = ref
  return refs


# ------------------------------------------------------------------------------------------------
# Name and layout mapping.


Kind = int | str  # layout kind, see TOP_TENSORS


_STACKS = ("layers", "moe_layers")


def _stack_layers(cfg: ModelConfig, stack: str) -> list[int]:
  """Model layer indices of the blocks of params[stack], in stack order."""
  return [i for i, moe in enumerate(cfg.layer_is_moe) if moe == (stack == "moe_layers")]


def _hf_names(cfg: ModelConfig, fused_experts: bool = False
              ) -> dict[tuple[Any, ...], tuple[str, Kind]]:
  """Our param path -> (HF tensor name, layout kind), in HF's order (by model layer).

  Paths: ("embed",), (stack, name, i) for block i of params[stack] ("layers" / "moe_layers"),
  (stack, name, i, j) for expert j of an expert weight. With fused_experts, the expert weights
  map as ("moe_layers", "experts_gate_up", i) -> (gate_up_proj, "gate_up") and
  ("moe_layers", "experts_down", i) -> (down_proj, "xdown") instead.
  """
  specs = transformer.param_specs(cfg)
  names = {(k,): TOP_TENSORS[k] for k in specs if k not in _STACKS}
  index = {g: (stack, i) for stack in _STACKS if stack in specs
           for i, g in enumerate(_stack_layers(cfg, stack))}
  for g in range(cfg.n_layers):
    stack, i = index[g]
    for k in specs[stack]:
      if k in _EXPERT_TENSORS:
        if not fused_experts:
          for j in range(cfg.n_experts):
            names[(stack, k, i, j)] = (f"model.layers.{g}.{_EXPERT_TENSORS[k].format(j=j)}", 1)
        elif k == "experts_gate":
          names[(stack, "experts_gate_up", i)] = (f"model.layers.{g}.{_FUSED_GATE_UP}", "gate_up")
        elif k == "experts_down":
          names[(stack, k, i)] = (f"model.layers.{g}.{_FUSED_DOWN}", "xdown")
        continue
      hf, kind = LAYER_TENSORS[k]
      names[(stack, k, i)] = (f"model.layers.{g}.{hf}", kind)
  return names


def _hf_shape(shape: tuple[int, ...], kind: Kind) -> tuple[int, ...]:
  """HF shape of a tensor whose layout here (without the layer axis) is `shape`."""
  if kind == "same":
    return shape
  if kind == "vec":
    return (math.prod(shape),)
  return (math.prod(shape[kind:]), math.prod(shape[:kind]))


def _to_ours(hf: np.ndarray, shape: tuple[int, ...], kind: Kind) -> np.ndarray:
  """HF tensor -> our layout `shape`, e.g. q_proj [H*D, E] -> wq [E, H, D] (transpose, split)."""
  return (hf if isinstance(kind, str) else hf.T).reshape(shape)


def _to_hf(ours: np.ndarray, kind: Kind) -> np.ndarray:
  """Our layout -> HF tensor (contiguous); the inverse of `_to_ours`."""
  hf_shape = _hf_shape(ours.shape, kind)
  if isinstance(kind, str):
    return np.ascontiguousarray(ours.reshape(hf_shape))
  return np.ascontiguousarray(ours.reshape(hf_shape[::-1]).T)


def _resolve_dtype(refs: Mapping[str, _TensorRef], used: list[str],
                   param_dtype: str | None) -> str:
  if param_dtype is not None:
    return param_dtype
  found = sorted({refs[n].dtype.name for n in used})
  if len(found) != 1 or found[0] not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"Checkpoint tensors have dtype(s) {found}; pass param_dtype= "
                     "('float32', 'bfloat16' or 'float16') to cast them.")
  return found[0]


def _check_names(refs: Mapping[str, _TensorRef], expected: set[str], cfg: ModelConfig,
                 files: list[pathlib.Path]) -> None:
  """Raises on missing or unexpected tensors (a tied lm_head equal to the embedding is fine)."""
  missing = sorted(expected - set(refs))
  if missing:
    raise ValueError(f"Missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                     f"(searched {[str(f) for f in files]}).")
  extra = sorted(n for n in set(refs) - expected if not n.endswith(_IGNORED_SUFFIXES))
  if cfg.tie_embeddings and "lm_head.weight" in extra:
    if not np.array_equal(_read_tensor(refs["lm_head.weight"]),
                          _read_tensor(refs["model.embed_tokens.weight"])):
      raise ValueError("tie_word_embeddings=true but lm_head.weight differs from "
                       "model.embed_tokens.weight.")
    extra.remove("lm_head.weight")
  if extra:
    raise ValueError(f"Unexpected tensor(s) {extra[:8]}{' ...' if len(extra) > 8 else ''} in "
                     f"{[str(f) for f in files]}: the checkpoint has parameters this model does "
                     "not use.")


def _place(arr: np.ndarray, shardings, path: tuple[str, ...]):
  if shardings is None:
    return arr
  sharding = shardings
  for key in path:
    sharding = sharding[key]
  return jax.device_put(arr, sharding)


def load_hf_checkpoint(path: str | os.PathLike, *, param_dtype: str | None = None,
                       shardings=None) -> tuple[ModelConfig, dict[str, Any]]:
  """Loads a HF Llama / Qwen2 / Qwen3 causal-LM safetensors checkpoint directory.

  Args:
    path: directory with config.json and model.safetensors (or model.safetensors.index.json and
      its shards), as written by `save_pretrained(safe_serialization=True)`.
    param_dtype: cast every parameter to this dtype ("float32", "bfloat16", "float16");
      None keeps the checkpoint dtype (which must then be one of those, the same for all).
    shardings: optional tree of `jax.sharding.Sharding` matching `param_specs(cfg)`; each array
      is then placed with `jax.device_put` as soon as it is assembled (one stacked tensor on the
      host at a time). None returns host numpy arrays.

  Returns:
    (cfg, params): cfg from `config_from_hf` with the resolved param_dtype; params in the layout
    of `transformer.param_specs(cfg)`, layers stacked on a leading L axis.

  Raises:
    FileNotFoundError: no config.json or no safetensors weights (pickled .bin is refused).
    (generation_config.json is optional; its eos_token_id joins config.json's.)
    ValueError: unsupported architecture or feature (see `config_from_hf`), a missing tensor
      (named, with the files searched), unexpected tensors (named), a tensor of the wrong shape,
      or mixed checkpoint dtypes with param_dtype=None.

  Example:
    >>> cfg, params = load_hf_checkpoint("Qwen3-0.6B", param_dtype="bfloat16")
    >>> logits, _ = transformer.forward(params, tokens_BT, positions_BT, cfg)
  """
  path = pathlib.Path(path)
  if not (path / _CONFIG_FILE).is_file():
    raise FileNotFoundError(f"No {_CONFIG_FILE} in {path}.")
  hf_config = json.loads((path / _CONFIG_FILE).read_text())
  generation = (json.loads((path / _GENERATION_FILE).read_text())
                if (path / _GENERATION_FILE).is_file() else None)
  cfg = config_from_hf(hf_config, generation_config=generation)
  files = _checkpoint_files(path)
  refs = _index_tensors(files)
  if hf_gpt_oss.is_gpt_oss(cfg):
    return _load_gpt_oss(cfg, refs, files, param_dtype, shardings)
  names = _hf_names(cfg, fused_experts=any(n.endswith(_FUSED_GATE_UP) for n in refs))
  _check_names(refs, {hf for hf, _ in names.values()}, cfg, files)
  cfg = dataclasses.replace(
      cfg, param_dtype=_resolve_dtype(refs, [hf for hf, _ in names.values()], param_dtype))
  dtype = jnp.dtype(cfg.param_dtype)

  def read(hf_name: str, shape: tuple[int, ...], kind: Kind) -> np.ndarray:
    ref = refs[hf_name]
    if ref.shape != _hf_shape(shape, kind):
      raise ValueError(f"Tensor {hf_name!r} in {ref.file} has shape {ref.shape}; config.json "
                       f"implies {_hf_shape(shape, kind)}.")
    return _to_ours(_read_tensor(ref), shape, kind)

  def read_fused(hf_name: str, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """Fused expert tensor -> ours: gate_up [X, 2F, E] -> (gate, up) [X, E, F] each, stacked on
    a new leading axis; down [X, E, F] -> [X, F, E]."""
    x, a, b = shape  # ours: [X, E, F] (gate / up) or [X, F, E] (down)
    ref = refs[hf_name]
    want = (x, 2 * b, a) if kind == "gate_up" else (x, b, a)
    if ref.shape != want:
      raise ValueError(f"Tensor {hf_name!r} in {ref.file} has shape {ref.shape}; config.json "
                       f"implies {want}.")
    arr = np.swapaxes(_read_tensor(ref), 1, 2)
    return np.stack([arr[..., :b], arr[..., b:]]) if kind == "gate_up" else arr

  specs = transformer.param_specs(cfg)
  params: dict[str, Any] = {}
  for key, spec in specs.items():
    if key not in _STACKS:
      shape, hf_name, kind = spec[0], *names[(key,)]
      params[key] = _place(np.array(read(hf_name, shape, kind), dtype), shardings, (key,))
  for stack in _STACKS:
    if stack not in specs:
      continue
    params[stack] = {}
    for key, (shape, _) in specs[stack].items():
      stacked = np.empty(shape, dtype)
      for i in range(shape[0]):
        if key in _EXPERT_TENSORS and (stack, key, i, 0) in names:
          for j in range(shape[1]):
            stacked[i, j] = read(*names[(stack, key, i, j)][:1], shape[2:], 1)
        elif key in ("experts_gate", "experts_up"):
          hf_name, kind = names[(stack, "experts_gate_up", i)]
          stacked[i] = read_fused(hf_name, kind, shape[1:])[int(key == "experts_up")]
        else:
          hf_name, kind = names[(stack, key, i)]
          stacked[i] = (read_fused(hf_name, kind, shape[1:]) if kind == "xdown"
                        else read(hf_name, shape[1:], kind))
      params[stack][key] = _place(stacked, shardings, (stack, key))
  return cfg, params


def _load_gpt_oss(cfg: ModelConfig, refs: Mapping[str, _TensorRef], files: list[pathlib.Path],
                  param_dtype: str | None, shardings) -> tuple[ModelConfig, dict[str, Any]]:
  """`load_hf_checkpoint` for GPT-OSS: names and layouts from `hf_gpt_oss` (MXFP4 experts are
  dequantized); every layer is MoE, so the blocks stack under params["moe_layers"]."""
  expected = hf_gpt_oss.hf_tensor_names(cfg, set(refs))
  _check_names(refs, expected, cfg, files)
  floats = [n for n in expected if refs[n].dtype != np.uint8]
  cfg = dataclasses.replace(cfg, param_dtype=_resolve_dtype(refs, floats, param_dtype))
  dtype = jnp.dtype(cfg.param_dtype)
  read = lambda name: _read_tensor(refs[name])
  top = {"embed": ("model.embed_tokens.weight", "same"), "final_norm": ("model.norm.weight",
                                                                       "vec"),
         "lm_head": ("lm_head.weight", 1)}
  specs = transformer.param_specs(cfg)
  params: dict[str, Any] = {}
  for key in (k for k in specs if k in top):
    shape, (hf_name, kind) = specs[key][0], top[key]
    if refs[hf_name].shape != _hf_shape(shape, kind):
      raise ValueError(f"Tensor {hf_name!r} has shape {refs[hf_name].shape}; config.json "
                       f"implies {_hf_shape(shape, kind)}.")
    params[key] = _place(np.array(_to_ours(read(hf_name), shape, kind), dtype), shardings,
                         (key,))
  layers = [hf_gpt_oss.layer_from_hf(read, set(refs), i, cfg) for i in range(cfg.n_layers)]
  params["moe_layers"] = {
      key: _place(np.stack([lp[key] for lp in layers]).astype(dtype), shardings,
                  ("moe_layers", key)) for key in specs["moe_layers"]}
  return cfg, params


# ------------------------------------------------------------------------------------------------
# Export.


def _plan_shards(sizes: list[int], max_shard_bytes: int | None) -> list[list[int]]:
  """Greedy, order-preserving split of tensor indices into shards of <= max_shard_bytes each
  (a tensor larger than the limit gets a shard of its own)."""
  if max_shard_bytes is None:
    return [list(range(len(sizes)))]
  if max_shard_bytes < 1:
    raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1.")
  shards, current, current_bytes = [], [], 0
  for i, size in enumerate(sizes):
    if current and current_bytes + size > max_shard_bytes:
      shards.append(current)
      current, current_bytes = [], 0
    current.append(i)
    current_bytes += size
  shards.append(current)
  return shards


def _check_params(params: Mapping[str, Any], cfg: ModelConfig) -> None:
  """Raises unless params has exactly the arrays and shapes `param_specs(cfg)` asks for."""
  def flat(tree, leaf):
    out = {k: leaf(v) for k, v in tree.items() if k not in _STACKS}
    for stack in _STACKS:
      out.update({f"{stack}/{k}": leaf(v) for k, v in tree.get(stack, {}).items()})
    return out
  want = flat(transformer.param_specs(cfg), lambda spec: spec[0])
  have = flat(params, lambda a: tuple(a.shape))
  for name in sorted(set(want) | set(have)):
    if want.get(name) != have.get(name):
      raise ValueError(f"params {name} has shape {have.get(name)}; cfg implies {want.get(name)} "
                       "(None = absent; check qkv_bias, qk_norm, tie_embeddings).")


def _gpt_oss_entries(params: Mapping[str, Any], cfg: ModelConfig) -> list[tuple[str, Any, Kind]]:
  """(HF name, HF-layout array, "same") of every GPT-OSS tensor, embedding first."""
  entries = [("model.embed_tokens.weight", params["embed"], "same")]
  for i in range(cfg.n_layers):
    lp = {k: v[i] for k, v in params["moe_layers"].items()}
    entries += [(n, a, "same") for n, a in hf_gpt_oss.layer_to_hf(lp, i, cfg).items()]
  entries.append(("model.norm.weight", params["final_norm"], "same"))
  if not cfg.tie_embeddings:
    entries.append(("lm_head.weight", np.ascontiguousarray(params["lm_head"].T), "same"))
  return entries


def save_hf_checkpoint(path: str | os.PathLike, params: Mapping[str, Any], cfg: ModelConfig, *,
                       architecture: str | None = None, max_shard_bytes: int | None = None,
                       extra_config: Mapping[str, Any] | None = None) -> list[pathlib.Path]:
  """Writes params as a HF checkpoint directory that transformers (or vLLM, ...) can load.

  Tensors keep their dtypes (cast the tree first to export another dtype); config.json records
  the embedding's dtype. Device arrays are fetched to host memory once (one plain transfer per
  array, nothing compiled); HF-layout copies are then made shard by shard.

  Args:
    path: target directory (created if needed); must not already hold a checkpoint.
    params: tree in the layout of `transformer.param_specs(cfg)` (numpy or jax arrays).
    cfg: the model configuration.
    architecture: one of SUPPORTED_ARCHITECTURES; None = `architecture_for(cfg)`.
    max_shard_bytes: None writes one model.safetensors; otherwise shards of at most this many
      bytes (a bigger tensor gets its own shard) plus model.safetensors.index.json, or a single
      model.safetensors when everything fits in one shard.
    extra_config: more config.json fields (e.g. bos_token_id, eos_token_id); may repeat but not
      change fields derived from cfg (eos_token_id comes from cfg.eos_token_ids when set).

  Returns:
    The paths written.

  Raises:
    ValueError: params do not match cfg (the parameter is named), the architecture cannot express
      cfg, extra_config collides with a derived field, or an invalid max_shard_bytes.
    FileExistsError: path already holds a checkpoint.

  Example:
    >>> save_hf_checkpoint("out/hf", params, cfg, extra_config={"eos_token_id": 2})
  """
  path = pathlib.Path(path)
  _check_params(params, cfg)
  hf_config = config_to_hf(cfg, architecture=architecture,
                           dtype=jnp.dtype(params["embed"].dtype).name)
  clash = sorted(k for k in set(extra_config or {}) & set(hf_config)
                 if extra_config[k] != hf_config[k])
  if clash:
    raise ValueError(f"extra_config may not override derived config.json field(s) {clash} "
                     "with other values.")
  hf_config.update(extra_config or {})
  existing = sorted(p.name for p in path.glob("model*.safetensors*")) if path.is_dir() else []
  if existing or (path / _CONFIG_FILE).exists():
    raise FileExistsError(f"{path} already holds a checkpoint ({existing or _CONFIG_FILE}).")

  # Imported here: reading needs no safetensors package, so neither does importing the model.
  from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  params = jax.tree.map(np.asarray, params)
  def tensor(p):  # (name,), (stack, name, i) or (stack, name, i, expert j)
    arr = params[p[0]]
    for key in p[1:]:
      arr = arr[key]
    return arr
  if hf_gpt_oss.is_gpt_oss(cfg):
    entries = _gpt_oss_entries(params, cfg)
  else:
    entries = [(hf_name, tensor(p), kind)
               for p, (hf_name, kind) in _hf_names(cfg).items()]  # in HF's tensor order
  shards = _plan_shards([arr.nbytes for _, arr, _ in entries], max_shard_bytes)
  n = len(shards)
  file_names = ([_SINGLE_FILE] if n == 1 else
                [f"model-{s + 1:05d}-of-{n:05d}.safetensors" for s in range(n)])
  path.mkdir(parents=True, exist_ok=True)
  written, weight_map = [], {}
  for file_name, shard in zip(file_names, shards):
    tensors = {}
    for j in shard:
      hf_name, arr, kind = entries[j]
      tensors[hf_name] = _to_hf(arr, kind)
      weight_map[hf_name] = file_name
    from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
    st_numpy.save_file(tensors, str(path / file_name), metadata={"format": "pt"})
    written.append(path / file_name)
  if n > 1:
    index = {"metadata": {"total_size": sum(arr.nbytes for _, arr, _ in entries)},
             "weight_map": weight_map}
    (path / _INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    written.append(path / _INDEX_FILE)
  (path / _CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
  written.append(path / _CONFIG_FILE)
  return written
