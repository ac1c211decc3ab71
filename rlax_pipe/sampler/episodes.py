"""Multi-turn episodes in the engine: the methods of `SamplerEngine` for parked sequences.

A `Request.multi_turn` sequence whose turn ends on a stop id is parked by its replica's
scheduler (slot freed, pages kept: `Scheduler.park`). These methods append the environment's
tokens to it (a prefill continuation onto its pages, `continue_sequence`), end it
(`end_sequence`), and read it (`parked_rollouts`, `num_parked`). A mixin of `SamplerEngine`
(it uses the engine's step lock, replicas, model and counters), kept apart by concept.
"""

from __future__ import annotations

import numpy as np

from rlax_pipe.types import Rollout


class ParkedEpisodes:
  """`SamplerEngine` methods for multi-turn episodes waiting on their environment."""

  @property
  def num_parked(self) -> int:
    """Multi-turn episodes waiting on their environment (no slot; pages kept unless evicted)."""
    return sum(len(r.sched.parked) for r in self.replicas)

  def continue_sequence(self, sample_id: int, tokens) -> None:
    """Appends an environment's tokens to a parked episode and queues it to decode on.

    The tokens are appended as they are (never re-tokenized) with loss mask 0, behaviour
    log-prob 0.0 and the policy version of the model's last token. Their KV is written by a
    prefill continuation onto the sequence's pages (`continued_tokens`); the last one is fed by
    the next decode step.

    Args:
      sample_id: a parked episode (a turn of a `multi_turn` request that ended on a stop id).
      tokens: int[N], N >= 1, ids in the vocabulary.

    Raises:
      ValueError: if no episode with that id is parked, the tokens are empty or outside the
        vocabulary, or they leave no room in the episode's budget for one more model token
        (end the episode instead; `rlax_pipe.envs` checks this before calling).
    """
    tokens = np.asarray(tokens)
    with self._step_lock:
      r, seq = self._find_parked(sample_id)
      if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"continue_sequence({sample_id}): tokens must be a non-empty 1-D "
                         f"integer array, got shape {tokens.shape} dtype {tokens.dtype}.")
      if tokens.min() < 0 or tokens.max() >= self.model.vocab_size:
        raise ValueError(f"continue_sequence({sample_id}): token ids must be in [0, "
                         f"{self.model.vocab_size}), got [{tokens.min()}, {tokens.max()}].")
      if len(seq.tokens) + tokens.size >= seq.end:
        raise ValueError(
            f"continue_sequence({sample_id}): {len(seq.tokens)} + {tokens.size} tokens leave no "
            f"room for a model token within the episode's {seq.end} (prompt + max_new_tokens, "
            "capped by max_seq_len); end the episode with end_sequence.")
      n, version = int(tokens.size), seq.versions[-1]
      seq.tokens.extend(int(t) for t in tokens)
      seq.logprobs.extend([0.0] * n)
      seq.versions.extend([version] * n)
      seq.mask.extend([0] * n)
      r.sched.unpark(seq)

  def end_sequence(self, sample_id: int) -> None:
    """Ends a parked episode (its environment gave the final reward): frees its pages.

    Raises:
      ValueError: if no episode with that id is parked.
    """
    with self._step_lock:
      r, seq = self._find_parked(sample_id)
      r.sched.remove(seq)
      self._forget(seq)
      self.book.counts["finished"] += 1

  def parked_rollouts(self) -> list[Rollout]:
    """The episode so far of every parked sequence (finish_reason "eos"), replica by replica
    in parking order."""
    with self._step_lock:
      now = self.clock()
      return [self._rollout(seq, "eos", now) for r in self.replicas
              for seq in r.sched.parked.values()]

  def _find_parked(self, sample_id: int):
    for r in self.replicas:
      for seq in r.sched.parked.values():
        if seq.request.sample_id == sample_id:
          return r, seq
    raise ValueError(f"sample {sample_id} is not a parked episode (not a multi_turn request, "
                     "not yet at the end of a turn, already continued, or finished).")
