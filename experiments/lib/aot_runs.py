"""Runs of `experiments/aot_compile.py`: every device program of a preset compiled for a TPU
topology (deviceless, `rlax_pipe.aot`), one JSON record per program. Labelled "compiled for
TPU, not run": no number here is a timing."""

from __future__ import annotations

import dataclasses
import time
import os
import re
from typing import Any, Iterator

import jax
import numpy as np

from lib import sampler_presets as presets
from rlax_pipe import aot
from rlax_pipe import costs
from rlax_pipe import hlo_costs
from rlax_pipe import sharding as sharding_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner.config import LearnerConfig
from rlax_pipe.model import as_model
from rlax_pipe.sampler import page_pool
from rlax_pipe.sampler.config import SamplerConfig
from rlax_pipe.sampler.paged_cache import uses_combined_layout

# The tiny CI model (tests/test_aot.py) and the real shapes.
TINY = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=128, d_ff=256, max_seq_len=256, param_dtype="bfloat16",
                   compute_dtype="bfloat16")
# A tiny mixture of experts (8 experts, top-2, every layer MoE) for the expert-parallel learner.
TINY_MOE = dataclasses.replace(TINY, n_experts=8, n_experts_per_tok=2, moe_d_ff=128)
MODELS: dict[str, ModelConfig] = {"tiny": TINY, "tiny-moe": TINY_MOE, **presets.PRESETS,
                                  "llama-3.1-8b": presets.LLAMA_3_1_8B,
                                  "qwen3-30b-a3b": costs.QWEN3_30B_A3B,
                                  "gpt-oss-20b": costs.GPT_OSS_20B}


def parse_mesh(spec: list[str]) -> dict[str, int]:
  """["fsdp:4", "tp:2"] -> {"fsdp": 4, "tp": 2}."""
  out = {}
  for item in spec:
    name, _, size = item.partition(":")
    if not size.isdigit():
      raise ValueError(f"mesh axis {item!r}: write name:size, e.g. fsdp:4.")
    out[name] = int(size)
  return out


