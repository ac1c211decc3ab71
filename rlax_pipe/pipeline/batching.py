"""Packs graded rollouts into a fixed-shape `TrainBatch` [B, L] (host side, numpy), in the layout
`types.TrainBatch` describes (segment ids, positions restarting at 0, per-token arrays aligned
with `tokens`).

Each sample (prompt + completion) is one segment of a row; rows are filled first-fit decreasing
(Johnson 1973, bin packing: sort by length, longest first, each into the first row it fits).
loss_mask, behavior_logprobs, policy_versions and advantages are set on the model's completion
tokens only, 0 elsewhere (`Rollout.loss_mask`: an episode's environment tokens are context, as
the prompt is).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rlax_pipe import router_replay
from rlax_pipe.pipeline.rules import packing_plan
from rlax_pipe.types import Rollout, TrainBatch


@dataclasses.dataclass(frozen=True)
class UnpackedSample:
  """One segment read back out of a `TrainBatch`.

  Attributes:
    row: batch row of the segment.
    segment: segment id within the row (>= 1).
    prompt_tokens: int32[P] tokens before the first loss-masked token.
    completion_tokens: int32[T] loss-masked tokens.
    behavior_logprobs: float32[T].
    policy_versions: int32[T].
    advantage: the sample's advantage (0.0 when T == 0).
  """

  row: int
  segment: int
  prompt_tokens: np.ndarray
  completion_tokens: np.ndarray
  behavior_logprobs: np.ndarray
  policy_versions: np.ndarray
  advantage: float


# The dtype of each [B, L] array of a `TrainBatch` (`routes` aside: `router_replay.batch_routes`).
_DTYPES = {"tokens": np.int32, "positions": np.int32, "segment_ids": np.int32,
           "loss_mask": np.float32, "behavior_logprobs": np.float32, "policy_versions": np.int32,
           "advantages": np.float32}


def pack_rollouts(rollouts: Sequence[Rollout], advantages: np.ndarray, seq_len: int,
                  num_rows: int | None = None) -> TrainBatch:
  """Packs rollouts into rows of length `seq_len`.

  Args:
    rollouts: graded samples (prompt non-empty).
    advantages: float[N], one advantage per rollout (same order).
    seq_len: L, tokens per row.
    num_rows: B; if given the batch is padded to exactly B rows (padding rows: segment id 0,
      zero mask, no route), else it has as many rows as packing needs.

  Returns:
    A numpy `TrainBatch` of shape [rows, L]. Row r, segment s holds the rollout at position
    (sum of segments in rows < r) + s - 1 of `packed_order(lengths, seq_len)`, not of `rollouts`.

  Raises:
    ValueError: if `advantages` is not [N]; if a prompt is empty; if a sample (prompt +
      completion) is longer than L (naming its sample_id and both lengths); if more than
      `num_rows` rows are needed (naming how many).
  """
  advantages = np.asarray(advantages)
  if advantages.shape != (len(rollouts),):
    raise ValueError(f"pack_rollouts: advantages has shape {advantages.shape}; expected "
                     f"({len(rollouts)},), one per rollout.")
  lengths = []
  for r in rollouts:
    p = int(r.prompt_tokens.shape[0])
    if p < 1:
      raise ValueError(f"pack_rollouts: sample {r.sample_id} has an empty prompt; a completion "
                       "token would have no preceding logits.")
    if p + r.num_completion_tokens > seq_len:
      raise ValueError(
          f"pack_rollouts: sample {r.sample_id} has {p + r.num_completion_tokens} tokens "
          f"(prompt {p} + completion {r.num_completion_tokens}) > seq_len={seq_len}.")
    lengths.append(p + r.num_completion_tokens)
  rows = packing_plan(lengths, seq_len)
  if num_rows is not None and len(rows) > num_rows:
    raise ValueError(f"pack_rollouts: {len(rollouts)} samples need {len(rows)} rows of "
                     f"{seq_len} tokens but num_rows={num_rows}.")
  shape = (len(rows) if num_rows is None else num_rows, seq_len)
  out = {name: np.zeros(shape, dtype) for name, dtype in _DTYPES.items()}
  placed: list[int] = []  # rollout indices in packed order
  placements: list[tuple[int, int]] = []  # (row, first completion column) of each
  for b, row in enumerate(rows):
    offset = 0
    for seg, i in enumerate(row, start=1):
      r = rollouts[i]
      p, t = int(r.prompt_tokens.shape[0]), r.num_completion_tokens
      span, comp = slice(offset, offset + p + t), slice(offset + p, offset + p + t)
      out["tokens"][b, span] = np.concatenate([r.prompt_tokens, r.completion_tokens])
      out["positions"][b, span] = np.arange(p + t)
      out["segment_ids"][b, span] = seg
      mask = r.completion_mask  # 0 at an episode's environment tokens (`Rollout.loss_mask`)
      out["loss_mask"][b, comp] = mask
      out["behavior_logprobs"][b, comp] = np.where(mask > 0, r.behavior_logprobs, 0.0)
      out["policy_versions"][b, comp] = np.where(mask > 0, r.policy_versions, 0)
      out["advantages"][b, comp] = np.where(mask > 0, advantages[i], 0.0)
      placed.append(i)
      placements.append((b, offset + p - 1))  # routes[t]: the fed token before token t
      offset += p + t
  out["routes"] = router_replay.batch_routes([rollouts[i].routes for i in placed], placements,
                                             out["tokens"].shape[0], seq_len)
  return TrainBatch(**out)


def unpack_batch(batch: TrainBatch) -> list[UnpackedSample]:
  """Reads every segment back out of a packed batch (row-major, segment order).

  The prompt / completion split is where loss_mask turns on, so it is exact for samples with
  at least one completion token (an empty completion comes back as all prompt). For a
  multi-turn episode the model's tokens come back as the completion and everything else (prompt
  and environment tokens) as the prompt.
  """
  samples = []
  for b in range(batch.tokens.shape[0]):
    seg_row = np.asarray(batch.segment_ids[b])
    for seg in np.unique(seg_row[seg_row > 0]):
      idx = np.nonzero(seg_row == seg)[0]
      mask = np.asarray(batch.loss_mask[b, idx]) > 0
      comp = idx[mask]
      samples.append(UnpackedSample(
          row=b, segment=int(seg),
          prompt_tokens=np.asarray(batch.tokens[b, idx[~mask]]),
          completion_tokens=np.asarray(batch.tokens[b, comp]),
          behavior_logprobs=np.asarray(batch.behavior_logprobs[b, comp]),
          policy_versions=np.asarray(batch.policy_versions[b, comp]),
          advantage=float(batch.advantages[b, comp[0]]) if comp.size else 0.0))
  return samples
