r"""Benchmark: learner throughput and MFU, recompiles, temporary memory, FSDP collectives.

Prints one JSON object as its last line: `timing` (`run_benchmark`: tokens/s, MFU, compile_s,
compiles_after_step_1), `memory` (`memory_report`: temp_bytes, logits_temp_ratio, read from the
compiled program) and `collectives` (`collective_report` on --analysis_mesh, compiled on host CPU
devices: the HLO-derived collective summary). On CPU the script exposes 8 virtual devices.

  # CPU, reduced: timing on a tiny model (fsdp 2 x tp 2), memory + collectives at V=32k, L=2k
  python3 experiments/bench_learner.py --model=reduced_32k --steps=0 --seq_len=2048
  python3 experiments/bench_learner.py --model=tiny --mesh=fsdp:2,tp:2 --skip_memory
  # LoRA vs full fine-tuning at the same shape: push_bytes, opt_state_bytes and step_s
  python3 experiments/bench_learner.py --model=tiny --skip_memory --skip_collectives --lora_rank=8
  # the KL reference's memory (reference_bytes in `memory`) and its cost in the step
  python3 experiments/bench_learner.py --model=reduced_32k --kl=loss --compute_dtype=bfloat16 \
      --steps=3 --batch_size=8 --seq_len=512 --skip_collectives
  # one GPU, a 0.6B shape (Qwen3-0.6B) in bf16 compute with fp32 master params
  python3 experiments/bench_learner.py --model=qwen3_0p6b --mesh=fsdp:1 --compute_dtype=bfloat16 \
      --seq_len=2048 --batch_size=16 --micro_batch_rows=8 --remat=full --steps=4
"""

import dataclasses
import datetime
import json
import math
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

from absl import app  # noqa: E402  (after the device-count set-up above)
from absl import flags  # noqa: E402
import jax  # noqa: E402

from rlax_pipe import learner  # noqa: E402
from rlax_pipe import sharding  # noqa: E402
from rlax_pipe.config import LoraConfig, ModelConfig  # noqa: E402
from rlax_pipe.logprobs import SamplingConfig  # noqa: E402
from rlax_pipe.objectives import ObjectiveConfig  # noqa: E402

from lib import learner_bench as benchmark  # noqa: E402

MODELS = {
    "tiny": {},
    # Reduced width at the vocabulary and length: where full logits dominate memory.
    "reduced_32k": dict(vocab_size=32768, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=64, d_ff=768, max_seq_len=4096),
    # Qwen3-0.6B's shapes (config.json of Qwen/Qwen3-0.6B): 0.6B parameters, 152k vocabulary.
    "qwen3_0p6b": dict(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                       head_dim=128, d_ff=3072, rope_theta=1e6, qk_norm=True,
                       tie_embeddings=True, max_seq_len=4096),
}

_MODEL = flags.DEFINE_enum("model", "tiny", sorted(MODELS), "Model shape preset.")
_DTYPE = flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"],
                           "Activation / matmul dtype (params and Adam state stay float32).")
_MESH = flags.DEFINE_list("mesh", ["fsdp:2", "tp:2"], "Learner mesh axes, name:size, major first.")
_ANALYSIS_MESH = flags.DEFINE_list("analysis_mesh", ["fsdp:4", "tp:2"],
                                   "Mesh of the collective analysis (compiled on CPU devices).")
_ANALYSIS_LAYERS = flags.DEFINE_integer(
    "analysis_layers", 2, "Layers of the model compiled for the collective analysis (every "
    "layer's collectives are the same; fewer layers compile faster). 0 = the model's.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Rows per timed batch.")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Tokens per row (packed samples).")
