"""Tests for sequence packing into TrainBatch."""

import dataclasses

import numpy as np
import pytest

from rlax_pipe.pipeline import batching, rules
from rlax_pipe.types import Rollout


def _rollouts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i, (p, t) in enumerate(lengths):
    out.append(Rollout(
        sample_id=i, group_id=i // 2,
        prompt_tokens=rng.integers(1, 100, p).astype(np.int32),
        completion_tokens=rng.integers(1, 100, t).astype(np.int32),
        behavior_logprobs=-rng.random(t).astype(np.float32),
        policy_versions=rng.integers(0, 5, t).astype(np.int32), finish_reason="eos"))
  return out


def test_packing_plan_first_fit_decreasing():
  assert rules.packing_plan([3, 7, 5, 2, 4], 8) == [[1], [2, 0], [4, 3]]
  with pytest.raises(ValueError, match="9 tokens; it must be between 1 and seq_len=8"):
    rules.packing_plan([9], 8)


def test_round_trip_and_masks():
  lengths = [(3, 5), (2, 1), (4, 0), (1, 9), (5, 5), (2, 2), (6, 3)]
  rollouts = _rollouts(lengths)
  adv = np.linspace(-1, 1, len(rollouts)).astype(np.float32)
  batch = batching.pack_rollouts(rollouts, adv, seq_len=12)
  rows = rules.packing_plan([p + t for p, t in lengths], 12)
  assert batch.tokens.shape == (len(rows), 12)
  for name, dtype in [("tokens", np.int32), ("positions", np.int32), ("segment_ids", np.int32),
                      ("loss_mask", np.float32), ("behavior_logprobs", np.float32),
                      ("policy_versions", np.int32), ("advantages", np.float32)]:
    assert getattr(batch, name).dtype == dtype and getattr(batch, name).shape == (len(rows), 12)
  unpacked = batching.unpack_batch(batch)
  expected_order = [i for row in rows for i in row]
  assert len(unpacked) == len(rollouts)
  for u, i in zip(unpacked, expected_order):
    r = rollouts[i]
    if r.num_completion_tokens:
      np.testing.assert_array_equal(u.prompt_tokens, r.prompt_tokens)
      assert u.advantage == adv[i]
    else:
      assert u.advantage == 0.0
    np.testing.assert_array_equal(u.completion_tokens, r.completion_tokens)
    np.testing.assert_array_equal(u.behavior_logprobs, r.behavior_logprobs)
    np.testing.assert_array_equal(u.policy_versions, r.policy_versions)
  # loss mask counts exactly the completion tokens; masked-out per-token arrays are zero.
  assert batch.loss_mask.sum() == sum(t for _, t in lengths)
  off = batch.loss_mask == 0
  assert not batch.behavior_logprobs[off].any() and not batch.policy_versions[off].any()
  assert not batch.advantages[off].any()
  # padding: segment 0, tokens and positions 0.
  pad = batch.segment_ids == 0
  assert not batch.tokens[pad].any() and not batch.positions[pad].any()


def test_segments_are_contiguous_and_positions_restart():
  batch = batching.pack_rollouts(_rollouts([(2, 3), (1, 1), (3, 2), (2, 2)]),
                                 np.zeros(4, np.float32), seq_len=8)
  for b in range(batch.tokens.shape[0]):
    seg = batch.segment_ids[b]
    used = seg[seg > 0]
    # ids 1..n in order, each a contiguous run, padding only at the end: no cross-sample mixing.
    assert list(dict.fromkeys(used)) == list(range(1, used.max() + 1))
    assert np.all(np.diff(used) >= 0) and np.all(seg[len(used):] == 0)
    for s in range(1, used.max() + 1):
      pos = batch.positions[b][seg == s]
      np.testing.assert_array_equal(pos, np.arange(pos.size))
      # the first token of every segment is a prompt token (never in the loss).
      assert batch.loss_mask[b][seg == s][0] == 0


