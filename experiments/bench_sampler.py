"""Benchmark: paged continuous-batching sampler vs static dense-KV batches, long-tailed lengths.

Prints one JSON object (the metrics of `rlax_pipe.sampler.benchmark.run`) as its last line.

  python3 experiments/bench_sampler.py --num_requests=1024 --num_slots=32
"""

import dataclasses
import json

from absl import app
from absl import flags

from rlax_pipe.sampler import benchmark

_N = flags.DEFINE_integer("num_requests", 1024, "Requests in the workload.")
_SLOTS = flags.DEFINE_integer("num_slots", 32, "Decode slots (= static batch size).")
_PAGES = flags.DEFINE_integer("num_pages", 192, "KV pages (16 tokens each) in the paged pool.")
_LONG_FRAC = flags.DEFINE_float("long_frac", 0.02, "Fraction of long (256-320 token) requests.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")


def main(argv):
  del argv
  sampler_cfg = dataclasses.replace(benchmark.SAMPLER, num_slots=_SLOTS.value,
                                    num_pages=_PAGES.value)
  workload = benchmark.WorkloadConfig(num_requests=_N.value, long_frac=_LONG_FRAC.value,
                                      seed=_SEED.value)
  print(json.dumps(benchmark.run(benchmark.MODEL, sampler_cfg, workload)))


if __name__ == "__main__":
  app.run(main)
