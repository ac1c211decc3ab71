"""Where a decode step's fixed cost can come from, read from the compiled program of the local
backend (issue #28 item 4): kernels launched per decode step (loop trip counts applied), matmul
FLOPs per step against the model's, bytes accessed per step against the minimum (weights + the
KV of full slots; an opaque Pallas kernel's operands apart), full-vocabulary sorts, dtype
converts, gathers/scatters.
One JSON line. On a CPU the preset is reduced (2 layers, 4k vocabulary) unless --full.

  python3 experiments/decode_attribution.py --preset=qwen3-0.6b --slots=8
  python3 experiments/decode_attribution.py --preset=qwen3-0.6b --top_p=0.9   # with a sort
"""

import json

import jax
import re

from absl import app
from absl import flags

from lib import sampler_presets as presets
from rlax_pipe import aot, hlo_costs
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import as_model
from rlax_pipe.sampler import page_pool
from rlax_pipe.sampler.config import SamplerConfig
from rlax_pipe.sampler.paged_cache import uses_combined_layout

_PRESET = flags.DEFINE_enum("preset", "qwen3-0.6b", sorted(presets.PRESETS), "Model shape.")
_SLOTS = flags.DEFINE_integer("slots", 8, "Decode slots.")
_STEPS = flags.DEFINE_integer("steps", 8, "Decode steps per dispatch.")
_IMPL = flags.DEFINE_string("attention_impl", "reference", "reference / pallas_gpu / ...")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Sampling top-p (1 = off).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sampling top-k (0 = off).")
_FULL = flags.DEFINE_bool("full", None, "Full-size preset (default: off on CPU).")


def main(argv):
  del argv
  mesh = page_pool.default_mesh()
  platform = mesh.devices.flat[0].platform
  full = _FULL.value if _FULL.value is not None else platform != "cpu"
  model_cfg = presets.PRESETS[_PRESET.value]
  model_cfg = model_cfg if full else presets.reduced(model_cfg)
  cfg = SamplerConfig(num_slots=_SLOTS.value, page_size=16, num_pages=_SLOTS.value * 16,
                      max_seq_len=256, max_new_tokens=128, cache_dtype="bfloat16",
                      sampling=SamplingConfig(top_p=_TOP_P.value, top_k=_TOP_K.value))
  hlo = aot.lower_sampler(model_cfg, cfg, mesh, _IMPL.value, steps=_STEPS.value)[
      "decode"].compile().as_text()
  counted = hlo_costs.costs(hlo)
  model_flops = 2.0 * aot.flops.matmul_params(model_cfg) * cfg.num_slots
  layout = page_pool.PoolLayout.of(as_model(model_cfg), cfg, platform=platform,
                                   combined=uses_combined_layout(_IMPL.value))
  weights = sum(a.size * a.dtype.itemsize for a in
                jax.tree.leaves(as_model(model_cfg).abstract_params()))
  minimum = weights + cfg.num_slots * cfg.max_seq_len * layout.bytes_per_token
  print(json.dumps({
      "platform": platform, "preset": _PRESET.value, "full": full,
      "n_layers": model_cfg.n_layers, "slots": cfg.num_slots, "steps": _STEPS.value,
      "impl": _IMPL.value, "top_p": _TOP_P.value, "top_k": _TOP_K.value,
      "kernels_per_step": counted["kernels"] / _STEPS.value,
      "matmul_flops_per_step": counted["matmul_flops"] / _STEPS.value,
      "compiled_over_model_matmul_flops": counted["matmul_flops"] / _STEPS.value / model_flops,
      "bytes_per_step": counted["bytes"] / _STEPS.value,
      "kernel_operand_bytes_per_step": counted["kernel_bytes"] / _STEPS.value,
      "min_bytes_per_step": minimum,
      "bytes_per_step_over_min": counted["bytes"] / _STEPS.value / minimum,
      "loops_unknown_trip_count": counted["loops_unknown"],
      "sorts": len(re.findall(r" sort\(", hlo)),
      "converts_unfused": len(re.findall(r"= \S+ convert\(", hlo)),
      "gathers": len(re.findall(r" gather\(", hlo)),
      "scatters": len(re.findall(r" scatter\(", hlo)),
  }))


if __name__ == "__main__":
  app.run(main)
