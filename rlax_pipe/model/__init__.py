"""Models behind one interface: `Model` (api), the built-in Llama-3 / Qwen2 / Qwen3 decoder
(`Transformer`, pure functions in `transformer`; mixture-of-experts layers in `moe`), a flax NNX adapter (`NnxModel`), the KV-cache
interface and its dense reference cache, HF checkpoint import/export of the built-in model, LoRA
adapters on any model (`LoraAdapters`, merged W + alpha/r B A) and their PEFT export.

Sampler, learner and job receive a `Model` (or a `ModelConfig`, turned into the built-in model by
`as_model`); the KV-cache contract a model honours is written in `rlax_pipe.model.api`.
"""

from rlax_pipe.model.api import HiddenStatesModel, Model, attend_with_cache, packed_causal_mask
from rlax_pipe.model.builtin import ModelLike, Transformer, as_model
from rlax_pipe.model.hf_io import (
    SUPPORTED_ARCHITECTURES, architecture_for, config_from_hf, config_to_hf, eos_token_ids,
    load_hf_checkpoint, save_hf_checkpoint)
from rlax_pipe.model.kv_cache import DenseKVCache, KVCache, gqa_attention
from rlax_pipe.model.lora import LoraAdapters, adapters_for
from rlax_pipe.model.lora_hf import save_peft_adapter
from rlax_pipe.model.moe import MoeOutputs
from rlax_pipe.model.moe_parallel import expert_parallel_swiglu
from rlax_pipe.model.nnx_adapter import NnxModel
from rlax_pipe.model.train_attention import (
    TRAIN_ATTENTION_IMPLS, flash_attention, resolve_train_attention)
from rlax_pipe.model.transformer import (
    abstract_params, forward, hidden_states, init_params, layer_segments, param_axes, param_specs,
    rms_norm, rope)

__all__ = [
    "HiddenStatesModel", "LoraAdapters", "Model", "ModelLike", "NnxModel", "Transformer",
    "adapters_for", "as_model", "save_peft_adapter", "MoeOutputs", "layer_segments",
    "attend_with_cache",
    "packed_causal_mask",
    "SUPPORTED_ARCHITECTURES", "architecture_for", "config_from_hf", "config_to_hf",
    "eos_token_ids", "load_hf_checkpoint", "save_hf_checkpoint", "hidden_states",
    "DenseKVCache", "KVCache", "abstract_params", "forward", "gqa_attention", "init_params",
    "param_axes", "param_specs", "rms_norm", "rope", "expert_parallel_swiglu",
    "TRAIN_ATTENTION_IMPLS", "flash_attention", "resolve_train_attention",
]
