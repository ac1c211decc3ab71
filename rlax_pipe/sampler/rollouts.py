"""Rollout assembly: a finished (or aborted, or parked) sequence of the engine as a `Rollout`.

The host sequence (`scheduler.SequenceState`) holds the tokens, behaviour log-probs, versions,
loss mask and recorded MoE routes the engine appended dispatch by dispatch; this module turns it
into the `Rollout` message (`rlax_pipe.types`) that the engine's `step`, `abort`, `abort_all` and
`parked_rollouts` return. Pure host code (numpy), no device reads.
"""

from __future__ import annotations

import numpy as np

from rlax_pipe import router_replay
from rlax_pipe.model import Model
from rlax_pipe.sampler.scheduler import SequenceState
from rlax_pipe.types import Rollout


def make_rollout(model: Model, seq: SequenceState, reason: str, now: float) -> Rollout:
  """The `Rollout` of `seq` as it stands.

  A multi-turn sequence with environment tokens appended (a 0 in its mask) is an episode: it
  carries its loss mask (1 = model token, 0 = environment token), its number of turns (model
  spans) and no routes; any other sequence carries no mask, one turn and, for an MoE model, its
  routes (`recorded_routes`).

  Args:
    model: the engine's model (its MoE shape decides the routes' shape and dtype).
    seq: the host sequence (prompt, tokens, log-probs, versions, mask, routes, timings).
    reason: finish reason ("eos", "length", "capacity", "aborted").
    now: the finish time (seconds, the engine's clock).

  Returns:
    Rollout with completion tokens int32[T], behaviour log-probs float32[T], policy versions
    int32[T] (T = generated + appended tokens) and the request's ids and timings.
  """
  r = seq.request
  episode = r.multi_turn and 0 in seq.mask  # environment tokens appended
  return Rollout(
      sample_id=r.sample_id, group_id=r.group_id, prompt_tokens=seq.prompt.copy(),
      completion_tokens=np.asarray(seq.tokens[len(seq.prompt):], np.int32),
      behavior_logprobs=np.asarray(seq.logprobs, np.float32),
      policy_versions=np.asarray(seq.versions, np.int32), finish_reason=reason,
      t_admit=seq.t_admit, t_first_token=seq.t_first_token, t_finish=now,
      num_preemptions=seq.num_preemptions, prompt_index=r.prompt_index,
      loss_mask=np.asarray(seq.mask, np.float32) if episode else None,
      num_turns=1 + sum(1 for a, b in zip(seq.mask, seq.mask[1:]) if a == 0 and b == 1)
      if episode else 1,
      routes=None if episode else recorded_routes(model, seq))


def recorded_routes(model: Model, seq: SequenceState) -> np.ndarray | None:
  """An MoE model's recorded routes of `seq`: [T, L_moe, k] expert ids in the compact dtype of
  `router_replay.routes_dtype`; None for a dense model (or one without a built-in config).

  Multi-turn episodes (`rlax_pipe.envs`) carry no routes: their environment tokens are
  prefilled, not decoded, so router replay does not cover them yet."""
  cfg = getattr(model, "cfg", None)
  if not getattr(model, "n_moe_layers", 0) or cfg is None:
    return None
  shape = (len(seq.routes), cfg.n_moe_layers, cfg.n_experts_per_tok)
  dtype = router_replay.routes_dtype(cfg.n_experts)
  return np.asarray(seq.routes, dtype).reshape(shape)
