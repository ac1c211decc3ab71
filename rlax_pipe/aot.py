"""Compiling the device programs for a TPU topology without a TPU (deviceless AOT, issue #28).

With `libtpu` installed, `jax.experimental.topologies.get_topology_desc` gives the devices of a
TPU slice ("v5e:2x2", "v5p:2x2x1", ...) to build meshes from; the sampler's and the learner's
OWN jitted programs (`device_loop.decode_dispatch`, `device_loop.prefill_step`,
`learner.lower_accumulate`) are lowered from abstract inputs carrying shardings on those meshes
and compiled by the TPU compiler. Nothing runs: what comes back is the compiled program, its
`memory_analysis()` (bytes per device), `cost_analysis()` and optimized HLO (fusions, Mosaic
custom calls of the Pallas kernels, collectives, copies). There is no second model for AOT: the
abstract inputs are `jax.eval_shape` outputs of the runtime's initializers and the shardings
come from `rlax_pipe.sharding`'s rule tables.

Facts this relies on (measured, `shared/reference/tpu-aot.md`): the runtime stays on CPU
(`JAX_PLATFORMS=cpu`); no array can be placed on topology devices, so every input is a
`ShapeDtypeStruct`; the ragged TPU kernel reads the TPU generation from the default device, so
its trace runs under `jax.default_device(<a topology device>)` (`lowering_context`).
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rlax_pipe import hlo_collectives
from rlax_pipe import hlo_costs
from rlax_pipe import objectives
from rlax_pipe import sharding as sharding_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.costs import chips
from rlax_pipe.learner import flops
from rlax_pipe.learner.config import LearnerConfig
from rlax_pipe.learner.learner import lower_accumulate
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import as_model
from rlax_pipe.sampler import device_loop, page_pool
from rlax_pipe.sampler.config import SamplerConfig
from rlax_pipe.sampler.paged_cache import uses_combined_layout

SAMPLER_IMPLS: tuple[str, ...] = ("reference", "pallas_tpu", "pallas_tpu_ragged")


def topology_devices(topology: str) -> list[Any]:
  """The devices of TPU slice `topology` (e.g. "v5e:2x2", "v5p:2x2x1"), for compiling only.

  Raises:
    RuntimeError: when libtpu is not installed (`pip install "libtpu==0.0.42.*"` for jax
      0.10.2) or the topology name is not known to it.
  """
  from jax.experimental import topologies  # only the AOT path needs it
  # Compiling needs no TPU, so several processes (tests, sweeps) may load libtpu at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
  except Exception as e:  # pylint: disable=broad-except  (jax raises several kinds)
    raise RuntimeError(
        f"cannot build TPU topology {topology!r} ({type(e).__name__}: {e}). Deviceless TPU "
        "compiles need libtpu (pip install 'libtpu==0.0.42.*' for jax 0.10.2) and a topology "
        "name like 'v5e:2x2', 'v5p:2x2x1', 'v6e:2x2'.") from e


def chip_hbm_bytes(device: Any) -> float | None:
  """HBM bytes of `device`'s chip (vendor data sheets, `costs.chips`), None when unknown."""
  c = chips.chip_for_device(device.device_kind)
  return None if c is None else c.hbm_bytes


@contextlib.contextmanager
def lowering_context(mesh: Mesh):
  """Makes a topology device the default device while tracing (JAX's TPU Pallas kernels read
  the TPU generation from it)."""
  with jax.default_device(mesh.devices.flat[0]):
    yield


def _abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      tree, shardings)


def sampler_params(model_cfg: ModelConfig, mesh: Mesh) -> Any:
  """Abstract parameters in the sampler mesh's shardings (`sharding.SAMPLER_RULES`)."""
  model = as_model(model_cfg)
  abstract = model.abstract_params()
  shardings = sharding_lib.logical_to_sharding(model.param_axes(), mesh,
                                               sharding_lib.SAMPLER_RULES, shapes=abstract)
  return _abstract(abstract, shardings)


