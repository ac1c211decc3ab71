"""Decoder-only transformer (Llama-3 / Qwen2 / Qwen3 family), KV-cache interface, HF import."""

from rlax_pipe.model.hf_io import (
    SUPPORTED_ARCHITECTURES, architecture_for, config_from_hf, config_to_hf, eos_token_ids,
    load_hf_checkpoint, save_hf_checkpoint)
from rlax_pipe.model.kv_cache import DenseKVCache, KVCache, gqa_attention
from rlax_pipe.model.transformer import (
    abstract_params, forward, hidden_states, init_params, param_axes, param_specs, rms_norm, rope)

__all__ = [
    "SUPPORTED_ARCHITECTURES", "architecture_for", "config_from_hf", "config_to_hf",
    "eos_token_ids", "load_hf_checkpoint", "save_hf_checkpoint", "hidden_states",
    "DenseKVCache", "KVCache", "abstract_params", "forward", "gqa_attention", "init_params",
    "param_axes", "param_specs", "rms_norm", "rope",
]
