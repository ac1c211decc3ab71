"""The learner's side of router replay: with objective.router_replay='replay' the micro-batch
program takes the batch's routes [R, L, L_moe, k] (int16) and hands them to the model; a batch
without routes, or a dense model, is refused with the field to fix."""

import jax
import numpy as np
import pytest

from rlax_pipe import learner as learner_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner.learner import batch_arrays, lower_accumulate
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.objectives import ObjectiveConfig
from rlax_pipe.types import TrainBatch

MOE = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
                  d_ff=24, n_experts=4, n_experts_per_tok=2, moe_d_ff=8)
CFG = learner_lib.LearnerConfig(mesh_axes=(("fsdp", 1),), micro_batch_rows=2)


def test_replay_program_takes_the_routes():
  mesh = learner_lib.learner_mesh(jax.devices()[:1], CFG)
  text = lower_accumulate(MOE, CFG, ObjectiveConfig(router_replay="replay"), SamplingConfig(),
                          mesh, 8).as_text()
  assert "2x8x2x2xi16" in text  # [R, L, L_moe, k] routes, int16
  off = lower_accumulate(MOE, CFG, ObjectiveConfig(), SamplingConfig(), mesh, 8).as_text()
  assert "2x8x2x2xi16" not in off
  dense = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                      head_dim=8, d_ff=24)
  with pytest.raises(ValueError, match="router_replay='replay' needs a mixture-of-experts"):
    lower_accumulate(dense, CFG, ObjectiveConfig(router_replay="replay"), SamplingConfig(),
                     mesh, 8)


def test_batch_without_routes_is_refused_under_replay():
  z = np.zeros((2, 8), np.int32)
  batch = TrainBatch(tokens=z, positions=z, segment_ids=z, loss_mask=z.astype(np.float32),
                     behavior_logprobs=z.astype(np.float32), policy_versions=z,
                     advantages=z.astype(np.float32))
  assert "routes" not in batch_arrays(batch)
  with pytest.raises(ValueError, match="router_replay=off"):
    batch_arrays(batch, routes=True)
  routes = np.full((2, 8, 2, 2), -1, np.int8)
  got = batch_arrays(TrainBatch(**{**batch.__dict__, "routes": routes}), routes=True)
  assert got["routes"].dtype == np.int16 and got["routes"].shape == (2, 8, 2, 2)
