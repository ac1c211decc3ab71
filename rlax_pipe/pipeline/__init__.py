"""Pipeline building blocks: weight channel, staleness policies, rollout queue, packing.

The drivers (sync / async-batch / pipeline) are built from these pieces.
"""

from rlax_pipe.pipeline.batching import pack_rollouts
from rlax_pipe.pipeline.batching import packing_plan
from rlax_pipe.pipeline.batching import pad_rows_to_multiple
from rlax_pipe.pipeline.batching import split_rows
from rlax_pipe.pipeline.batching import unpack_batch
from rlax_pipe.pipeline.batching import UnpackedSample
from rlax_pipe.pipeline.rollout_queue import QueueClosed
from rlax_pipe.pipeline.rollout_queue import QueueStats
from rlax_pipe.pipeline.rollout_queue import QueueTimeout
from rlax_pipe.pipeline.rollout_queue import rollout_from_dict
from rlax_pipe.pipeline.rollout_queue import rollout_to_dict
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.pipeline.staleness import admission_admit
from rlax_pipe.pipeline.staleness import admission_from_dict
from rlax_pipe.pipeline.staleness import admission_headroom
from rlax_pipe.pipeline.staleness import admission_init
from rlax_pipe.pipeline.staleness import admission_retire
from rlax_pipe.pipeline.staleness import admission_to_dict
from rlax_pipe.pipeline.staleness import AdmissionState
from rlax_pipe.pipeline.staleness import areal_admission_allowed
from rlax_pipe.pipeline.staleness import can_admit
from rlax_pipe.pipeline.staleness import due_groups
from rlax_pipe.pipeline.staleness import count_waste
from rlax_pipe.pipeline.staleness import is_too_stale
from rlax_pipe.pipeline.staleness import partition_by_staleness
from rlax_pipe.pipeline.staleness import POLICIES
from rlax_pipe.pipeline.staleness import queue_overflow
from rlax_pipe.pipeline.staleness import StalenessConfig
from rlax_pipe.pipeline.staleness import token_lag
from rlax_pipe.pipeline.staleness import WASTE_REASONS
from rlax_pipe.pipeline.staleness import WasteCounters
from rlax_pipe.pipeline.weight_channel import assert_congruent
from rlax_pipe.pipeline.weight_channel import ChannelStats
from rlax_pipe.pipeline.weight_channel import check_manifest
from rlax_pipe.pipeline.weight_channel import LeafSpec
from rlax_pipe.pipeline.weight_channel import ManifestError
from rlax_pipe.pipeline.weight_channel import params_manifest
from rlax_pipe.pipeline.weight_channel import WeightChannel
from rlax_pipe.pipeline.weight_channel import Weights

__all__ = (
    "AdmissionState", "ChannelStats", "LeafSpec", "ManifestError", "POLICIES", "QueueClosed",
    "QueueStats", "QueueTimeout", "RolloutQueue", "StalenessConfig", "UnpackedSample",
    "WASTE_REASONS", "WasteCounters", "WeightChannel", "Weights", "admission_admit",
    "admission_from_dict", "admission_headroom", "admission_init", "admission_retire",
    "admission_to_dict", "areal_admission_allowed", "assert_congruent", "can_admit",
    "check_manifest", "count_waste", "due_groups", "is_too_stale", "pack_rollouts",
    "packing_plan", "pad_rows_to_multiple", "params_manifest", "partition_by_staleness",
    "queue_overflow", "rollout_from_dict", "rollout_to_dict", "split_rows", "token_lag",
    "unpack_batch",
)