def test_errors_and_padding_helpers():
  rollouts = _rollouts([(3, 6), (2, 2)])
  with pytest.raises(ValueError, match=r"sample 0 has 9 tokens \(prompt 3 \+ completion 6\) > "
                                       r"seq_len=8"):
    batching.pack_rollouts(rollouts, np.zeros(2), seq_len=8)
  with pytest.raises(ValueError, match="need 2 rows of 9 tokens but num_rows=1"):
    batching.pack_rollouts(rollouts, np.zeros(2), seq_len=9, num_rows=1)
  with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
    batching.pack_rollouts(rollouts, np.zeros(3), seq_len=9)
  with pytest.raises(ValueError, match="empty prompt"):
    batching.pack_rollouts(_rollouts([(0, 2)]), np.zeros(1), seq_len=9)
  fixed = batching.pack_rollouts(rollouts, np.ones(2), seq_len=9, num_rows=4)
  assert fixed.tokens.shape == (4, 9) and not fixed.segment_ids[2:].any()
  assert fixed.loss_mask.dtype == np.float32


@pytest.mark.parametrize("rows,mbr,m,want", [
    (5, 2, 2, (3, 6)),    # minibatches rows {0, 2, 4} and {1, 3}: 2 + 1 micro-batches of 2 rows
    (8, 4, 1, (2, 8)),    # exact fit
    (1, 4, 2, (1, 4)),    # the empty minibatch gets no micro-batch
    (7, None, 3, (3, 7)),  # no row split: one micro-batch per minibatch
])
def test_micro_batch_plan(rows, mbr, m, want):
  assert rules.micro_batch_plan(rows, mbr, m) == want


def _grpo_reference(rollouts):
  """sample_id -> GRPO advantage (r - mean) / (std + 1e-6) over each group's scored samples
  (float64, written from the formula, independent of `rlax_pipe.advantages`)."""
  out = {}
  for g in {r.group_id for r in rollouts}:
    scored = [r for r in rollouts if r.group_id == g and not np.isnan(r.reward)]
    rw = np.asarray([r.reward for r in scored], np.float64)
    for r in scored:
      out[r.sample_id] = 0.0 if len(rw) < 2 else (r.reward - rw.mean()) / (rw.std() + 1e-6)
  return out


@pytest.mark.parametrize("seed", range(6))
def test_build_batch_returns_rollouts_in_packed_segment_order(seed):
  """#27 item 13: `build_batch`'s rollouts pair by position with the batch's segments
  (`unpack_batch` order), whatever order first-fit decreasing packs samples of different lengths
  in; NaN-reward samples are left out of both."""
  from rlax_pipe.pipeline import config as pconfig
  from rlax_pipe.pipeline import trainer

  rng = np.random.default_rng(seed)
  group_size, num_groups, seq_len = 4, 3, 24
  lengths = [(int(rng.integers(1, 6)), int(rng.integers(1, 14)))
             for _ in range(group_size * num_groups)]
  rollouts = _rollouts(lengths, seed)
  rewards = rng.integers(0, 3, len(rollouts)).astype(np.float64)
  rewards[rng.random(len(rollouts)) < 0.15] = np.nan
  rollouts = [dataclasses.replace(r, group_id=i // group_size, reward=float(w))
              for i, (r, w) in enumerate(zip(rollouts, rewards))]
  groups = [tuple(rollouts[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
  cfg = pconfig.PipelineConfig(group_size=group_size, seq_len=seq_len)
  batch, trained = trainer.build_batch(groups, cfg)
  unpacked = batching.unpack_batch(batch)
  scored = [r for r in rollouts if not np.isnan(r.reward)]
  assert sorted(r.sample_id for r in trained) == [r.sample_id for r in scored]
  assert len(unpacked) == len(trained)
  expected_adv = _grpo_reference(rollouts)
  for u, r in zip(unpacked, trained):
    np.testing.assert_array_equal(u.prompt_tokens, r.prompt_tokens)
    np.testing.assert_array_equal(u.completion_tokens, r.completion_tokens)
    np.testing.assert_array_equal(u.behavior_logprobs, r.behavior_logprobs)
    np.testing.assert_array_equal(u.policy_versions, r.policy_versions)
    np.testing.assert_allclose(u.advantage, expected_adv[r.sample_id], rtol=1e-5, atol=1e-6)
  # The case the issue is about: packing reordered the samples (longest first).
  assert [r.sample_id for r in trained] != [r.sample_id for r in scored]


def test_packed_order_is_the_layout_of_pack_rollouts():
  lengths = [3, 7, 5, 2, 4]
  assert rules.packed_order(lengths, 8) == [1, 2, 0, 4, 3]
  assert rules.packed_order([], 8) == []
