"""The RL pipeline: the job (`run.run`, `RunConfig`, `build_job`, step hooks), the learner loop
(`drive`) with its clocks (virtual, threaded), the device-to-device weight channel, staleness
policies, the rollout queue and sequence packing.

Nothing below this package (sampler, learner, model, tasks) imports it. Building blocks that are
not re-exported here stay importable from their modules (e.g. `rlax_pipe.pipeline.staleness`
for the admission arithmetic, `rlax_pipe.pipeline.batching` for packing plans).

Names are imported on first use (PEP 562), so the host-only modules (`rules`, `staleness`,
`rollout_queue`, `group_filter`) import without JAX: the simulator (`rlax_pipe.sim`) uses them.
"""

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "pack_rollouts": "rlax_pipe.pipeline.batching",
    "unpack_batch": "rlax_pipe.pipeline.batching",
    "UnpackedSample": "rlax_pipe.pipeline.batching",
    "CostModel": "rlax_pipe.pipeline.config",
    "DRIVERS": "rlax_pipe.pipeline.rules",
    "MODES": "rlax_pipe.pipeline.config",
    "PipelineConfig": "rlax_pipe.pipeline.config",
    "RunConfig": "rlax_pipe.pipeline.config",
    "DeadlockError": "rlax_pipe.pipeline.driver",
    "drive": "rlax_pipe.pipeline.driver",
    "ThreadedClock": "rlax_pipe.pipeline.driver",
    "VirtualClocks": "rlax_pipe.pipeline.driver",
    "VirtualState": "rlax_pipe.pipeline.driver",
    "FILTER_MODES": "rlax_pipe.pipeline.group_filter",
    "GroupFilterConfig": "rlax_pipe.pipeline.group_filter",
    "Checkpoint": "rlax_pipe.pipeline.hooks",
    "Evaluation": "rlax_pipe.pipeline.hooks",
    "Report": "rlax_pipe.pipeline.hooks",
    "StepHook": "rlax_pipe.pipeline.hooks",
    "TrainLog": "rlax_pipe.pipeline.hooks",
    "build_job": "rlax_pipe.pipeline.job",
    "Job": "rlax_pipe.pipeline.job",
    "JobClock": "rlax_pipe.pipeline.job",
    "QueueClosed": "rlax_pipe.pipeline.rollout_queue",
    "QueueStats": "rlax_pipe.pipeline.rollout_queue",
    "QueueTimeout": "rlax_pipe.pipeline.rollout_queue",
    "RolloutQueue": "rlax_pipe.pipeline.rollout_queue",
    "RolloutWorker": "rlax_pipe.pipeline.rollout_worker",
    "POLICIES": "rlax_pipe.pipeline.staleness",
    "StalenessConfig": "rlax_pipe.pipeline.staleness",
    "token_lag": "rlax_pipe.pipeline.rules",
    "WasteCounters": "rlax_pipe.pipeline.staleness",
    "StepResult": "rlax_pipe.pipeline.trainer",
    "Trainer": "rlax_pipe.pipeline.trainer",
    "ChannelStats": "rlax_pipe.pipeline.weight_channel",
    "ManifestError": "rlax_pipe.pipeline.weight_channel",
    "params_manifest": "rlax_pipe.pipeline.weight_channel",
    "LoraWeightChannel": "rlax_pipe.pipeline.lora_channel",
    "WeightChannel": "rlax_pipe.pipeline.weight_channel",
}

__all__ = tuple(sorted(_EXPORTS))


def __getattr__(name: str) -> Any:
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS))
