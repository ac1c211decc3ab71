"""Sharded learner: configs, shardings of params and batches, train state, jitted train step,
checkpoints, `Learner`. Mesh building and the generic sharding helpers live in
`rlax_pipe.sharding`; the model is passed in (`rlax_pipe.model.Model`)."""

from rlax_pipe.learner.checkpoint import (
    CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError,
    CheckpointTargetError, CheckpointTopologyError,
    Checkpointer, Restored)
from rlax_pipe.learner.config import (
    BATCH_MESH_AXES, REMAT_POLICIES, SCHEDULES, CheckpointConfig, LearnerConfig, OptimizerConfig)
from rlax_pipe.host_rules import plan_micro_batches
from rlax_pipe.learner.learner import Learner, NonFiniteError, batch_arrays, lower_accumulate
from rlax_pipe.learner.reference import (
    abstract_reference, load_reference_params, reference_bytes)
from rlax_pipe.learner.optimizer import decay_mask, learning_rate, make_optimizer
from rlax_pipe.learner.sharding import batch_sharding, learner_mesh, param_shardings
from rlax_pipe.learner import token_loss
from rlax_pipe.learner.train_state import (
    TrainState, abstract_state, init_state, sharded_abstract_state, state_shardings)
from rlax_pipe.learner.train_step import (
    BATCH_FIELDS, BatchStats, GradAccum, StepFns, completion_mask, make_step_fns)

__all__ = [
    "BATCH_FIELDS", "BATCH_MESH_AXES", "BatchStats", "CheckpointConfig", "CheckpointCorruptError",
    "CheckpointError", "CheckpointMismatchError", "CheckpointNotFoundError",
    "CheckpointTargetError", "CheckpointTopologyError", "Checkpointer",
    "GradAccum", "Learner", "LearnerConfig", "NonFiniteError", "OptimizerConfig", "REMAT_POLICIES",
    "Restored", "SCHEDULES", "StepFns", "TrainState", "abstract_reference", "abstract_state",
    "batch_arrays", "batch_sharding", "completion_mask", "decay_mask", "init_state", "learner_mesh",
    "learning_rate", "load_reference_params", "lower_accumulate", "make_optimizer", "make_step_fns",
    "param_shardings", "plan_micro_batches", "reference_bytes",
    "sharded_abstract_state", "state_shardings", "token_loss",
]
