r"""LoRA against full fine-tuning at the same shape: one JSON line.

Read from the compiled learner micro-batch program (forward + backward + accumulation; FLOPs,
bytes accessed, temp and argument bytes: independent of machine load), and measured wall-clock
of one weight hand-over (push + take; LoRA also checks and merges on the sampler mesh), warm: 3
untimed rounds (compiles), then the median of --rounds timed rounds. Shape: bench_learner's
`tiny` model, learner mesh fsdp 2 x tp 2, sampler mesh tp 4 (8 virtual CPU devices).

  python3 experiments/bench_lora.py --rank=8
"""

import json
import os
import time

os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from rlax_pipe import learner, sharding  # noqa: E402
from rlax_pipe.config import LoraConfig, ModelConfig  # noqa: E402
from rlax_pipe.learner import sharding as lsh  # noqa: E402
from rlax_pipe.logprobs import SamplingConfig  # noqa: E402
from rlax_pipe.model import LoraAdapters, Transformer  # noqa: E402
from rlax_pipe.objectives import ObjectiveConfig  # noqa: E402
from rlax_pipe.pipeline.lora_channel import LoraWeightChannel, sampler_target  # noqa: E402
from rlax_pipe.pipeline.weight_channel import WeightChannel  # noqa: E402
from rlax_pipe.types import WeightUpdate  # noqa: E402

_RANK = flags.DEFINE_integer("rank", 8, "LoRA rank (all 7 weight matrices adapted).")
_ROUNDS = flags.DEFINE_integer("rounds", 20, "Timed hand-over rounds (after 3 untimed).")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Row length of the compiled micro-batch (tokens).")


def _compiled(rank: int) -> dict:
  cfg = learner.LearnerConfig(mesh_axes=(("fsdp", 2), ("tp", 2)), micro_batch_rows=8,
                              lora=LoraConfig(rank=rank))
  mesh = learner.learner_mesh(jax.devices()[:4], cfg)
  c = learner.lower_accumulate(ModelConfig(), cfg, ObjectiveConfig(name="tis_pg"),
                               SamplingConfig(), mesh, _SEQ.value).compile()
  ca = c.cost_analysis()
  ca = ca[0] if isinstance(ca, list) else ca
  m = c.memory_analysis()
  return {"flops": ca.get("flops"), "bytes_accessed": ca.get("bytes accessed"),
          "temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes}


def _hand_over_s(channel, tree) -> float:
  ts = []
  for v in range(3 + _ROUNDS.value):
    t0 = time.perf_counter()
    channel.push(WeightUpdate(v, tree))
    update = channel.take()
    jax.block_until_ready(update.params)
    ts.append(time.perf_counter() - t0)
    jax.tree.map(lambda x: x.delete(), update.params)
  return float(np.median(ts[3:]))


def main(argv):
  del argv
  model = Transformer(ModelConfig())
  lmesh = sharding.make_mesh(jax.devices()[:4], {"fsdp": 2, "tp": 2}, sharding.LEARNER_RULES)
  smesh = sharding.make_mesh(jax.devices()[4:], {"tp": 4}, sharding.SAMPLER_RULES)
  base = jax.jit(model.init_params, out_shardings=lsh.param_shardings(model, lmesh))(
      jax.random.key(0))
  lora = LoraAdapters(model, LoraConfig(rank=_RANK.value))
  adapters = jax.jit(lora.init_params, out_shardings=lsh.param_shardings(lora, lmesh))(
      jax.random.key(1))
  full = WeightChannel(sampler_target(model.param_axes(), model.abstract_params(), smesh))
  lch = LoraWeightChannel(lora, base, smesh)
  out = {"rank": _RANK.value, "rounds": _ROUNDS.value,
         "compiled_full": _compiled(0), "compiled_lora": _compiled(_RANK.value),
         "full_push_take_s": _hand_over_s(full, base),
         "full_bytes": full.stats().bytes_per_version,
         "lora_push_take_merge_s": _hand_over_s(lch, adapters),
         "lora_bytes": lch.stats().bytes_per_version}
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
