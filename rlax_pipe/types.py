"""Typed messages exchanged between pipeline stages (see DESIGN.md, "Contracts").

Letter legend used across the package: B batch, T time (tokens), L sequence length, V vocab,
H query heads, K kv heads, D head dim, E embed, F mlp hidden, P pages, S page size.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, Protocol

import numpy as np

# Why a completion ended: "eos" = a token of the sampler's stop set (EOS or any other stop id;
# kept as the last token, nothing sampled after it); "length" = the completion budget
# (max_new_tokens) was reached; "capacity" = prompt + completion reached the sampler's sequence
# capacity (max_seq_len) before the budget; "aborted" = stopped from outside (abort, shutdown).
# "length" and "capacity" are both truncations (`Rollout.truncated`).
FinishReason = Literal["eos", "length", "capacity", "aborted"]
FINISH_REASONS: tuple[str, ...] = ("eos", "length", "capacity", "aborted")
TRUNCATED_REASONS: tuple[str, ...] = ("length", "capacity")


@dataclasses.dataclass(frozen=True)
class Rollout:
  """One finished sample, host side (numpy).

  Attributes:
    sample_id: unique id of this sample within a run.
    group_id: id of the prompt group this sample belongs to (GRPO group).
    prompt_tokens: int32[P] prompt token ids (BOS included when the tokenizer adds one).
    completion_tokens: int32[T] generated token ids (the stop id included when generation
      stopped on one; never a token after it).
    behavior_logprobs: float32[T] log mu(a_t | s_t) under the distribution actually sampled from
      (after temperature / top-k / top-p processing, renormalised, fp32).
    policy_versions: int32[T] version of the weights that produced token t, stamped at decode time.
    finish_reason: one of FINISH_REASONS: "eos" (a stop id), "length" (completion budget),
      "capacity" (max_seq_len reached first), "aborted".
    reward: scalar reward given by the task's verifier (0.0 until graded; NaN when the sample has
      no reward: its verifier call failed or the overlong policy masked it, see
      `rlax_pipe.grading`).
    t_admit: wall or virtual clock time (seconds) when the request was admitted into a slot.
    t_first_token: time (seconds) when the first completion token was produced.
    t_finish: time (seconds) when the sample finished.
    num_preemptions: how many times the sample lost its KV pages and was re-queued.
    prompt_index: index of the task prompt (for bookkeeping and resume).
    prompt_truncated: the prompt was cut to fit max_seq_len (`rlax_pipe.grading`, "truncate").
    loss_mask: float32[T] of 0.0 / 1.0, or None (= all 1.0, a single-turn sample). A multi-turn
      episode (`rlax_pipe.envs`) interleaves model tokens (1.0) with environment tokens (0.0:
      tool results and chat-template headers, rendered once and appended by the sampler, never
      trained on). An environment token has behaviour log-prob 0.0 and the policy version of
      the model token before it, so `oldest_version` and per-token lags are unchanged by it.
    num_turns: model turns in the episode (1 for a single-turn sample).
    routes: mixture-of-experts models only: int8 / int16 [T, L_moe, k], per completion token t
      and MoE layer, the k experts of the sampler's decode step that produced t (the routing of
      the token fed at that step, the one before t; `rlax_pipe.router_replay`: dtype, memory
      cost); None for a dense model or when not recorded.
  """

  sample_id: int
  group_id: int
  prompt_tokens: np.ndarray
  completion_tokens: np.ndarray
  behavior_logprobs: np.ndarray
  policy_versions: np.ndarray
  finish_reason: str
  reward: float = 0.0
  t_admit: float = 0.0
  t_first_token: float = 0.0
  t_finish: float = 0.0
  num_preemptions: int = 0
  prompt_index: int = -1
  prompt_truncated: bool = False
  loss_mask: np.ndarray | None = None
  num_turns: int = 1
  routes: np.ndarray | None = None

  def __post_init__(self):
    t = self.completion_tokens.shape
    if self.loss_mask is not None:
      mask = np.asarray(self.loss_mask, np.float32)
      if mask.shape != t or not np.all((mask == 0.0) | (mask == 1.0)):
        raise ValueError(f"Rollout {self.sample_id}: loss_mask must be float32{list(t)} of 0.0 / "
                         f"1.0 (one per completion token), got shape {mask.shape}.")
      object.__setattr__(self, "loss_mask", mask)
    if self.behavior_logprobs.shape != t or self.policy_versions.shape != t:
      raise ValueError(
          "Rollout arrays disagree in length: completion_tokens "
          f"{t}, behavior_logprobs {self.behavior_logprobs.shape}, policy_versions "
          f"{self.policy_versions.shape}; all three must be [T].")
    if self.finish_reason not in FINISH_REASONS:
      raise ValueError(
          f"finish_reason={self.finish_reason!r}; expected one of {FINISH_REASONS}.")
    if self.routes is not None and (self.routes.ndim != 3 or self.routes.shape[0] != t[0]
                                    or not np.issubdtype(self.routes.dtype, np.integer)):
      raise ValueError(f"Rollout.routes has dtype {self.routes.dtype} and shape "
                       f"{self.routes.shape}; expected integers [T, L_moe, k] with T = {t[0]} "
                       "completion tokens (or None).")

  @property
  def num_completion_tokens(self) -> int:
    """T, the number of completion tokens."""
    return int(self.completion_tokens.shape[0])

  @property
  def truncated(self) -> bool:
    """Whether the completion was cut by a limit ("length" or "capacity"), not ended by the
    model (a stop id) or aborted."""
    return self.finish_reason in TRUNCATED_REASONS

  @property
  def completion_mask(self) -> np.ndarray:
    """float32[T]: 1.0 at tokens the model generated, 0.0 at environment tokens."""
    if self.loss_mask is None:
      return np.ones(self.completion_tokens.shape, np.float32)
    return self.loss_mask

  @property
  def last_turn_tokens(self) -> np.ndarray:
    """int32[T']: the model's tokens after the last environment token (the final turn of an
    episode, which the task grades); the whole completion for a single-turn sample."""
    if self.loss_mask is None:
      return self.completion_tokens
    env = np.flatnonzero(self.loss_mask == 0.0)
    return self.completion_tokens[env[-1] + 1:] if env.size else self.completion_tokens

  def oldest_version(self) -> int:
    """Smallest policy version among the completion tokens (or a large number if empty)."""
    if self.policy_versions.size == 0:
      return np.iinfo(np.int32).max
    return int(self.policy_versions.min())


def rollout_to_dict(r: Rollout) -> dict[str, Any]:
  """Plain dict of a Rollout (numpy arrays copied), the one form of a Rollout in saved state.

  Used by the sampler engine's and the rollout queue's `state_dict`; `run_dir.save_state` writes
  its arrays to npz, so every dtype survives the round trip.
  """
  return {f.name: (np.array(getattr(r, f.name)) if isinstance(getattr(r, f.name), np.ndarray)
                   else getattr(r, f.name)) for f in dataclasses.fields(Rollout)}


def rollout_from_dict(d: dict[str, Any]) -> Rollout:
  """Inverse of `rollout_to_dict`; token arrays are restored as int32 / float32 (lists too).

  Router-replay routes keep a small integer dtype as stored (int8 / int16); anything else (a
  list) becomes int16.
  """
  kw = dict(d)
  for name, dtype in (("prompt_tokens", np.int32), ("completion_tokens", np.int32),
                      ("behavior_logprobs", np.float32), ("policy_versions", np.int32)):
    kw[name] = np.asarray(kw[name], dtype=dtype)
  if kw.get("routes") is not None:
    routes = np.asarray(kw["routes"])
    small = np.issubdtype(routes.dtype, np.integer) and routes.dtype.itemsize <= 2
    kw["routes"] = routes if small else routes.astype(np.int16)
  return Rollout(**kw)


@dataclasses.dataclass(frozen=True)
class TrainBatch:
  """A fixed-shape learner batch (numpy on host, or jax.Array once placed on the learner mesh).

  All arrays are [B, L]. Packed rows hold several samples, told apart by `segment_ids`
  (0 marks padding; samples are numbered 1, 2, ... within a row).

  Attributes:
    tokens: int32[B, L] input token ids (prompt + completion).
    positions: int32[B, L] position of each token within its own sample (restarts at 0).
    segment_ids: int32[B, L] sample id within the row; 0 = padding.
    loss_mask: float32[B, L] 1.0 at completion tokens (the tokens the policy generated).
    behavior_logprobs: float32[B, L] log mu(tokens[b, t]) (0 where loss_mask is 0).
    policy_versions: int32[B, L] version that produced tokens[b, t] (0 where loss_mask is 0).
    advantages: float32[B, L] per-token advantage (sample advantage broadcast over its tokens).
    routes: mixture-of-experts router replay only: int8 / int16 [B, L, L_moe, k] the sampler's
      recorded experts at the positions of the tokens it fed to produce each completion token
      (the last prompt token and every completion token but the last), `router_replay.NO_ROUTE`
      (-1) elsewhere (the learner routes those itself); None otherwise.

  Alignment: every per-token array is aligned with `tokens`, so the learner scores token t with
  the logits at position t - 1 of the same segment (a completion token is never first in its
  segment, because prompts are non-empty).
  """

  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  loss_mask: np.ndarray
  behavior_logprobs: np.ndarray
  policy_versions: np.ndarray
  advantages: np.ndarray
  routes: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class WeightUpdate:
  """One policy version on its way from the learner to a sampler engine.

  Ownership passes with the message: the weight channel makes the sampler-side copy, hands it out
  once (`WeightChannel.take` / `try_take`) and forgets it; the engine that receives it
  (`SamplerEngine.update_weights`) runs it from its next step boundary and, when a newer version
  replaces it, deletes its arrays if `donated` (a superseded pending one too). Nobody else may
  use `params` after handing the message over.

  Attributes:
    version: policy version of `params` (learner optimizer steps applied).
    params: parameter pytree of `jax.Array`s placed for the receiving engine.
    donated: True when the receiver owns the arrays and frees them once replaced (the channel's
      copies); False when the sender keeps using them (e.g. the learner's own params handed to
      an evaluation engine): the receiver then only drops its references.
    checksum: the learner's `rlax_pipe.param_checksum.checksum` of this version (uint32 per
      leaf, device or host array), or None. When given, the engine checks that the weights it
      decodes with after the swap have exactly these checksums (`WeightMismatchError`
      otherwise): a copy that landed stale or partial data, or an engine that kept old weights
      under a new version tag, cannot go unnoticed.
  """

  version: int
  params: Any
  donated: bool = False
  checksum: Any = None


# ---- the two interfaces of the pipeline floor (issue #25) ----------------------------------------
# One hand-over verb per side: the learner side `push`es a `WeightUpdate` into a `WeightSink`; the
# sampler side receives one with `update_weights`. Checked by tests/test_protocols.py (signatures,
# not only names).


@typing.runtime_checkable
class WeightSink(Protocol):
  """Where the learner hands each new policy version (the learner side of the hand-over).

  Implemented by the in-process `pipeline.weight_channel.WeightChannel` (learner mesh -> sampler
  mesh), `pipeline.lora_channel.LoraWeightChannel` (adapters only, merged on the sampler side)
  and a multi-process job's `pipeline.multihost.weights.LearnerSender` (staging copies the
  replicas fetch).
  """

  def push(self, update: WeightUpdate) -> None:
    """Starts handing `update` (params of version `update.version`, learner shardings) over;
    returns once the copy is dispatched. The sender may keep using (and donate) the params.

    Raises:
      ValueError: when `update.version` is older than the sink allows (each sink documents its
        rule); ManifestError: when the params do not match the sink's manifest.
    """
    ...  # pylint: disable=unnecessary-ellipsis


@typing.runtime_checkable
class Sampler(Protocol):
  """The sampler side as the `RolloutWorker` drives it.

  Implemented by the local `sampler.SamplerEngine`, the multi-turn `envs.EpisodeEngine` that
  wraps it, and, on a multi-process job's lead, `pipeline.multihost.remote.RemoteEngines` (the
  replicas of other processes).
  """

  def submit(self, request: Any) -> None:
    """Queues one `sampler.Request` (one sample of a group)."""
    ...  # pylint: disable=unnecessary-ellipsis

  def step(self) -> list[Rollout]:
    """Advances the sampler; returns the samples that finished since the last call."""
    ...  # pylint: disable=unnecessary-ellipsis

  def abort(self, sample_id: int) -> Rollout | None:
    """Stops sample `sample_id`; its aborted Rollout now, or None when it comes back later
    (through `step`) or is not held."""
    ...  # pylint: disable=unnecessary-ellipsis

  def unfinished(self) -> dict[int, int | None]:
    """Sample id -> oldest policy version among its tokens (None when not known or none yet) of
    every request submitted and not yet handed back."""
    ...  # pylint: disable=unnecessary-ellipsis

  def update_weights(self, update: WeightUpdate) -> None:
    """Receives a new policy version (the sampler side of the hand-over); it is used from the
    sampler's next step boundary.

    Raises:
      ValueError: when `update.version` is not newer than the newest version received.
    """
    ...  # pylint: disable=unnecessary-ellipsis
