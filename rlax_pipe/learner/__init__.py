"""Sharded learner: mesh and shardings, train state, jitted train step, checkpoints, `Learner`."""

from rlax_pipe.learner.benchmark import run_benchmark, synthetic_batch
from rlax_pipe.learner.checkpoint import CheckpointError, Checkpointer, Restored
from rlax_pipe.learner.config import BATCH_MESH_AXES, REMAT_POLICIES, SCHEDULES, LearnerConfig
from rlax_pipe.learner.learner import Learner, NonFiniteError, batch_arrays, plan_micro_batches
from rlax_pipe.learner.optimizer import decay_mask, learning_rate, make_optimizer
from rlax_pipe.learner.sharding import (
    batch_sharding, compute_constraint, learner_mesh, opt_state_shardings, param_shardings,
    replicated)
from rlax_pipe.learner.train_state import (
    TrainState, abstract_state, init_state, sharded_abstract_state, state_shardings)
from rlax_pipe.learner.train_step import (
    BATCH_FIELDS, BatchStats, GradAccum, StepFns, completion_mask, make_step_fns)

__all__ = [
    "BATCH_FIELDS", "BATCH_MESH_AXES", "BatchStats", "CheckpointError", "Checkpointer",
    "GradAccum", "Learner", "LearnerConfig", "NonFiniteError", "REMAT_POLICIES", "Restored",
    "SCHEDULES", "StepFns", "TrainState", "abstract_state", "batch_arrays", "batch_sharding",
    "completion_mask", "compute_constraint", "decay_mask", "init_state", "learner_mesh",
    "learning_rate", "make_optimizer", "make_step_fns", "opt_state_shardings",
    "param_shardings", "plan_micro_batches", "replicated", "run_benchmark",
    "sharded_abstract_state", "state_shardings", "synthetic_batch",
]
