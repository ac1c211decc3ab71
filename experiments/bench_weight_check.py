"""Cost of the sampler's always-on weight check (issue #14 item 10) next to a decode step.

After every weight swap the engine computes `param_checksum.checksum` of the weights it decodes
with and compares it with the learner's checksums of that version. This prints, as one JSON
object, the warmed wall time (median of --repeats) of that checksum on the sampler mesh, next to
one single-token forward of `--batch` rows (every weight read once, as in a decode step) with
the same params and mesh. Both exclude compile time (one warm-up call each).

  python3 experiments/bench_weight_check.py                          # the default model, tp 4
  python3 experiments/bench_weight_check.py --mesh_tp=1 --batch=64   # on one accelerator
"""

import json
import statistics
import time

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)

# pylint: disable=wrong-import-position
from absl import app
from absl import flags
import jax
import numpy as np

from rlax_pipe import param_checksum
from rlax_pipe import sharding as sharding_lib
from rlax_pipe.model import Transformer
from rlax_pipe.pipeline.config import RunConfig
from rlax_pipe.pipeline.job import load_initial_params

_TP = flags.DEFINE_integer("mesh_tp", 4, "devices of the sampler mesh (tp axis)")
_BATCH = flags.DEFINE_integer("batch", 32, "rows of the single-token forward (decode slots)")
_REPEATS = flags.DEFINE_integer("repeats", 20, "timed calls of each (median reported)")


def _median_s(fn) -> float:
  jax.block_until_ready(fn())  # warm-up: compile
  times = []
  for _ in range(_REPEATS.value):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv):
  del argv
  model_cfg, params = load_initial_params(RunConfig().init)
  model = Transformer(model_cfg)
  mesh = sharding_lib.make_mesh(jax.devices()[:_TP.value], {"tp": _TP.value},
                                sharding_lib.SAMPLER_RULES)
  params = jax.device_put(params, sharding_lib.logical_to_sharding(
      model.param_axes(), mesh, sharding_lib.SAMPLER_RULES, params))
  tokens = np.ones((_BATCH.value, 1), np.int32)
  positions = np.full((_BATCH.value, 1), 7, np.int32)
  forward = jax.jit(lambda p, t, q: model.forward(p, t, q)[0])
  checksum_s = _median_s(lambda: param_checksum.checksum(params))
  forward_s = _median_s(lambda: forward(params, tokens, positions))
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  print(json.dumps({
      "what": "warmed wall time, median of repeats (compile excluded)",
      "platform": jax.devices()[0].platform, "mesh_tp": _TP.value,
      "param_bytes": int(nbytes), "leaves": len(jax.tree.leaves(params)),
      "checksum_s": checksum_s, "single_token_forward_s": forward_s, "batch": _BATCH.value,
      "checksum_over_forward": checksum_s / forward_s}))


if __name__ == "__main__":
  app.run(main)
