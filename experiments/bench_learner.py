"""Benchmark: sharded learner throughput (tokens/s) on synthetic packed batches.

Prints one JSON object (`rlax_pipe.learner.run_benchmark` + date) as its last line. On CPU the
script exposes 8 virtual devices (unless XLA_FLAGS already sets a count); the learner uses the
first `prod(mesh sizes)` of them.

  python3 experiments/bench_learner.py --mesh=fsdp:2,tp:2 --batch_size=16 --seq_len=256
"""

import datetime
import json
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

from absl import app  # noqa: E402  (after the device-count set-up above)
from absl import flags  # noqa: E402

from rlax_pipe import learner  # noqa: E402
from rlax_pipe.config import ModelConfig  # noqa: E402
from rlax_pipe.logprobs import SamplingConfig  # noqa: E402
from rlax_pipe.objectives import ObjectiveConfig  # noqa: E402

_MESH = flags.DEFINE_list("mesh", ["fsdp:2", "tp:2"], "Learner mesh axes, name:size, major first.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Rows per batch.")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Tokens per row (packed samples).")
_PACK = flags.DEFINE_integer("samples_per_row", 2, "Samples packed per row.")
_MICRO = flags.DEFINE_integer("micro_batches", 1, "Gradient-accumulation micro-batches.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed optimizer steps.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps (the first one compiles).")
_OBJECTIVE = flags.DEFINE_string("objective", "tis_pg", "Objective name.")
_REMAT = flags.DEFINE_bool("remat", False, "Rematerialize transformer blocks.")


def main(argv):
  del argv
  axes = tuple((name, int(size)) for name, size in (a.split(":") for a in _MESH.value))
  cfg = learner.LearnerConfig(mesh_axes=axes, micro_batches=_MICRO.value, remat=_REMAT.value)
  result = learner.run_benchmark(
      ModelConfig(), cfg, ObjectiveConfig(name=_OBJECTIVE.value), SamplingConfig(),
      batch_size=_BATCH.value, seq_len=_SEQ.value, steps=_STEPS.value, warmup=_WARMUP.value,
      samples_per_row=_PACK.value)
  print(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), **result}))


if __name__ == "__main__":
  app.run(main)
