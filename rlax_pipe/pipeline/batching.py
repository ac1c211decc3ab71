"""Packs graded rollouts into a fixed-shape `TrainBatch` [B, L] (host side, numpy).

Each sample (prompt + completion) is one segment of a row; rows are filled first-fit decreasing
(Johnson 1973, bin packing: sort by length, longest first, each into the first row it fits).
Within a row segments are numbered 1, 2, ... (0 marks padding) and positions restart at 0, so
attention must be masked to equal segment ids. Per-token arrays follow `types.TrainBatch`:
loss_mask, behavior_logprobs, policy_versions and advantages are set on completion tokens only
(0 elsewhere), aligned with `tokens`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rlax_pipe import router_replay
from rlax_pipe.learner import learner as learner_lib
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


def packing_plan(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
  """First-fit-decreasing assignment of items to rows of capacity `seq_len`.

  O(n log n): the first row with room is found in a max-tree over the rows' free space (rows not
  yet opened count as empty, and come after every opened row, so the leftmost row with room is
  exactly first fit's choice).

  Args:
    lengths: token count of each item (>= 1).
    seq_len: row capacity L.

  Returns:
    rows: lists of item indices; row order = order of creation, items in a row in placement
      order (longest first). Deterministic (ties broken by index).

  Raises:
    ValueError: if an item is longer than `seq_len` or shorter than 1 (naming both lengths).
  """
  lengths = [int(n) for n in lengths]
  for i, n in enumerate(lengths):
    if n > seq_len or n < 1:
      raise ValueError(
          f"packing_plan: item {i} has {n} tokens; it must be between 1 and seq_len={seq_len}.")
  if not lengths:
    return []
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  size = 1 << (len(lengths) - 1).bit_length()
  tree = [seq_len] * (2 * size)  # tree[k] = max free space of the rows under node k
  rows: list[list[int]] = []
  for i in order:
    n, k = lengths[i], 1
    while k < size:  # leftmost leaf with room
      k = 2 * k if tree[2 * k] >= n else 2 * k + 1
    r = k - size
    if r == len(rows):
      rows.append([])
    rows[r].append(i)
    tree[k] -= n
    k //= 2
    while k:
      tree[k] = max(tree[2 * k], tree[2 * k + 1])
      k //= 2
  return rows


def packed_order(lengths: Sequence[int], seq_len: int) -> list[int]:
  """Item indices in the order `pack_rollouts` lays them out: row by row, and within a row by
  segment id (1, 2, ...); the order `unpack_batch` reads segments back. A permutation of
  range(len(lengths)); first-fit decreasing puts longer items first, so it differs from the input
  order whenever lengths differ.

  Raises:
    ValueError: as `packing_plan`.
  """
  return [i for row in packing_plan(lengths, seq_len) for i in row]


def bucket_rows(needed: int) -> int:
  """Row count rounded up to a power of two, so batch shapes (and compiles) stay few."""
  return 1 << max(0, int(needed - 1).bit_length())


def batch_rows(lengths: Sequence[int], seq_len: int) -> int:
  """Rows of the learner batch holding samples of these lengths (prompt + completion): the
  first-fit-decreasing plan's row count rounded up by `bucket_rows` (the learner's batch shape
  rule, shared with the simulator)."""
  return bucket_rows(len(packing_plan(lengths, seq_len)))


def micro_batch_plan(rows: int, micro_batch_rows: int | None = None, num_minibatches: int = 1
                     ) -> tuple[int, int]:
  """(micro-batches, rows processed) of a learner step on `rows` rows, by the learner's own
  split (`learner.plan_micro_batches`: row r goes to minibatch r mod `num_minibatches`, each
  minibatch is cut into micro-batches of exactly `micro_batch_rows` rows, the last padded), so
  the step processes micro-batches x micro_batch_rows rows. Without `micro_batch_rows`: one
  micro-batch per minibatch, `rows` rows processed."""
  if not micro_batch_rows:
    return num_minibatches, rows
  micro = sum(len(m) for m in learner_lib.plan_micro_batches(rows, micro_batch_rows,
                                                             num_minibatches))
  return micro, micro * micro_batch_rows


def _empty_batch(num_rows: int, seq_len: int) -> dict[str, np.ndarray]:
  return {
      "tokens": np.zeros((num_rows, seq_len), np.int32),
      "positions": np.zeros((num_rows, seq_len), np.int32),
      "segment_ids": np.zeros((num_rows, seq_len), np.int32),
      "loss_mask": np.zeros((num_rows, seq_len), np.float32),
      "behavior_logprobs": np.zeros((num_rows, seq_len), np.float32),
      "policy_versions": np.zeros((num_rows, seq_len), np.int32),
      "advantages": np.zeros((num_rows, seq_len), np.float32),
  }


def pack_rollouts(rollouts: Sequence[Rollout], advantages: np.ndarray, seq_len: int,
                  num_rows: int | None = None) -> TrainBatch:
  """Packs rollouts into rows of length `seq_len`.

  Args:
    rollouts: graded samples (prompt non-empty).
    advantages: float[N], one advantage per rollout (same order).
    seq_len: L, tokens per row.
    num_rows: B; if given the batch is padded to exactly B rows, else it has as many rows as
      packing needs (see `pad_rows_to_multiple` to round that up).

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
  out = _empty_batch(len(rows) if num_rows is None else num_rows, seq_len)
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
      out["loss_mask"][b, comp] = 1.0
      out["behavior_logprobs"][b, comp] = r.behavior_logprobs
      out["policy_versions"][b, comp] = r.policy_versions
      out["advantages"][b, comp] = advantages[i]
      placed.append(i)
      placements.append((b, offset + p - 1))  # routes[t]: the fed token before token t
      offset += p + t
  out["routes"] = router_replay.batch_routes([rollouts[i].routes for i in placed], placements,
                                             out["tokens"].shape[0], seq_len)
  return TrainBatch(**out)