_PACK = flags.DEFINE_integer("samples_per_row", 2, "Samples packed per row.")
_ROWS = flags.DEFINE_integer("micro_batch_rows", 8, "Rows per micro-batch (fixed shape).")
_MINI = flags.DEFINE_integer("num_minibatches", 1, "Optimizer updates per batch.")
_CHUNK = flags.DEFINE_integer("logits_chunk_len", 256, "Positions per logits chunk; 0 = full.")
_ATTN = flags.DEFINE_integer("attention_block_len", 512, "Queries per attention block; 0 = dense.")
_ATTN_IMPL = flags.DEFINE_enum("attention_impl", "blockwise", ["blockwise", "flash", "auto"],
                               "Training attention (LearnerConfig.attention_impl).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed optimizer steps (0 = no timing).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps (the first one compiles).")
_OBJECTIVE = flags.DEFINE_string("objective", "tis_pg", "Objective name.")
_KL = flags.DEFINE_enum("kl", "off", ["off", "loss", "reward"],
                        "KL to a reference (ObjectiveConfig.kl; the reference is the initial "
                        "params): its memory joins the memory report, its forward the timing.")
_REMAT = flags.DEFINE_enum("remat", "none", list(learner.REMAT_POLICIES), "Remat policy.")
_PEAK = flags.DEFINE_float("peak_tflops", None, "Peak TFLOP/s per chip for MFU (default: the "
                           "named-chip table by device kind).")
_LORA_RANK = flags.DEFINE_integer("lora_rank", 0, "LoRA rank (0 = full fine-tuning).")
_LORA_ALPHA = flags.DEFINE_float("lora_alpha", 16.0, "LoRA alpha (update scale alpha / rank).")
_SKIP_MEMORY = flags.DEFINE_bool("skip_memory", False, "Skip the memory report.")
_SKIP_COLLECTIVES = flags.DEFINE_bool("skip_collectives", False, "Skip the collective report.")


def _axes(spec):
  return tuple((name, int(size)) for name, size in (a.split(":") for a in spec))


def main(argv):
  del argv
  model = ModelConfig(**{**MODELS[_MODEL.value], "compute_dtype": _DTYPE.value})
  cfg = learner.LearnerConfig(
      mesh_axes=_axes(_MESH.value), micro_batch_rows=_ROWS.value,
      num_minibatches=_MINI.value, logits_chunk_len=_CHUNK.value or None,
      attention_block_len=_ATTN.value or None, attention_impl=_ATTN_IMPL.value,
      remat=_REMAT.value,
      lora=LoraConfig(rank=_LORA_RANK.value, alpha=_LORA_ALPHA.value))
  objective, sampling = ObjectiveConfig(name=_OBJECTIVE.value, kl=_KL.value), SamplingConfig()
  out = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
         "backend": jax.default_backend()}
  if _STEPS.value:
    out["timing"] = benchmark.run_benchmark(
        model, cfg, objective, sampling, batch_size=_BATCH.value, seq_len=_SEQ.value,
        steps=_STEPS.value, warmup=_WARMUP.value, samples_per_row=_PACK.value,
        peak_tflops=_PEAK.value)
  if not _SKIP_MEMORY.value:
    mesh = learner.learner_mesh(jax.devices()[:cfg.num_devices], cfg)
    out["memory"] = benchmark.memory_report(model, cfg, objective, sampling, mesh, _SEQ.value)
  if not _SKIP_COLLECTIVES.value:
    axes = _axes(_ANALYSIS_MESH.value)
    shards = math.prod(n for name, n in axes if name in learner.BATCH_MESH_AXES)
    analysis_cfg = dataclasses.replace(  # rows rounded up to a multiple of the batch shards
        cfg, mesh_axes=axes, micro_batch_rows=-(-cfg.micro_batch_rows // shards) * shards)
    analysis_model = model if not _ANALYSIS_LAYERS.value else dataclasses.replace(
        model, n_layers=_ANALYSIS_LAYERS.value)
    cpus = jax.devices("cpu")[:analysis_cfg.num_devices]
    mesh = sharding.make_mesh(cpus, dict(axes), sharding.LEARNER_RULES)
    out["collectives"] = benchmark.collective_report(analysis_model, analysis_cfg, objective,
                                                     sampling, mesh, _SEQ.value)
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