def lower_sampler(model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh, impl: str, *,
                  steps: int = 8, chunk_pages: int = 16, prefill_len: int | None = None
                  ) -> dict[str, jax.stages.Lowered]:
  """The sampler replica's programs on `mesh` (a "tp" mesh), lowered from abstract inputs.

  Args:
    model_cfg: the model; cfg: sampler configuration (slots, pages, page size, cache dtype).
    mesh: one replica's mesh (TPU topology devices, axis "tp").
    impl: "reference", "pallas_tpu" or "pallas_tpu_ragged".
    steps: decode steps per dispatch (K).
    chunk_pages: the reference's pages per chunk.
    prefill_len: prefill bucket length (default: `cfg.max_seq_len` rounded to pages).

  Returns:
    {"decode": decode_dispatch, "prefill": prefill_step, "table_update": write_tables,
    "page_copy": copy_pages (copy-on-write of shared prompt pages)}, lowered.
  """
  model = as_model(model_cfg)
  layout = page_pool.PoolLayout.of(model, cfg, combined=uses_combined_layout(impl),
                                   platform=mesh.devices.flat[0].platform)
  pool_sh = layout.sharding(mesh)
  rep = page_pool.replicated(mesh)
  params = sampler_params(model_cfg, mesh)
  pools = tuple(jax.ShapeDtypeStruct(s, layout.storage_dtype, sharding=pool_sh)
                for s in layout.shapes)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)
  b, w = cfg.num_slots, cfg.table_width
  static = dict(model=model, layout=layout, impl=impl, chunk_pages=chunk_pages, mesh=mesh,
                interpret=False, sharding=pool_sh)
  state = jax.eval_shape(lambda: device_loop.SlotState.zeros(b, jax.random.key(0)))
  state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), state)
  rows = cfg.prefill_rows
  length = prefill_len or -(-cfg.max_seq_len // cfg.page_size) * cfg.page_size
  out = {}
  with lowering_context(mesh):
    out["decode"] = device_loop.decode_dispatch.lower(
        params, pools, i32(b, w), state, i32(device_loop.UPDATE_ROWS, b), i32(),
        sampling=cfg.sampling, stop_ids=(0,), steps=steps, replicated=rep, **static)
    out["prefill"] = device_loop.prefill_step.lower(
        params, pools, i32(rows, w), i32(rows, length), i32(rows), i32(rows), **static)
    u = 16
    out["table_update"] = device_loop.write_tables.lower(i32(b, w), i32(u), i32(u), i32(u),
                                                         replicated=rep)
    out["page_copy"] = page_pool.copy_pages.lower(pools, i32(u), i32(u), layout=layout,
                                                  sharding=pool_sh)
  return out


def pool_copies(hlo: str, shapes: tuple[tuple[int, ...], ...]) -> int:
  """Number of `copy` / `copy-start` ops in `hlo` whose result has a pool shape (per device;
  leading size-1 axes dropped too): a pool that is not written in place, or is moved to
  another layout or memory space for a kernel."""
  wanted = set()
  for s in shapes:
    s = tuple(s)
    while s:
      wanted.add("[" + ",".join(map(str, s)) + "]")
      if s[0] != 1:
        break
      s = s[1:]
  n = 0
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) (copy|copy-start)\(", line)
    if m and any(w in m.group(1).split("{")[0] + m.group(1) for w in wanted):
      n += 1
  return n


def memory_fit(compiled: Any, hbm: float | None) -> dict[str, Any]:
  """Bytes per device of a compiled program against the chip's HBM.

  Returns:
    argument_bytes, output_bytes, alias_bytes, temp_bytes, code_bytes, need_bytes (arguments +
    outputs not aliased to an argument + temporaries + code: the device memory the program
    needs while it runs), hbm_bytes and fits (None when the chip is unknown).
  """
  m = compiled.memory_analysis()
  need = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
  return {"argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes),
          "alias_bytes": int(m.alias_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
          "code_bytes": int(m.generated_code_size_in_bytes), "need_bytes": int(need),
          "hbm_bytes": None if hbm is None else int(hbm),
          "fits": None if hbm is None else bool(need <= hbm)}


def program_report(compiled: Any, mesh: Mesh, hlo_path: str | None = None) -> dict[str, Any]:
  """What the TPU compiler says about one program, per device.

  Args:
    compiled: a `jax.stages.Compiled`; mesh: the mesh it was compiled for.
    hlo_path: when given, the optimized HLO text is also written there (to re-read the
      program later without recompiling it).

  Returns:
    memory (`memory_fit`), kernels, matmul_flops and bytes (accessed by XLA's kernels) per
    device with loop trip counts, kernel_bytes (operands + outputs of the Mosaic kernels, which
    are opaque), bytes_loop_bodies_once (the same rules with every loop counted once: compare
    with cost_bytes_accessed_loop_bodies_once) (`hlo_costs.costs`; a loop of unknown trip
    count, e.g. the reference's chunk loop, counted once: loops_unknown_trip_count says how
    many), cost (`cost_analysis()` flops and bytes accessed: a loop body counted ONCE),
    custom_calls, mosaic_kernels (Pallas kernels), collectives (`hlo_collectives.summarize`:
    op -> count / bytes / mesh axes).
  """
  hlo = compiled.as_text()
  if hlo_path:
    with open(hlo_path, "w", encoding="utf-8") as f:
      f.write(hlo)
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):
    cost = cost[0] if cost else {}
  counted = hlo_costs.costs(hlo)
  return {
      "memory": memory_fit(compiled, chip_hbm_bytes(mesh.devices.flat[0])),
      "kernels": counted["kernels"],
      "matmul_flops": counted["matmul_flops"],
      "bytes": counted["bytes"],
      "kernel_bytes": counted["kernel_bytes"],
      "bytes_loop_bodies_once": counted["bytes_loop_bodies_once"],
      "loops_unknown_trip_count": counted["loops_unknown"],
      "cost_flops_loop_bodies_once": float(cost.get("flops", 0.0)),
      "cost_bytes_accessed_loop_bodies_once": float(cost.get("bytes accessed", 0.0)),
      "custom_calls": len(re.findall(r"custom-call\(", hlo)),
      "mosaic_kernels": hlo.count('custom_call_target="tpu_custom_call"'),
      "collectives": hlo_collectives.summarize(hlo_collectives.collectives(hlo, mesh)),
  }


def sampler_report(model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh, impl: str, *,
                   steps: int = 8, hlo_prefix: str | None = None) -> dict[str, dict[str, Any]]:
  """Compiles the sampler's programs (`lower_sampler`) and reports each (`program_report`),
  plus, for the decode dispatch, pool-shaped copies in its HLO (goal 0: writes in place and
  kernels reading the pool in XLA's layout), per decode step (the dispatch loop's trip count
  is `steps`): kernels, matmul FLOPs against the model's (2 x matmul params x slots), bytes
  against the minimum (weights + the KV of full slots, at most a full pool, per device):
  min_bytes_per_step,
  bytes_per_step (XLA's kernels) and bytes_per_step_over_min, where a Mosaic attention kernel
  (opaque) is taken to read exactly the live KV (its minimum), and the reference's KV reads
  are in the XLA count.

  Raises:
    Whatever the TPU compiler raises (a lowering error of a kernel is the finding).
  """
  model = as_model(model_cfg)
  layout = page_pool.PoolLayout.of(model, cfg, combined=uses_combined_layout(impl),
                                   platform=mesh.devices.flat[0].platform)
  out = {}
  for name, lowered in lower_sampler(model_cfg, cfg, mesh, impl, steps=steps).items():
    compiled = lowered.compile()
    rep = program_report(compiled, mesh,
                         hlo_path=f"{hlo_prefix}{name}.hlo.txt" if hlo_prefix else None)
    if name == "decode":
      rep["pool_copies"] = pool_copies(compiled.as_text(), tuple(
          tuple(s // (mesh.size if i == layout.axes.index(sharding_lib.KV_HEADS)
                      and layout.sharding(mesh).spec[i] else 1) for i, s in enumerate(shape))
          for shape in layout.shapes))
      weights = sum(int(np.prod(a.shape)) * a.dtype.itemsize
                    for a in jax.tree.leaves(model.abstract_params()))
      # Full slots, but no more tokens than the pool holds.
      live_kv = min(cfg.num_slots * cfg.max_seq_len,
                    cfg.num_pages * cfg.page_size) * layout.bytes_per_token
      rep["min_bytes_per_step"] = int((weights + live_kv) / mesh.size)
      rep["min_weight_bytes_per_step"] = int(weights / mesh.size)
      # The dispatch loop's trip count is `steps` (its bound): per decode step = / steps.
      rep["kernels_per_step"] = rep["kernels"] / steps
      rep["matmul_flops_per_step"] = rep["matmul_flops"] / steps
      rep["bytes_per_step"] = rep["bytes"] / steps
      rep["kernel_bytes_per_step"] = rep["kernel_bytes"] / steps
      kernel_kv = live_kv / mesh.size if rep["mosaic_kernels"] else 0.0
      rep["bytes_per_step_over_min"] = (rep["bytes_per_step"] + kernel_kv) / max(
          rep["min_bytes_per_step"], 1)
      rep["model_flops_per_step"] = 2.0 * flops.matmul_params(model_cfg) * cfg.num_slots / (
          mesh.size)
    out[name] = rep
  return out


