"""The built-in model: the Llama-3 / Qwen2 / Qwen3 decoder of `transformer.py` behind `api.Model`.

`Transformer(cfg)` wraps the pure functions of `transformer.py` (params are its plain nested
dict; layers stacked on a leading axis and run with `lax.scan`); `hf_io` reads and writes its
params as HF safetensors checkpoints. `as_model` is the one place a `ModelConfig` becomes a
model, so code that receives "a model" also accepts a config of the built-in family.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax

from rlax_pipe.config import ModelConfig
from rlax_pipe.model import api
from rlax_pipe.model import transformer

# What sampler, learner and job accept as "the model": a model, or a config of the built-in one.
ModelLike = Union[api.Model, ModelConfig]


@dataclasses.dataclass(frozen=True)
class Transformer:
  """The built-in decoder as an `api.Model` (hashable: usable as a static jit argument).

  Attributes:
    cfg: its architecture and dtypes (`ModelConfig`).

  Example:
    >>> model = Transformer(ModelConfig(vocab_size=256))
    >>> params = model.init_params(jax.random.key(0))
    >>> logits, _ = model.forward(params, tokens_BT, positions_BT)
  """

  cfg: ModelConfig

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  @property
  def max_seq_len(self) -> int:
    return self.cfg.max_seq_len

  @property
  def n_layers(self) -> int:
    return self.cfg.n_layers

  @property
  def n_kv_heads(self) -> int:
    return self.cfg.n_kv_heads

  @property
  def head_dim(self) -> int:
    return self.cfg.head_dim

  @property
  def compute_dtype(self) -> str:
    """Dtype of activations and matmuls (logits are always float32)."""
    return self.cfg.compute_dtype

  @property
  def lora_input_dims(self) -> dict[str, int]:
    """Input axes (after the layer axis) of weights whose input is not just their first axis:
    wo [H, D, E] takes H x D inputs (`model.lora`; every other matrix has one input axis)."""
    return {"wo": 2}

  def with_compute_dtype(self, dtype: str) -> "Transformer":
    """The same model computing in `dtype` (same params; e.g. a bf16 sampler, ablation A9)."""
    return Transformer(dataclasses.replace(self.cfg, compute_dtype=dtype))

  def abstract_params(self) -> Any:
    """`transformer.abstract_params`: a ShapeDtypeStruct per parameter, in cfg.param_dtype."""
    return transformer.abstract_params(self.cfg)

  def param_axes(self) -> Any:
    """`transformer.param_axes`: logical axis names per parameter."""
    return transformer.param_axes(self.cfg)

  def init_params(self, rng: jax.Array) -> Any:
    """`transformer.init_params` (truncated-normal matrices, unit norms, zero biases)."""
    return transformer.init_params(self.cfg, rng)

  @property
  def n_moe_layers(self) -> int:
    """MoE layers L_moe (0 for a dense model): the third axis of routes [B, T, L_moe, k]."""
    return self.cfg.n_moe_layers

  def hidden_states(self, params, tokens_BT, positions_BT, *, segment_ids_BT=None,
                    remat="none", constrain=None, attention_block_len=None, routes_BTLk=None,
                    return_moe=False, attention_impl="blockwise"):
    """`transformer.hidden_states` (api.HiddenStatesModel): the learner's training path.

    MoE models also take `routes_BTLk` (router replay) and `return_moe` (see `forward`)."""
    return transformer.hidden_states(params, tokens_BT, positions_BT, self.cfg,
                                     segment_ids_BT=segment_ids_BT, remat=remat,
                                     constrain=constrain,
                                     attention_block_len=attention_block_len,
                                     routes_BTLk=routes_BTLk, return_moe=return_moe,
                                     attention_impl=attention_impl)

  def output_head(self, params):
    """`transformer.output_head`: the [E, V] projection (the transposed embedding if tied)."""
    return transformer.output_head(params, self.cfg)

  def forward(self, params, tokens_BT, positions_BT, *, segment_ids_BT=None, cache=None,
              valid_BT=None, remat=False, routes_BTLk=None, return_moe=False):
    """`transformer.forward`: float32 logits [B, T, V] and the updated cache (api contract).

    MoE models (cfg.n_experts > 0) also take `routes_BTLk` (int32 [B, T, L_moe, k], router
    replay) and, with `return_moe=True`, return a third element `moe.MoeOutputs` (routes used,
    load-balance and z losses; None for a dense model)."""
    return transformer.forward(params, tokens_BT, positions_BT, self.cfg,
                               segment_ids_BT=segment_ids_BT, cache=cache, valid_BT=valid_BT,
                               remat=remat, routes_BTLk=routes_BTLk, return_moe=return_moe)


def as_model(model: ModelLike) -> api.Model:
  """`model` itself, or the built-in `Transformer` of a `ModelConfig`.

  Raises:
    TypeError: if `model` is neither a `ModelConfig` nor satisfies `api.Model` (the message
      names the missing members).
  """
  if isinstance(model, ModelConfig):
    return Transformer(model)
  if isinstance(model, api.Model):
    return model
  missing = [n for n in ("vocab_size", "max_seq_len", "n_layers", "n_kv_heads", "head_dim",
                         "abstract_params", "param_axes", "init_params", "forward")
             if not hasattr(model, n)]
  raise TypeError(f"expected a ModelConfig or an rlax_pipe.model.Model, got "
                  f"{type(model).__name__} (missing {missing}); wrap a flax NNX module with "
                  "rlax_pipe.model.NnxModel.")
