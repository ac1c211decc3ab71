"""Cluster what-if: best sampler/learner split per max lag, and how idle sync leaves the hardware.

  python experiments/sim_whatif.py                          # 64 devices, 8B model (defaults)
  python experiments/sim_whatif.py --num_devices=128 --max_lags=1,4,16 --png=/tmp/split.png
  python experiments/sim_whatif.py --policies=block,drop     # admission control vs dropping

The cost model is the analytic one of rlax_pipe.costs (named chip, model shape; assumptions in
its docstring and in rlax_pipe/sim/whatif.py's). Prints one JSON object.
"""

import dataclasses
import json
import pathlib

from absl import app
from absl import flags

from rlax_pipe.sim import whatif

_DEVICES = flags.DEFINE_integer("num_devices", 64, "Accelerators shared by sampler and learner.")
_CHIP = flags.DEFINE_string("chip", "H100", "Accelerator (a name of rlax_pipe.costs.CHIPS).")
_LAGS = flags.DEFINE_list("max_lags", ["1", "2", "4", "8"], "Pipeline max_lag values (steps).")
_POLICIES = flags.DEFINE_list("policies", ["block"], "Staleness policies of the pipeline "
                              "settings: block (admission) and/or drop.")
_SYNC = flags.DEFINE_bool("sync", True, "Also simulate the sync driver.")
_GROUPS = flags.DEFINE_integer("groups_per_step", 64, "Prompt groups per learner step.")
_GROUP = flags.DEFINE_integer("group_size", 16, "Samples per prompt.")
_MEAN = flags.DEFINE_float("mean_completion_tokens", 2048, "Mean completion length (tokens).")
_SIGMA = flags.DEFINE_float("sigma", 1.0, "Log-std of the log-normal completion length.")
_STEPS = flags.DEFINE_integer("steps", 30, "Simulated learner steps per point.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 10, "Steps excluded from the numbers.")
_PNG = flags.DEFINE_string("png", "runs/sim_whatif/throughput_vs_split.png", "Plot path.")


def main(argv):
  del argv
  d = whatif.Cluster()
  cluster = dataclasses.replace(
      d, num_devices=_DEVICES.value, chip=_CHIP.value,
      workload=dataclasses.replace(d.workload, groups_per_step=_GROUPS.value,
                                   group_size=_GROUP.value,
                                   mean_completion_tokens=_MEAN.value,
                                   completion_sigma=_SIGMA.value))
  settings = ([("sync", 0, "block")] if _SYNC.value else []) + [
      ("pipeline", int(k), p) for p in _POLICIES.value for k in _LAGS.value]
  pathlib.Path(_PNG.value).parent.mkdir(parents=True, exist_ok=True)
  print(json.dumps(whatif.report(cluster, settings, num_steps=_STEPS.value,
                                 warmup_steps=_WARMUP.value, png_path=_PNG.value)))


if __name__ == "__main__":
  app.run(main)
