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

# module of this package -> the public names it defines
_MODULES: dict[str, tuple[str, ...]] = {
    "batching": ("pack_rollouts", "unpack_batch", "UnpackedSample"),
    "config": ("CostModel", "MODES", "PipelineConfig", "RunConfig"),
    "driver": ("DeadlockError", "drive", "ThreadedClock", "VirtualClocks", "VirtualState"),
    "group_filter": ("FILTER_MODES", "GroupFilterConfig"),
    "hooks": ("Checkpoint", "Evaluation", "Report", "StepHook", "TrainLog"),
    "job": ("build_job", "Job", "JobClock"),
    "lora_channel": ("LoraWeightChannel",),
    "rollout_queue": ("QueueClosed", "QueueStats", "QueueTimeout", "RolloutQueue"),
    "rollout_worker": ("RolloutWorker",),
    "rules": ("DRIVERS", "token_lag"),
    "staleness": ("POLICIES", "StalenessConfig", "WasteCounters"),
    "trainer": ("StepResult", "Trainer"),
    "weight_channel": ("ChannelStats", "ManifestError", "params_manifest", "WeightChannel"),
}
# public name -> the module that defines it
_EXPORTS: dict[str, str] = {name: f"{__name__}.{module}"
                            for module, names in _MODULES.items() for name in names}

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