def pad_rows_to_multiple(batch: TrainBatch, multiple: int) -> TrainBatch:
  """Appends all-padding rows (segment id 0, zero mask) until rows % multiple == 0.

  Raises:
    ValueError: if multiple < 1.
  """
  if multiple < 1:
    raise ValueError(f"pad_rows_to_multiple: multiple={multiple} must be >= 1.")
  rows = batch.tokens.shape[0]
  extra = -rows % multiple
  if not extra:
    return batch
  def pad(name, x):
    if x is None:
      return None
    fill = router_replay.NO_ROUTE if name == "routes" else 0
    return np.concatenate([x, np.full((extra,) + x.shape[1:], fill, x.dtype)])
  return TrainBatch(**{f.name: pad(f.name, getattr(batch, f.name))
                       for f in dataclasses.fields(TrainBatch)})


def split_rows(batch: TrainBatch, rows_per_micro_batch: int) -> list[TrainBatch]:
  """Splits a batch into micro-batches of `rows_per_micro_batch` rows (gradient accumulation).

  Raises:
    ValueError: if the row count is not a multiple (pad with `pad_rows_to_multiple` first).
  """
  rows = batch.tokens.shape[0]
  if rows_per_micro_batch < 1 or rows % rows_per_micro_batch:
    raise ValueError(f"split_rows: {rows} rows are not a multiple of rows_per_micro_batch="
                     f"{rows_per_micro_batch}; pad with pad_rows_to_multiple first.")
  cut = lambda x, s: None if x is None else x[s:s + rows_per_micro_batch]
  return [TrainBatch(**{f.name: cut(getattr(batch, f.name), s)
                        for f in dataclasses.fields(TrainBatch)})
          for s in range(0, rows, rows_per_micro_batch)]


def unpack_batch(batch: TrainBatch) -> list[UnpackedSample]:
  """Reads every segment back out of a packed batch (row-major, segment order).

  The prompt / completion split is where loss_mask turns on, so it is exact for samples with
  at least one completion token (an empty completion comes back as all prompt).
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
