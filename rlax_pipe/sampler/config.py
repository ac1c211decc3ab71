"""Configuration of the paged-KV sampler and the request message it accepts.

Letters: B decode slots, P pages in the pool, S page size (tokens per page).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from rlax_pipe.logprobs import SamplingConfig

KV_POLICIES: tuple[str, ...] = ("keep", "recompute")
# "auto" picks by platform: pallas_gpu on GPU, pallas_tpu on TPU, reference elsewhere.
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "reference", "pallas_gpu", "pallas_tpu",
                                    "pallas_tpu_ragged")
CACHE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Paged-KV continuous-batching sampler.

  Attributes:
    num_slots: decode slots B, i.e. the static batch of every decode step [B, 1] (>= 1).
    page_size: tokens per KV page S (>= 1).
    num_pages: pages P in the pool, shared by all slots (>= 1). One sequence of n tokens holds
      ceil(n / S) pages; a request whose longest possible sequence needs more pages than the
      pool has is rejected at submission.
    max_seq_len: longest sequence in tokens, prompt + completion (>= 2). Fixes the block-table
      width ceil(max_seq_len / S) and the largest prefill bucket.
    max_new_tokens: default completion budget in tokens (>= 1) when a request gives none.
    min_prefill_bucket: shortest prefill length (>= 1). Prefill lengths are the buckets
      min_prefill_bucket * 2^k, capped at max_seq_len, so new prompt lengths never compile.
    prefill_rows: sequences per prefill call (>= 1); each bucket compiles one [rows, bucket]
      program.
    eos_id: the stop set: one token id or a sequence of ids (chat models declare several, e.g.
      EOS and an end-of-turn id). Any id of the set ends the completion (kept as its last token;
      nothing after it is sampled). Normalised to a sorted tuple of distinct ids; None or () =
      never stop on a token (only on the budget or the sequence capacity). `stop_ids` reads it.
    kv_policy: what running sequences do after an in-flight weight update. "keep": continue on
      KV computed by older weights (PipelineRL). "recompute": re-prefill each running
      sequence's prefix under the new weights before the next decode step (AReaL).
    cache_dtype: dtype of the KV pages ("float32" on CPU tests, "bfloat16" on accelerators).
    attention_impl: "reference" (pure jnp, every backend), "pallas_gpu" (JAX's Pallas GPU paged
      decode kernel), "pallas_tpu" (JAX's Pallas TPU paged decode kernel), "pallas_tpu_ragged"
      (JAX's Pallas TPU ragged paged attention, prefill and decode; stores the pool K/V-combined),
      or "auto" (pallas_gpu on GPU, pallas_tpu on TPU, else reference). Decode-only kernels leave
      prefill to the reference. Kernels run per tp shard under `shard_map`.
    decode_steps_per_dispatch: K, decode steps run on the device per engine step (>= 1): the
      host joins once per dispatch (one read-back of tokens, log-probs and counts). A dispatch
      stops early when a slot needs a KV page the host has not granted, or when
      min(waiting requests, ceil(num_slots / 8)) slots have finished. Weight swaps land at
      dispatch boundaries.
    share_prompt_pages: the samples of a group (same group_id and prompt) prefill their prompt
      once and share its full KV pages (reference-counted; the partial last page is copied).
    attention_chunk_tokens: keys per step of the reference attention's loop over pages (rounded
      down to whole pages, >= 1 page); the loop runs only over the pages that hold live tokens,
      so attention work follows the longest live sequence, not the block-table width.
    sampling: how tokens are drawn; the learner must score with the same `SamplingConfig`.
    seed: seed of the sampling PRNG.
  """

  num_slots: int = 8
  page_size: int = 16
  num_pages: int = 64
  max_seq_len: int = 256
  max_new_tokens: int = 128
  min_prefill_bucket: int = 16
  prefill_rows: int = 4
  eos_id: int | Sequence[int] | None = None
  kv_policy: str = "keep"
  cache_dtype: str = "float32"
  attention_impl: str = "auto"
  decode_steps_per_dispatch: int = 8
  share_prompt_pages: bool = True
  attention_chunk_tokens: int = 256
  sampling: SamplingConfig = SamplingConfig()
  seed: int = 0

  def __post_init__(self):
    for name in ("num_slots", "page_size", "num_pages", "max_new_tokens", "min_prefill_bucket",
                 "prefill_rows", "decode_steps_per_dispatch", "attention_chunk_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"SamplerConfig.{name}={getattr(self, name)} must be >= 1.")
    if self.max_seq_len < 2:
      raise ValueError(f"SamplerConfig.max_seq_len={self.max_seq_len} must be >= 2 "
                       "(one prompt token and one completion token).")
    object.__setattr__(self, "eos_id", normalize_stop_ids(self.eos_id))
    for name, choices in (("kv_policy", KV_POLICIES), ("attention_impl", ATTENTION_IMPLS),
                          ("cache_dtype", CACHE_DTYPES)):
      if getattr(self, name) not in choices:
        raise ValueError(f"SamplerConfig.{name}={getattr(self, name)!r}; choose one of {choices}.")

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The stop set: sorted distinct token ids that end a completion (empty = none)."""
    return self.eos_id

  @property
  def chunk_pages(self) -> int:
    """Pages per step of the reference attention's loop: attention_chunk_tokens // page_size,
    at least 1 and at most pages_per_seq."""
    return max(1, min(self.attention_chunk_tokens // self.page_size, self.pages_per_seq))

  @property
  def table_width(self) -> int:
    """Device block-table width: pages_per_seq rounded up to a multiple of chunk_pages."""
    return -(-self.pages_per_seq // self.chunk_pages) * self.chunk_pages

  @property
  def pages_per_seq(self) -> int:
    """Block-table width: pages that hold a sequence of max_seq_len tokens."""
    return math.ceil(self.max_seq_len / self.page_size)

  @property
  def prefill_buckets(self) -> tuple[int, ...]:
    """Prefill lengths, ascending: min_prefill_bucket * 2^k below max_seq_len, then max_seq_len."""
    buckets, b = [], self.min_prefill_bucket
    while b < self.max_seq_len:
      buckets.append(b)
      b *= 2
    buckets.append(self.max_seq_len)
    return tuple(buckets)

  def bucket_for(self, length: int) -> int:
    """Smallest prefill bucket >= length (1 <= length <= max_seq_len)."""
    for b in self.prefill_buckets:
      if b >= length:
        return b
    raise ValueError(f"prefill length {length} exceeds max_seq_len={self.max_seq_len}.")

  def pages_for(self, num_tokens: int) -> int:
    """Pages that hold num_tokens tokens: ceil(num_tokens / page_size)."""
    return -(-num_tokens // self.page_size)


def normalize_stop_ids(stop) -> tuple[int, ...]:
  """One id, a sequence of ids, or None -> sorted tuple of distinct non-negative ints.

  Raises:
    ValueError: on a negative id, or an entry that is not an integer (e.g. a string).
  """
  if stop is None:
    return ()
  items = [stop] if isinstance(stop, (int, np.integer)) else stop
  try:
    items = list(items)
  except TypeError:
    raise ValueError(f"SamplerConfig.eos_id={stop!r}: give a token id, a sequence of token ids, "
                     "or None.") from None
  out = set()
  for x in items:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
      raise ValueError(f"SamplerConfig.eos_id={stop!r}: stop ids must be integers, got {x!r}.")
    if x < 0:
      raise ValueError(f"SamplerConfig.eos_id={stop!r}: stop ids must be >= 0, got {x}.")
    out.add(int(x))
  return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request handed to `SamplerEngine.submit`.

  Attributes:
    prompt_tokens: int32[P] prompt ids, P >= 1 (BOS included when the tokenizer adds one).
    sample_id: unique id of the sample within a run (copied to the Rollout).
    group_id: prompt group (GRPO group) id.
    prompt_index: index of the task prompt, for bookkeeping (-1 = unknown).
    max_new_tokens: completion budget in tokens (>= 1); None = `SamplerConfig.max_new_tokens`.
      Capped so that prompt + completion <= max_seq_len. For a multi-turn episode it bounds the
      whole episode after the prompt (model and environment tokens of every turn).
    multi_turn: the request is an episode (`rlax_pipe.envs`): when a turn ends on a stop id the
      sequence frees its slot but keeps its pages and waits, until the caller appends the
      environment's tokens (`SamplerEngine.continue_sequence`, a prefill continuation) or ends
      it (`SamplerEngine.end_sequence`). Other stops (length, capacity, abort) end it.
  """

  prompt_tokens: np.ndarray
  sample_id: int
  group_id: int = 0
  prompt_index: int = -1
  max_new_tokens: int | None = None
  multi_turn: bool = False

  def __post_init__(self):
    tokens = np.asarray(self.prompt_tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"Request {self.sample_id}: prompt_tokens must be a 1-D integer array, got "
                       f"shape {tokens.shape} dtype {tokens.dtype}.")
    if tokens.size == 0:
      raise ValueError(f"Request {self.sample_id}: empty prompt; a completion needs at least one "
                       "prompt token (e.g. BOS) to condition on.")
    if self.max_new_tokens is not None and self.max_new_tokens < 1:
      raise ValueError(f"Request {self.sample_id}: max_new_tokens={self.max_new_tokens} must be "
                       ">= 1 or None.")
    object.__setattr__(self, "prompt_tokens", tokens.astype(np.int32))