def learner_report(model_cfg: ModelConfig, cfg: LearnerConfig, mesh: Mesh, seq_len: int, *,
                   objective_cfg: objectives.ObjectiveConfig | None = None,
                   sampling_cfg: SamplingConfig | None = None,
                   hlo_path: str | None = None) -> dict[str, Any]:
  """Compiles the learner's micro-batch program (`learner.lower_accumulate`: forward, loss,
  backward, gradient accumulation into the sharded state) on `mesh` and reports it.

  Returns:
    `program_report` fields, model_flops (6 x matmul params x tokens + attention, per device:
    `flops.model_flops_per_token`), and the collective findings of
    `hlo_collectives.collective_findings` (weight all-gathers / gradient reduce-scatters over
    fsdp, activation collectives).
  """
  # Not under `lowering_context`: optax builds a few concrete scalars on the default device
  # while deriving the optimizer state's shardings, and nothing can live on a topology device.
  compiled = lower_accumulate(model_cfg, cfg, objective_cfg or objectives.ObjectiveConfig(),
                              sampling_cfg or SamplingConfig(), mesh, seq_len).compile()
  rep = program_report(compiled, mesh, hlo_path=hlo_path)
  tokens = cfg.micro_batch_rows * seq_len
  rep["model_flops"] = float(flops.model_flops_per_token(model_cfg, seq_len) * tokens
                             / mesh.size)
  # > 1: recompute (remat), fp32 heads, padding; per device on both sides.
  rep["compiled_over_model_flops"] = rep["matmul_flops"] / max(rep["model_flops"], 1.0)
  shapes = [x.shape for x in jax.tree.leaves(as_model(model_cfg).abstract_params())]
  rep.update(hlo_collectives.collective_findings(compiled.as_text(), shapes, mesh))
  return rep