def pages_that_fit(rep: dict[str, Any], layout: page_pool.PoolLayout, mesh_size: int,
                   copies: bool) -> int | None:
  """Largest num_pages whose decode program would fit, from one compile: the need without the
  pool is taken as fixed and the pool counted once (twice when the program copies it)."""
  hbm = rep["memory"]["hbm_bytes"]
  if hbm is None:
    return None
  per_page = layout.nbytes / layout.num_pages / mesh_size * (2 if copies else 1)
  fixed = rep["memory"]["need_bytes"] - per_page * layout.num_pages
  return max(0, int((hbm - fixed) // per_page))


def hlo_prefix(hlo_dir: str | None, *parts: Any) -> str | None:
  """A file-name prefix under `hlo_dir` for one program's HLO text (None: do not save)."""
  if not hlo_dir:
    return None
  os.makedirs(hlo_dir, exist_ok=True)
  tag = "_".join(re.sub(r"[^\w.\-]+", "-", str(p)).strip("-") for p in parts)
  return os.path.join(hlo_dir, tag + "_")


def reread_record(path: str) -> dict[str, Any]:
  """Trip-count-weighted kernels, matmul FLOPs and bytes (`hlo_costs.costs`) of an HLO text
  that `--hlo_dir` saved: the counts of a compiled program again, without compiling it."""
  with open(path, encoding="utf-8") as f:
    return dict(hlo=path, label="compiled for TPU, not run", **hlo_costs.costs(f.read()))


def sampler_records(name: str, model_cfg: ModelConfig, cfg: SamplerConfig, topology: str,
                    tp: int, impls: tuple[str, ...], steps: int,
                    hlo_dir: str | None = None) -> Iterator[dict[str, Any]]:
  """One record per (kernel, program) of the sampler replica on `tp` topology devices
  (with `hlo_dir`, each program's optimized HLO text is written there too)."""
  devices = aot.topology_devices(topology)
  mesh = sharding_lib.make_mesh(devices[:tp], {sharding_lib.TP: tp})
  for impl in impls:
    t0 = time.time()
    base = dict(model=name, topology=topology, role="sampler", mesh={"tp": tp}, impl=impl,
                device_kind=devices[0].device_kind, num_slots=cfg.num_slots,
                num_pages=cfg.num_pages, max_seq_len=cfg.max_seq_len, steps=steps,
                label="compiled for TPU, not run")
    try:
      reports = aot.sampler_report(
          model_cfg, cfg, mesh, impl, steps=steps,
          hlo_prefix=hlo_prefix(hlo_dir, name, topology, f"tp{tp}", impl))
    except Exception as e:  # pylint: disable=broad-except  (the compiler's error is the finding)
      yield dict(base, program="decode", compiled=False, error=f"{type(e).__name__}: {e}"[:2000])
      continue
    layout = page_pool.PoolLayout.of(as_model(model_cfg), cfg,
                                     combined=uses_combined_layout(impl), platform="tpu")
    for program, rep in reports.items():
      rec = dict(base, program=program, compiled=True, compile_s=round(time.time() - t0, 1),
                 **rep)
      if program == "decode":
        rec["num_pages_fit"] = pages_that_fit(rep, layout, tp, rep["pool_copies"] > 0)
      yield rec


def learner_records(name: str, model_cfg: ModelConfig, topology: str, meshes: list[dict],
                    seq_len: int, micro_batch_rows: int, remat: str,
                    block_len: int, attention_impl: str = "blockwise",
                    hlo_dir: str | None = None) -> Iterator[dict[str, Any]]:
  """One record per learner mesh: the micro-batch step (fp32 master params, bf16 compute) with
  training attention `attention_impl` (`LearnerConfig.attention_impl`)."""
  devices = aot.topology_devices(topology)
  learner_model = dataclasses.replace(model_cfg, param_dtype="float32",
                                      compute_dtype="bfloat16", max_seq_len=max(
                                          model_cfg.max_seq_len, seq_len))
  for axes in meshes:
    n = 1
    for size in axes.values():
      n *= size
    mesh = sharding_lib.make_mesh(devices[:n], axes)
    cfg = LearnerConfig(mesh_axes=tuple(axes.items()), micro_batch_rows=micro_batch_rows,
                        remat=remat, logits_chunk_len=min(256, seq_len),
                        attention_block_len=min(block_len, seq_len),
                        attention_impl=attention_impl)
    t0 = time.time()
    base = dict(model=name, topology=topology, role="learner", mesh=axes,
                device_kind=devices[0].device_kind, seq_len=seq_len,
                micro_batch_rows=micro_batch_rows, remat=remat, program="train_step",
                attention_impl=attention_impl,
                label="compiled for TPU, not run")
    try:
      prefix = hlo_prefix(hlo_dir, name, topology, *(f"{k}{v}" for k, v in axes.items()),
                          attention_impl, f"remat-{remat}", f"{micro_batch_rows}x{seq_len}")
      rep = aot.learner_report(learner_model, cfg, mesh, seq_len,
                               hlo_path=prefix and prefix + "train_step.hlo.txt")
    except Exception as e:  # pylint: disable=broad-except
      yield dict(base, compiled=False, error=f"{type(e).__name__}: {e}"[:2000])
      continue
    rep.pop("activation_collectives_over_fsdp_detail", None)
    yield dict(base, compiled=True, compile_s=round(time.time() - t0, 1), **rep)


def reshard_records(name: str, model_cfg: ModelConfig, topology: str, learner_axes: dict,
                    sampler_axes: dict, hlo_dir: str | None = None) -> Iterator[dict[str, Any]]:
  """The weight push (`WeightChannel.lower_transfer`, the product's own plan) from a learner
  mesh on the first topology devices to a sampler mesh on the next ones: one record per
  compiled hop, plus the bytes the cross-mesh copy moves."""
  # pylint: disable=import-outside-toplevel  (pipeline is above aot's layer; only this run needs it)
  from rlax_pipe.learner import sharding as learner_sharding
  from rlax_pipe.pipeline.weight_channel import WeightChannel
  devices = aot.topology_devices(topology)
  n_l = int(np.prod(list(learner_axes.values())))
  n_s = int(np.prod(list(sampler_axes.values())))
  if n_l + n_s > len(devices):
    raise ValueError(f"reshard: learner {learner_axes} + sampler {sampler_axes} need "
                     f"{n_l + n_s} chips; {topology} has {len(devices)}.")
  l_mesh = sharding_lib.make_mesh(devices[:n_l], learner_axes, sharding_lib.LEARNER_RULES)
  s_mesh = sharding_lib.make_mesh(devices[n_l:n_l + n_s], sampler_axes,
                                  sharding_lib.SAMPLER_RULES)
  model = as_model(model_cfg)
  abstract = model.abstract_params()
  learner_params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract, learner_sharding.param_shardings(model, l_mesh))
  t0 = time.time()
  lowered = WeightChannel(aot.sampler_params(model_cfg, s_mesh)).lower_transfer(learner_params)
  total = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
              for a in jax.tree.leaves(abstract))
  base = dict(model=name, topology=topology, role="reshard", learner_mesh=learner_axes,
              sampler_mesh=sampler_axes, device_kind=devices[0].device_kind,
              params_bytes=total, leaves_resharded=lowered["leaves_resharded"],
              leaves_refined=lowered["leaves_refined"],
              device_put_bytes=lowered["device_put_bytes"],
              device_put_bytes_max_per_device=lowered["device_put_bytes_max_per_device"],
              label="compiled for TPU, not run")
  for program, mesh in (("learner_hop", l_mesh), ("sampler_hop", s_mesh)):
    if lowered[program] is None:
      yield dict(base, program=program, compiled=None, note="no leaf needs this hop")
      continue
    try:
      prefix = hlo_prefix(hlo_dir, name, topology, "reshard")
      rep = aot.program_report(lowered[program].compile(), mesh,
                               hlo_path=prefix and f"{prefix}{program}.hlo.txt")
    except Exception as e:  # pylint: disable=broad-except  (the compiler's error is the finding)
      yield dict(base, program=program, compiled=False, error=f"{type(e).__name__}: {e}"[:2000])
      continue
    yield dict(base, program=program, compiled=True, compile_s=round(time.time() - t0, 1),
               **rep)
