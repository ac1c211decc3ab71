"""Real model shapes for the sampler benchmark, named accelerators, and the HBM roofline.

Presets copy the architecture of public checkpoints (their HF `config.json`) with random bf16
weights: the benchmark measures shapes, not quality. Rotary scaling variants (Llama 3.2's
"llama3" rope scaling) are not modelled; they do not change a decode step's bytes.

Roofline of a decode step (Williams et al. 2009, "Roofline"; decoding is memory-bound): every
step reads all weights once plus the live KV of every active sequence, so

  fraction = (weight bytes + live KV bytes read per step) / step time / HBM bandwidth.

Bandwidths are the vendors' datasheet numbers (below, with sources); `--hbm_gbps` overrides.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from rlax_pipe import model as model_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.costs import chips
from rlax_pipe.sampler.config import Request, SamplerConfig
from rlax_pipe.sampler.engine import SamplerEngine

# Qwen/Qwen3-0.6B config.json: hidden_size 1024, intermediate_size 3072, 28 layers, 16 heads,
# 8 kv heads, head_dim 128, vocab 151936, tied embeddings, rope_theta 1e6, q/k RMSNorm.
QWEN3_0_6B = ModelConfig(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                         head_dim=128, d_ff=3072, rope_theta=1e6, qk_norm=True,
                         tie_embeddings=True, param_dtype="bfloat16", compute_dtype="bfloat16",
                         max_seq_len=4096)
# meta-llama/Llama-3.2-1B config.json: hidden_size 2048, intermediate_size 8192, 16 layers,
# 32 heads, 8 kv heads, head_dim 64, vocab 128256, tied embeddings, rope_theta 500000.
LLAMA_3_2_1B = ModelConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32,
                           n_kv_heads=8, head_dim=64, d_ff=8192, rope_theta=500000.0,
                           rms_eps=1e-5, tie_embeddings=True, param_dtype="bfloat16",
                           compute_dtype="bfloat16", max_seq_len=4096)
PRESETS: dict[str, ModelConfig] = {"qwen3-0.6b": QWEN3_0_6B, "llama-3.2-1b": LLAMA_3_2_1B}
# meta-llama/Llama-3.1-8B config.json: hidden_size 4096, intermediate_size 14336, 32 layers,
# 32 heads, 8 kv heads, head_dim 128, vocab 128256, untied embeddings, rope_theta 500000.
# Compiled for TPU only (experiments/aot_compile.py); not in PRESETS (too large to run here).
LLAMA_3_1_8B = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                           n_kv_heads=8, head_dim=128, d_ff=14336, rope_theta=500000.0,
                           rms_eps=1e-5, tie_embeddings=False, param_dtype="bfloat16",
                           compute_dtype="bfloat16", max_seq_len=8192)

def chip_bandwidth_gbps(device: jax.Device | None = None) -> tuple[str, float | None]:
  """(device kind, HBM GB/s from the one chip table `rlax_pipe.costs.chips` (vendors' data
  sheets), or None for an unknown chip or a CPU)."""
  device = device or jax.devices()[0]
  kind = getattr(device, "device_kind", device.platform)
  if device.platform == "cpu":
    return kind, None
  c = chips.chip_for_device(kind)
  return kind, (None if c is None else c.hbm_bandwidth / 1e9)


def reduced(model_cfg: ModelConfig, n_layers: int = 2, vocab_size: int = 4096) -> ModelConfig:
  """The preset with fewer layers and a smaller vocabulary (the CPU run); widths unchanged."""
  return dataclasses.replace(model_cfg, n_layers=min(n_layers, model_cfg.n_layers),
                             vocab_size=min(vocab_size, model_cfg.vocab_size))


def weight_bytes(params) -> int:
  """Bytes of every parameter array."""
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))


def roofline_fraction(bytes_per_step: float, step_s: float, hbm_gbps: float | None
                      ) -> float | None:
  """Achieved bandwidth / peak bandwidth (None without a known bandwidth)."""
  if not hbm_gbps or step_s <= 0:
    return None
  return bytes_per_step / step_s / (hbm_gbps * 1e9)


def run_preset(name: str, *, slots: int | None = None, prompt_len: int = 128,
               new_tokens: int = 128, hbm_gbps: float | None = None, full: bool | None = None,
               attention_impl: str = "auto", seed: int = 0) -> dict:
  """Decode throughput of a preset model with random bf16 weights, and its roofline fraction.

  `slots` requests of `prompt_len` random tokens each generate exactly `new_tokens` tokens
  (no stop id). The first engine step (admission, prefill, first dispatch) is excluded; the
  rest is pure decode, timed wall clock after `warmup()` (compiles apart).

  Args:
    name: a key of `PRESETS`.
    slots: decode slots (default 64 on an accelerator, 4 on CPU).
    prompt_len, new_tokens: tokens per request.
    hbm_gbps: HBM bandwidth override (GB/s); default from `rlax_pipe.costs.chips` by device kind.
    full: run the full-size preset (default: on an accelerator only; CPU runs `reduced`).
    attention_impl: the sampler's attention switch ("auto" = Pallas kernel on GPU/TPU).
    seed: PRNG seed.

  Returns:
    dict: preset, device, reduced, model shape, slots, decode_tokens_per_s, decode_step_ms,
    bytes_per_step (weights + mean live KV read, from the shapes), hbm_gbps, roofline_fraction.

  Raises:
    KeyError: for an unknown preset name.
  """
  if name not in PRESETS:
    raise KeyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
  device = jax.devices()[0]
  accel = device.platform != "cpu"
  full = accel if full is None else full
  model_cfg = PRESETS[name] if full else reduced(PRESETS[name])
  slots = slots or (64 if accel else 4)
  max_len = -(-(prompt_len + new_tokens + 1) // 16) * 16
  model_cfg = dataclasses.replace(model_cfg, max_seq_len=max(max_len, 16))
  cfg = SamplerConfig(num_slots=slots, page_size=16, num_pages=slots * (max_len // 16) + 16,
                      max_seq_len=max_len, max_new_tokens=new_tokens,
                      min_prefill_bucket=min(prompt_len, max_len), prefill_rows=min(slots, 8),
                      cache_dtype="bfloat16", attention_impl=attention_impl,
                      share_prompt_pages=False, seed=seed)
  params = jax.jit(model_lib.init_params, static_argnums=0)(model_cfg, jax.random.key(seed))
  engine = SamplerEngine(model_cfg, cfg, params)
  engine.warmup(prompt_len)
  rng = np.random.default_rng(seed)
  for i in range(slots):
    engine.submit(Request(prompt_tokens=rng.integers(0, model_cfg.vocab_size, prompt_len
                                                     ).astype(np.int32), sample_id=i))
  engine.step()  # admission + prefill + first dispatch
  before = engine.stats()
  t0 = time.perf_counter()
  engine.run_to_completion()
  elapsed = time.perf_counter() - t0
  after = engine.stats()
  steps = after.decode_steps - before.decode_steps
  tokens = after.generated_tokens - before.generated_tokens
  layout_bytes = engine.replicas[0].layout.bytes_per_token  # K + V of one token, all layers
  first = before.generated_tokens // slots  # tokens each sequence had before the timed part
  mean_live = prompt_len + (first + new_tokens) / 2  # live tokens per slot, mean over steps
  bytes_per_step = weight_bytes(params) + slots * mean_live * layout_bytes
  step_s = elapsed / max(steps, 1)
  kind, table_gbps = chip_bandwidth_gbps(device)
  gbps = hbm_gbps or table_gbps
  return {
      "preset": name, "device": kind, "platform": device.platform, "reduced": not full,
      "attention_impl": engine.impl, "n_layers": model_cfg.n_layers,
      "vocab_size": model_cfg.vocab_size, "slots": slots, "prompt_len": prompt_len,
      "new_tokens": new_tokens, "decode_steps_timed": steps, "decode_tokens_timed": tokens,
      "decode_tokens_per_s": tokens / elapsed, "decode_step_ms": 1e3 * step_s,
      "weight_bytes": weight_bytes(params), "bytes_per_step": bytes_per_step,
      "hbm_gbps": gbps, "hbm_gbps_source": "--hbm_gbps" if hbm_gbps else (
          "rlax_pipe.costs.chips" if table_gbps else None),
      "roofline_fraction": roofline_fraction(bytes_per_step, step_s, gbps),
  }
