"""The RL pipeline: the job (`run.run`, `RunConfig`, `build_job`, step hooks), the drivers that
interleave sampler and learner, the device-to-device weight channel, staleness policies, the
rollout queue and sequence packing.

Nothing below this package (sampler, learner, model, tasks) imports it. Building blocks that are
not re-exported here stay importable from their modules (e.g. `rlax_pipe.pipeline.staleness`
for the admission arithmetic, `rlax_pipe.pipeline.batching` for packing plans).
"""

from rlax_pipe.pipeline.batching import pack_rollouts
from rlax_pipe.pipeline.batching import unpack_batch
from rlax_pipe.pipeline.batching import UnpackedSample
from rlax_pipe.pipeline.config import CostModel
from rlax_pipe.pipeline.config import DRIVERS
from rlax_pipe.pipeline.config import MODES
from rlax_pipe.pipeline.config import PipelineConfig
from rlax_pipe.pipeline.config import RunConfig
from rlax_pipe.pipeline.driver import DeadlockError
from rlax_pipe.pipeline.driver import run_reproducible
from rlax_pipe.pipeline.driver import run_threaded
from rlax_pipe.pipeline.driver import VirtualState
from rlax_pipe.pipeline.group_filter import FILTER_MODES
from rlax_pipe.pipeline.group_filter import GroupFilterConfig
from rlax_pipe.pipeline.hooks import Checkpoint
from rlax_pipe.pipeline.hooks import Evaluation
from rlax_pipe.pipeline.hooks import Report
from rlax_pipe.pipeline.hooks import StepHook
from rlax_pipe.pipeline.hooks import TrainLog
from rlax_pipe.pipeline.job import build_job
from rlax_pipe.pipeline.job import Job
from rlax_pipe.pipeline.job import JobClock
from rlax_pipe.pipeline.rollout_queue import QueueClosed
from rlax_pipe.pipeline.rollout_queue import QueueStats
from rlax_pipe.pipeline.rollout_queue import QueueTimeout
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.pipeline.rollout_worker import RolloutWorker
from rlax_pipe.pipeline.staleness import POLICIES
from rlax_pipe.pipeline.staleness import StalenessConfig
from rlax_pipe.pipeline.staleness import token_lag
from rlax_pipe.pipeline.staleness import WasteCounters
from rlax_pipe.pipeline.trainer import StepResult
from rlax_pipe.pipeline.trainer import Trainer
from rlax_pipe.pipeline.weight_channel import ChannelStats
from rlax_pipe.pipeline.weight_channel import ManifestError
from rlax_pipe.pipeline.weight_channel import params_manifest
from rlax_pipe.pipeline.lora_channel import LoraWeightChannel
from rlax_pipe.pipeline.weight_channel import WeightChannel

__all__ = (
    "Checkpoint", "ChannelStats", "CostModel", "DRIVERS", "DeadlockError", "Evaluation",
    "FILTER_MODES", "GroupFilterConfig", "Job", "JobClock", "LoraWeightChannel", "MODES",
    "ManifestError", "POLICIES", "PipelineConfig", "QueueClosed", "QueueTimeout", "QueueStats",
    "Report", "RolloutQueue", "RolloutWorker", "RunConfig", "StalenessConfig", "StepHook",
    "StepResult", "TrainLog", "Trainer", "UnpackedSample",
    "VirtualState", "WasteCounters", "WeightChannel", "build_job", "pack_rollouts",
    "params_manifest", "run_reproducible", "run_threaded", "token_lag", "unpack_batch",
)
