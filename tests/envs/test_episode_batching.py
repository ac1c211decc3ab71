"""An episode in a training batch: loss mask, behaviour log-probs, versions and the advantage
only on the model's tokens (environment tokens are context), checked by hand; `Rollout`
validates its mask; the last turn is what the task grades."""

import numpy as np
import pytest

from rlax_pipe.pipeline.batching import pack_rollouts, unpack_batch
from rlax_pipe.types import Rollout


def _episode():
  # prompt [1, 2]; turn 1 [5, 3]; environment [7, 8, 9]; turn 2 [6, 3]
  mask = np.array([1, 1, 0, 0, 0, 1, 1], np.float32)
  return Rollout(sample_id=4, group_id=0, prompt_tokens=np.array([1, 2], np.int32),
                 completion_tokens=np.array([5, 3, 7, 8, 9, 6, 3], np.int32),
                 behavior_logprobs=np.array([-.5, -.1, 0, 0, 0, -.7, -.2], np.float32),
                 policy_versions=np.array([2, 3, 3, 3, 3, 4, 4], np.int32),
                 finish_reason="eos", loss_mask=mask, num_turns=2)


def test_pack_trains_model_tokens_only():
  r = _episode()
  batch = pack_rollouts([r], np.array([1.5]), seq_len=12)
  np.testing.assert_array_equal(batch.tokens[0, :9], [1, 2, 5, 3, 7, 8, 9, 6, 3])
  np.testing.assert_array_equal(batch.loss_mask[0, :9], [0, 0, 1, 1, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(batch.advantages[0, :9], [0, 0, 1.5, 1.5, 0, 0, 0, 1.5, 1.5])
  np.testing.assert_allclose(batch.behavior_logprobs[0, :9], [0, 0, -.5, -.1, 0, 0, 0, -.7, -.2])
  np.testing.assert_array_equal(batch.policy_versions[0, :9], [0, 0, 2, 3, 0, 0, 0, 4, 4])
  np.testing.assert_array_equal(batch.positions[0, :9], np.arange(9))
  assert r.oldest_version() == 2  # the episode's oldest token (environment tokens add none)
  (u,) = unpack_batch(batch)
  np.testing.assert_array_equal(u.completion_tokens, [5, 3, 6, 3])
  np.testing.assert_array_equal(r.last_turn_tokens, [6, 3])


def test_single_turn_rollouts_are_unchanged():
  r = _episode()
  single = Rollout(sample_id=1, group_id=0, prompt_tokens=r.prompt_tokens,
                   completion_tokens=r.completion_tokens, behavior_logprobs=r.behavior_logprobs,
                   policy_versions=r.policy_versions, finish_reason="eos")
  batch = pack_rollouts([single], np.array([2.0]), seq_len=12)
  np.testing.assert_array_equal(batch.loss_mask[0, 2:9], 1.0)
  assert single.num_turns == 1 and single.last_turn_tokens is single.completion_tokens
  with pytest.raises(ValueError, match="loss_mask"):
    Rollout(sample_id=1, group_id=0, prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens, behavior_logprobs=r.behavior_logprobs,
            policy_versions=r.policy_versions, finish_reason="eos", loss_mask=np.ones(3))
