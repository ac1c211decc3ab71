"""Decoder-only transformer (Llama-3 / Qwen2 / Qwen3 family), KV-cache interface, HF import."""

from rlax_pipe.model.kv_cache import DenseKVCache, KVCache, gqa_attention
from rlax_pipe.model.transformer import (
    abstract_params, forward, init_params, param_axes, param_specs, rms_norm, rope)

__all__ = [
    "DenseKVCache", "KVCache", "abstract_params", "forward", "gqa_attention", "init_params",
    "param_axes", "param_specs", "rms_norm", "rope",
]
