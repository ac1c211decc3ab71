"""FSDP + data + tensor parallelism, checked in the compiled program (8 virtual CPU devices).

The learner's micro-batch program is compiled for `fsdp=4, tp=2` and `data=2, fsdp=4` meshes,
and its optimized HLO is read (`rlax_pipe.hlo_collectives`): per-device activations hold 1 / (data x fsdp) of
the micro-batch rows, no activation collective runs over fsdp, weights are all-gathered over
fsdp inside the layer loop and gradients are reduce-scattered over fsdp. On CPU XLA spells a
reduce-scatter as an all-reduce whose result each device slices to its shard (its GPU and TPU
pipelines fuse the pair into one reduce-scatter op; the CPU pipeline has no such pass), so a
gradient reduction counts when it is a reduce-scatter op or an all-reduce whose every use is
such a slice (`Collective.sliced`).

Dimensions are chosen distinct so shapes tell arrays apart: rows R = 56, length L = 40,
logits chunk C = 10; no weight has a dimension of 40 or 10.
"""

import math
import re

import jax
import pytest

from rlax_pipe import hlo_collectives
from rlax_pipe import learner as learner_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner.learner import lower_accumulate
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import transformer
from rlax_pipe.objectives import ObjectiveConfig

MODEL = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    d_ff=160)
R, L, C = 56, 40, 10
TINY_ELEMENTS = 64  # scalar statistics, counts and the lag histogram


def array_shapes(hlo_text: str) -> list[tuple[int, ...]]:
  """Shapes of every array-valued instruction result in the HLO text (per device)."""
  shapes = []
  for line in hlo_text.splitlines():
    m = re.match(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(\(.*?\)|\S+)\s", line)
    if m:
      shapes.extend(tuple(int(d) for d in dims.split(",") if d)
                    for _, dims in re.findall(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]", m.group(1)))
  return shapes


@pytest.mark.parametrize("mesh_axes", [(("fsdp", 4), ("tp", 2)), (("data", 2), ("fsdp", 4))],
                         ids=["fsdp4_tp2", "data2_fsdp4"])
def test_compiled_step_is_fsdp_with_data_parallel_activations(mesh_axes):
  cfg = learner_lib.LearnerConfig(mesh_axes=mesh_axes, micro_batch_rows=R, logits_chunk_len=C,
                                  compiler_options=(("xla_backend_optimization_level", 0),))
  mesh = learner_lib.learner_mesh(jax.devices(), cfg)
  hlo = lower_accumulate(MODEL, cfg, ObjectiveConfig(), SamplingConfig(), mesh, L).compile()
  hlo = hlo.as_text()
  sizes = dict(mesh_axes)
  batch_split = sizes.get("data", 1) * sizes["fsdp"]
  rows_local = R // batch_split

  # 1. Activations: every array with a length (L) or chunk (C) dimension holds R / (data x
  # fsdp) rows, never the rows of a larger slice of the batch.
  larger = {R // d for d in (1, sizes.get("data", 1), sizes["fsdp"], sizes.get("tp", 1))} - {
      rows_local}
  activations = [s for s in array_shapes(hlo)
                 if (L in s or C in s) and set(s) - {1, L, C}]
  assert len(activations) > 100
  bad = [s for s in activations if rows_local not in s or larger & set(s)]
  assert not bad, f"activations not split {batch_split}-way over the batch: {bad[:5]}"

  # 2. Collectives over fsdp carry weights (or a few scalars), never activations.
  weights = hlo_collectives.weight_shapes(
      [s.shape for s in jax.tree.leaves(transformer.abstract_params(MODEL))],
      [sizes.get("tp", 1), sizes["fsdp"], sizes["fsdp"] * sizes.get("tp", 1)])
  found = hlo_collectives.collectives(hlo, mesh)
  over_fsdp = [c for c in found if "fsdp" in c.axes]
  for c in over_fsdp:
    for shape in c.shapes:
      assert shape in weights or math.prod(shape) <= TINY_ELEMENTS, (
          f"{c.op} over {c.axes} of a non-weight array {shape} ({c.name})")
  for c in found:  # and no collective anywhere moves an activation over fsdp
    if any(L in s or C in s for s in c.shapes):
      assert "fsdp" not in c.axes, c

  # 3. Weights are all-gathered over fsdp one layer at a time, inside the layer loop ...
  gathers = [c for c in over_fsdp if c.op == "all-gather"]
  layer_gathers = [c for c in gathers if c.in_loop and not c.backward]
  assert len(layer_gathers) >= 7  # wq, wk, wv, wo, w_gate, w_up, w_down of one layer
  assert all(s[0] == 1 for c in layer_gathers for s in c.shapes)  # one layer's slice
  # ... and gradients are reduce-scattered over fsdp, per layer inside the backward loop.
  def scattered(c):
    return [s for s, sliced in zip(c.shapes, c.sliced)
            if s in weights and (c.op == "reduce-scatter" or sliced)]
  grads = [c for c in over_fsdp if c.backward and scattered(c)]
  assert any(c.in_loop for c in grads), "no per-layer gradient reduce-scatter"
  grad_elements = sum(len(scattered(c)) for c in grads)
  assert grad_elements >= len(jax.tree.leaves(transformer.abstract_params(MODEL)))
  # Weight-shaped all-reduces over fsdp whose results are used whole would be data-parallel
  # gradient all-reduces, not FSDP.
  unsliced = [(c.name, s) for c in over_fsdp if c.op == "all-reduce"
              for s, sliced in zip(c.shapes, c.sliced) if s in weights and not sliced
              and math.prod(s) > TINY_ELEMENTS]
  assert not unsliced, unsliced
  if "tp" in sizes:  # Megatron: activation all-reduces over tp only
    assert any(c.op == "all-reduce" and c.axes == ("tp",) and any(L in s for s in c.shapes)
               for c in found)
  if "data" in sizes:  # data parallelism: the fsdp gradient shards are summed over data
    assert any(c.axes == ("data",) and c.backward for c in found)
