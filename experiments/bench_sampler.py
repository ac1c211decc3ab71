"""Sampler benchmarks; each prints one JSON object as its last line. Runs unchanged on CPU (8
virtual devices, reduced preset sizes) and on one GPU or TPU (full preset sizes, native kernels).

  python3 experiments/bench_sampler.py                         # paged vs static, long tail
  python3 experiments/bench_sampler.py --suite=scaling         # issue #10 point 7 (+ static)
  python3 experiments/bench_sampler.py --suite=kernels         # Pallas kernels vs reference
  python3 experiments/bench_sampler.py --preset=qwen3-0.6b     # decode tok/s + HBM roofline
  python3 experiments/bench_sampler.py --preset=all --hbm_gbps=4800

Imports nothing beyond jax, flax, numpy and absl (no ml_collections, no tokenizers).
"""

import dataclasses
import json

from rlax_pipe import platform_setup

platform_setup.request_cpu_devices(8)  # data replicas need >= 2 devices on CPU

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

from lib import sampler_presets as presets
from lib import sampler_scaling
from lib import sampler_workload as benchmark

_SUITE = flags.DEFINE_enum("suite", "workload", ["workload", "scaling", "kernels"],
                           "workload: paged vs static; scaling: point-7 ratios; kernels: Pallas "
                           "kernels vs the jnp reference.")
_PRESET = flags.DEFINE_enum("preset", None, sorted(presets.PRESETS) + ["all"],
                            "Run a real-model-shaped decode benchmark instead of a suite.")
_HBM = flags.DEFINE_float("hbm_gbps", None, "HBM bandwidth (GB/s) for the roofline; default "
                          "from the named-chip table by device kind.")
_FULL = flags.DEFINE_bool("full", None, "Full-size preset (default: on an accelerator only).")
_PRESET_SLOTS = flags.DEFINE_integer("preset_slots", None, "Decode slots of --preset (default 64 on "
                                     "an accelerator, 4 on CPU).")
_PRESET_IMPL = flags.DEFINE_enum("preset_attention_impl", "auto",
                                 ["auto", "reference", "pallas_gpu", "pallas_tpu"],
                                 "Attention implementation of --preset (auto = kernel by platform).")
_N = flags.DEFINE_integer("num_requests", 1024, "Requests in the workload suite.")
_SLOTS = flags.DEFINE_integer("num_slots", 32, "Decode slots (= static batch size).")
_PAGES = flags.DEFINE_integer("num_pages", 192, "KV pages (16 tokens each) in the paged pool.")
_LONG_FRAC = flags.DEFINE_float("long_frac", 0.02, "Fraction of long (256-320 token) requests.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")


def _workload(num_requests: int) -> dict:
  sampler_cfg = dataclasses.replace(benchmark.SAMPLER, num_slots=_SLOTS.value,
                                    num_pages=_PAGES.value)
  workload = benchmark.WorkloadConfig(num_requests=num_requests, long_frac=_LONG_FRAC.value,
                                      seed=_SEED.value)
  return benchmark.run(benchmark.MODEL, sampler_cfg, workload)


def main(argv):
  del argv
  if _PRESET.value:
    names = sorted(presets.PRESETS) if _PRESET.value == "all" else [_PRESET.value]
    out = [presets.run_preset(n, hbm_gbps=_HBM.value, full=_FULL.value, slots=_PRESET_SLOTS.value,
                              attention_impl=_PRESET_IMPL.value) for n in names]
    print(json.dumps(out[0] if len(out) == 1 else {"presets": out}))
  elif _SUITE.value == "scaling":
    out = sampler_scaling.run_scaling()
    out["paged_vs_static"] = _workload(min(_N.value, 256))
    print(json.dumps(out))
  elif _SUITE.value == "kernels":
    print(json.dumps(sampler_scaling.kernel_checks()))
  else:
    print(json.dumps(_workload(_N.value)))


if __name__ == "__main__":
  app.run(main)
