"""Sharded learner: configs, shardings of params and batches, train state, jitted train step,
checkpoints, `Learner`. Mesh building and the generic sharding helpers live in
`rlax_pipe.sharding`; the model is passed in (`rlax_pipe.model.Model`)."""

from rlax_pipe.learner.benchmark import run_benchmark, synthetic_batch
from rlax_pipe.learner.checkpoint import (
    CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError,
    Checkpointer, Restored)
from rlax_pipe.learner.config import SCHEDULES, CheckpointConfig, LearnerConfig, OptimizerConfig
from rlax_pipe.learner.learner import Learner, NonFiniteError, batch_arrays
from rlax_pipe.learner.optimizer import decay_mask, learning_rate, make_optimizer
from rlax_pipe.learner.sharding import batch_sharding, learner_mesh, param_shardings
from rlax_pipe.learner.train_state import (
    TrainState, abstract_state, init_state, sharded_abstract_state, state_shardings)
from rlax_pipe.learner.train_step import (
    BATCH_FIELDS, completion_mask, make_train_step, normalizer_count, shifted_token_logprobs)

__all__ = [
    "BATCH_FIELDS", "CheckpointConfig", "CheckpointCorruptError", "CheckpointError",
    "CheckpointMismatchError", "CheckpointNotFoundError", "Checkpointer", "Learner",
    "LearnerConfig", "OptimizerConfig",
    "NonFiniteError", "Restored", "SCHEDULES", "TrainState", "abstract_state", "batch_arrays",
    "batch_sharding", "completion_mask", "decay_mask", "init_state", "learner_mesh",
    "learning_rate", "make_optimizer", "make_train_step", "normalizer_count",
    "param_shardings", "run_benchmark",
    "sharded_abstract_state", "shifted_token_logprobs", "state_shardings", "synthetic_batch",
]
