"""The model interface the sampler, the learner and the job are handed, and the KV-cache contract.

Nothing outside `rlax_pipe.model` imports a concrete model: the sampler engine, the train step,
evaluation, SFT and the job receive an object satisfying `Model` and call only what it declares.
Two implementations ship: `builtin.Transformer` (the Llama-3 / Qwen2 / Qwen3 family of
`transformer.py`, importable from HF checkpoints) and `nnx_adapter.NnxModel` (any user
`flax.nnx.Module` that honours the call convention below). `as_model` turns a `ModelConfig` into
the built-in model, so callers may still pass a config where a model is expected.

Params are a plain pytree of arrays (nested dicts with string keys): it is what the optimizer
updates, the weight channel copies to the sampler, the checkpoint saves and the engine runs.
Shardings come from `param_axes()` (one tuple of logical axis names of `rlax_pipe.sharding` per
array) through the rules table of each mesh, and are derived from `abstract_params()` before
anything is allocated.

The KV-cache contract (the one place it is written down)
--------------------------------------------------------
`forward(params, tokens_BT, positions_BT, *, segment_ids_BT, cache, valid_BT, remat)` runs in two
modes and returns `(logits float32 [B, T, V], cache or None)`:

* **No cache** (training, scoring): whole sequences; token t of row b attends to tokens s <= t
  of the same row that carry the same `segment_ids_BT` value (packing: several samples per row;
  segment 0 is padding, which attends only to padding). `positions_BT` restart at 0 for every
  packed sample and are the positions the model must embed (RoPE or otherwise).
* **With a cache** (sampling): `cache` is a pytree (the paged cache of `rlax_pipe.sampler` or
  `kv_cache.DenseKVCache`) that holds the keys and values of `n_layers` layers, each with
  `n_kv_heads` heads of width `head_dim` (the geometry the model declares; the sampler sizes its
  page pool from it). For every layer l, in order, the model computes that layer's queries
  [B, T, H, D] and its new keys / values [B, T, K, D] (with positional encoding already applied
  to keys) and calls `out_BTHD, cache = attend_with_cache(cache, l, q, k, v, positions_BT,
  valid_BT)` (= `cache.update_attend(l, q, k, v, positions_BT, valid_BT)`); then it returns the
  cache of the last call. The cache writes the keys / values of the tokens where `valid_BT` is
  True at their `positions_BT`, in place, and returns, for each query at position p, attention
  over every cached entry of its row at positions <= p (including the ones just written). Tokens
  with `valid_BT` False write nothing and their outputs are ignored. T > 1 is a prefill, T == 1
  a decode step. The model carries the cache from call to call (a Python loop, or the carry of
  a `lax.scan` over layers with `l` an int32 scalar) and never reads, slices or rebuilds the
  cache's arrays itself: slicing one layer out and writing it back would copy that layer of the
  whole pool on every call (issue #10), and the paged pool folds layers into its page axis. So
  one model runs on every cache implementation, whatever its layout.

Both modes must give the same logits for the same tokens (the sampler's behaviour log-probs and
the learner's recomputed ones come from the two modes), and `forward` must be a pure function of
its arguments so it can be jitted with the model as a static argument: a model is hashable and
compares equal to an identically built one.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp


@runtime_checkable
class Model(Protocol):
  """What sampler, learner and job need from a decoder-only language model.

  Attributes:
    vocab_size: number of token ids; logits have this last dimension.
    max_seq_len: longest sequence (prompt + completion, tokens) the model may be run on.
    n_layers: layers of the KV cache (`attend_with_cache` is called once per layer).
    n_kv_heads: key / value heads per layer in the cache.
    head_dim: width of one cached key / value head.
  """

  vocab_size: int
  max_seq_len: int
  n_layers: int
  n_kv_heads: int
  head_dim: int

  def abstract_params(self) -> Any:
    """Params tree with a `jax.ShapeDtypeStruct` per leaf (no allocation)."""
    ...

  def param_axes(self) -> Any:
    """Params tree with a tuple of logical axis names (`rlax_pipe.sharding`) per leaf."""
    ...

  def init_params(self, rng: jax.Array) -> Any:
    """Random initial params (pure; jit it with `out_shardings` to create them sharded)."""
    ...

  def forward(self, params: Any, tokens_BT: jax.Array, positions_BT: jax.Array, *,
              segment_ids_BT: jax.Array | None = None, cache: Any = None,
              valid_BT: jax.Array | None = None, remat: bool = False) -> tuple[jax.Array, Any]:
    """Logits float32 [B, T, V] and the updated cache (None without one); see the module doc."""
    ...


@runtime_checkable
class HiddenStatesModel(Model, Protocol):
  """Optional, for a learner at scale: the forward split before the output projection.

  A model that also offers these two methods lets the learner (a) compute log-probs from hidden
  states in chunks of positions, never holding [rows, T, V] logits, and (b) place its weights
  and activations with a sharding hook (FSDP: weights gathered per layer, activations split over
  the batch axes). A model with `forward` only is trained from full logits, with XLA's default
  layouts. `output_head(params) @ hidden_states(...)` must equal `forward`'s logits (float32).
  """

  def hidden_states(self, params: Any, tokens_BT: jax.Array, positions_BT: jax.Array, *,
                    segment_ids_BT: jax.Array | None = None, remat: str = "none",
                    constrain: Any = None,
                    attention_block_len: int | None = None,
                    attention_impl: str = "blockwise") -> jax.Array:
    """Final normalised hidden states [B, T, E] of the cache-free forward.

    `remat` is one of "none", "full", "dots_saveable"; `constrain(x, logical_axes, weight=False)`
    is a sharding hook called on each weight (weight=True) and on activations;
    `attention_block_len` bounds the queries attended at once (None = all); `attention_impl`
    is "blockwise" or a fused kernel name (`train_attention.KERNELS`), passed only when not
    "blockwise" (a model without the keyword trains with its own attention)."""
    ...

  def output_head(self, params: Any) -> jax.Array:
    """The [E, V] output projection (logits = hidden @ head, in float32)."""
    ...


def attend_with_cache(cache: Any, layer: int | jax.Array, q_BTHD: jax.Array, k_BTKD: jax.Array,
                      v_BTKD: jax.Array, positions_BT: jax.Array,
                      valid_BT: jax.Array) -> tuple[jax.Array, Any]:
  """One layer's cached attention: `cache.update_attend(layer, ...)` (see the module docstring).

  Writes the new keys / values of layer `layer` into `cache` (in place when the cache is
  carried and donated) and attends over the row's cached entries at positions <= each query's.

  Args:
    cache: a KV cache pytree (`kv_cache.KVCache`: the paged or the dense cache).
    layer: layer index in [0, n_layers) (a Python int or an int32 scalar).
    q_BTHD: [B, T, H, D] queries; H must be a multiple of the cache's K.
    k_BTKD: [B, T, K, D] new keys, positional encoding applied.
    v_BTKD: [B, T, K, D] new values.
    positions_BT: int32 [B, T] absolute positions of the new tokens.
    valid_BT: bool [B, T]; False tokens write nothing.

  Returns:
    (out [B, T, H, D] in q's dtype, the updated cache).
  """
  return cache.update_attend(layer, q_BTHD, k_BTKD, v_BTKD, positions_BT, valid_BT)


def packed_causal_mask(segment_ids_BT: jax.Array) -> jax.Array:
  """The cache-free attention mask of the contract: causal within equal segment ids.

  Args:
    segment_ids_BT: int32 [B, T] packing ids (0 = padding).

  Returns:
    bool [B, T, T]; [b, t, s] is True iff s <= t and segment_ids[b, t] == segment_ids[b, s].
  """
  t = segment_ids_BT.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  same = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  return causal[None] & same
