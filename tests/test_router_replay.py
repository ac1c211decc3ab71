"""Router replay's host side: compact dtypes and their cost, the Rollout field, packing into the
TrainBatch (completion positions only), padding / splitting, and the queue / checkpoint /
multi-process representations."""

import dataclasses
import pickle
import json

import numpy as np
import pytest

from rlax_pipe import router_replay as rr
from rlax_pipe.objectives import ObjectiveConfig
from rlax_pipe.pipeline import batching
from rlax_pipe.pipeline import rollout_queue
from rlax_pipe import types
from rlax_pipe.types import Rollout


def _rollout(sid, prompt_len, n, routes=True, lm=3, k=2, x=8):
  rng = np.random.default_rng(sid)
  return Rollout(
      sample_id=sid, group_id=0, prompt_tokens=np.arange(1, prompt_len + 1, dtype=np.int32),
      completion_tokens=np.full(n, 7, np.int32), behavior_logprobs=np.full(n, -0.5, np.float32),
      policy_versions=np.zeros(n, np.int32), finish_reason="eos",
      routes=rr.pack_routes(rng.integers(0, x, (n, lm, k)), x) if routes else None)


def test_dtypes_and_memory_cost():
  assert rr.routes_dtype(32) == np.int8 and rr.routes_dtype(127) == np.int8
  assert rr.routes_dtype(128) == np.int16
  # gpt-oss-20b: 24 MoE layers x top-4 of 32 -> 96 B/token; Qwen3-30B-A3B: 48 x 8 of 128.
  assert rr.route_bytes_per_token(24, 4, 32) == 96
  assert rr.route_bytes_per_token(48, 8, 128) == 768
  with pytest.raises(ValueError, match="expert ids"):
    rr.pack_routes(np.full((2, 1, 1), 8), 8)
  with pytest.raises(ValueError, match="T, L_moe, k"):
    rr.pack_routes(np.zeros((2, 3)), 8)


def test_rollout_checks_routes_shape():
  with pytest.raises(ValueError, match="routes"):
    dataclasses.replace(_rollout(0, 2, 3), routes=np.zeros((4, 3, 2), np.int8))
  with pytest.raises(ValueError, match="router_replay"):
    ObjectiveConfig(router_replay="on")


def test_packing_places_routes_at_completion_tokens_only():
  rollouts = [_rollout(0, 3, 4), _rollout(1, 2, 5), _rollout(2, 4, 2)]
  batch = batching.pack_rollouts(rollouts, np.zeros(3), seq_len=12)
  assert batch.routes.dtype == np.int8 and batch.routes.shape == (
      batch.tokens.shape + (3, 2))
  # routes[t] sit at the token fed to produce completion token t: one position earlier
  fed = np.concatenate([batch.loss_mask[:, 1:] > 0, np.zeros((batch.tokens.shape[0], 1), bool)],
                       axis=1)
  assert np.all(batch.routes[~fed] == rr.NO_ROUTE)
  by_id = {r.completion_tokens.size: r for r in rollouts}
  for s in batching.unpack_batch(batch):
    idx = np.nonzero((batch.segment_ids[s.row] == s.segment) & fed[s.row])[0]
    np.testing.assert_array_equal(batch.routes[s.row, idx], by_id[idx.size].routes)
  padded = batching.pack_rollouts(rollouts, np.zeros(3), seq_len=12, num_rows=4)
  assert padded.routes.shape[0] == 4 and np.all(padded.routes[batch.tokens.shape[0]:] == -1)
  dense = batching.pack_rollouts([_rollout(0, 3, 4, routes=False)], np.zeros(1), 12, num_rows=4)
  assert dense.routes is None
  with pytest.raises(ValueError, match="no routes"):
    batching.pack_rollouts([_rollout(0, 3, 4), _rollout(1, 3, 4, routes=False)], np.zeros(2),
                           12)


def test_routes_survive_queue_state_checkpoint_and_process_messages():
  r = _rollout(5, 3, 4)
  back = rollout_queue.rollout_from_dict(rollout_queue.rollout_to_dict(r))
  assert back.routes.dtype == np.int8
  np.testing.assert_array_equal(back.routes, r.routes)
  as_json = json.loads(json.dumps({k: (v.tolist() if isinstance(v, np.ndarray) else v)
                                    for k, v in types.rollout_to_dict(r).items()}))
  back = types.rollout_from_dict(as_json)  # lists (a state written as plain JSON)
  assert back.routes.dtype == np.int16
  np.testing.assert_array_equal(back.routes, r.routes)
  back = pickle.loads(pickle.dumps(r))  # multi-process links pickle the Rollout
  np.testing.assert_array_equal(back.routes, r.routes)
  old = rollout_queue.rollout_to_dict(_rollout(6, 3, 4, routes=False))
  del old["routes"]  # a queue state written before routes existed
  assert rollout_queue.rollout_from_dict(old).routes is None
