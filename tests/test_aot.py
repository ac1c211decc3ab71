"""Deviceless TPU compiles (issue #28): the tiny model's decode dispatch with each TPU attention
kernel and its sharded train step compile for a 4-chip TPU v5e topology, fit the chip's HBM, and
the FSDP learner all-gathers weights / reduce-scatters gradients over "fsdp". Needs libtpu (the
`test` extra installs it); the runtime stays on CPU."""

import dataclasses

import pytest

pytest.importorskip("libtpu", reason="deviceless TPU compiles need libtpu (pip install "
                    "'libtpu==0.0.42.*', in the project's test extra)")

import jax  # pylint: disable=wrong-import-position

from rlax_pipe import aot, sharding  # pylint: disable=wrong-import-position
from rlax_pipe.config import ModelConfig  # pylint: disable=wrong-import-position
from rlax_pipe.learner import flops  # pylint: disable=wrong-import-position
from rlax_pipe.learner.config import LearnerConfig  # pylint: disable=wrong-import-position
from rlax_pipe.model import as_model  # pylint: disable=wrong-import-position
from rlax_pipe.sampler import page_pool  # pylint: disable=wrong-import-position
from rlax_pipe.sampler.config import SamplerConfig  # pylint: disable=wrong-import-position

# head_dim 128 and page size 16: the TPU kernels' tiling (lanes of 128, bf16 sublanes).
MODEL = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=128, d_ff=256, max_seq_len=256, param_dtype="bfloat16",
                    compute_dtype="bfloat16")
SAMPLER = SamplerConfig(num_slots=8, page_size=16, num_pages=2048, max_seq_len=256,
                        max_new_tokens=64, cache_dtype="bfloat16")


@pytest.fixture(autouse=True)
def _default_precision():
  """conftest sets matmul precision "highest" for CPU numerics; JAX's TPU paged-attention kernel
  then asks Mosaic for an fp32-precision bf16 matmul and fails ("Bad rhs type"). Compile with
  the precision a TPU run uses."""
  with jax.default_matmul_precision("default"):
    yield


@pytest.fixture(scope="module")
def devices():
  devs = aot.topology_devices("v5e:2x2")
  assert len(devs) == 4 and devs[0].platform == "tpu" and "v5" in devs[0].device_kind.lower()
  return devs


def test_runtime_stays_on_cpu_with_libtpu_installed():
  assert jax.devices()[0].platform == "cpu"


@pytest.mark.parametrize("impl", aot.SAMPLER_IMPLS)
def test_decode_dispatch_compiles_for_tpu_with_each_kernel_and_keeps_the_pool_in_place(
    devices, impl):
  """One chip, 2 kv heads per device and a 64 MiB pool (not staged in VMEM): before issue #28's
  fix the TPU program copied both pools to another layout in every layer (7 pool copies, temp
  ~ the pool); now no pool-shaped copy and temporaries far below the pool."""
  mesh = sharding.make_mesh(devices[:1], {"tp": 1})
  compiled = aot.lower_sampler(MODEL, SAMPLER, mesh, impl, steps=2)["decode"].compile()
  rep = aot.program_report(compiled, mesh)
  assert rep["memory"]["fits"] and 0 < rep["memory"]["need_bytes"] < 16e9
  # The kernels are Mosaic custom calls in the TPU program; the reference has none.
  assert (rep["mosaic_kernels"] > 0) == (impl != "reference"), rep
  layout = page_pool.PoolLayout.of(as_model(MODEL), SAMPLER, combined=impl.endswith("ragged"),
                                   platform="tpu")
  assert aot.pool_copies(compiled.as_text(), layout.shapes) == 0
  assert rep["memory"]["temp_bytes"] < 0.05 * layout.nbytes, (rep["memory"], layout.nbytes)
  # Trip-count-weighted (hlo_costs), 2 decode steps: exactly the model's matmul FLOPs with a
  # kernel (attention is inside Mosaic); bytes per step against the minimum (weights + the KV
  # of full slots): XLA's side of a kernel impl reads less than that minimum (the KV is the
  # kernel's), the reference (gathers pages, copies them to another layout) reads < 6x it.
  # One pool-shaped copy per layer would move 67 MB.
  weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(
      as_model(MODEL).abstract_params()))
  minimum = weights + SAMPLER.num_slots * SAMPLER.max_seq_len * layout.bytes_per_token
  per_step = rep["bytes"] / 2
  if impl != "reference":
    assert rep["matmul_flops"] == 2 * 2 * flops.matmul_params(MODEL) * SAMPLER.num_slots, rep
    assert 0 < per_step < minimum, (per_step, minimum)
  else:
    assert minimum < per_step < 6 * minimum, (per_step, minimum)


def test_fsdp_train_step_compiles_for_tpu_and_shards_weights_and_grads(devices):
  mesh = sharding.make_mesh(devices, {"fsdp": 4})
  cfg = LearnerConfig(mesh_axes=(("fsdp", 4), ("tp", 1)), micro_batch_rows=4,
                      logits_chunk_len=32, attention_block_len=32)
  rep = aot.learner_report(MODEL, cfg, mesh, seq_len=64)
  assert rep["memory"]["fits"], rep["memory"]
  assert rep["weight_all_gathers_over_fsdp"] > 0, rep
  assert rep["gradient_reduce_scatters_over_fsdp"] > 0, rep
  assert rep["model_flops"] > 0 and rep["cost_flops_loop_bodies_once"] > 0
  # Matmul FLOPs from the TPU HLO with trip counts and real convolution taps (no remat here):
  # about the model's; the old convolution-window count read several times more.
  assert 1.0 <= rep["compiled_over_model_flops"] < 1.3, rep["compiled_over_model_flops"]


def test_auto_avoids_the_tpu_kernels_where_they_cannot_lower(devices):
  """head_dim 64 (Llama-3.2-1B): the paged kernel does not lower for TPU, so `auto` picks the
  reference there, which compiles; head_dim 128 keeps pallas_tpu."""
  from rlax_pipe.sampler.paged_cache import resolve_impl  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(devices[:1], {"tp": 1})
  assert resolve_impl("auto", mesh, 128) == "pallas_tpu"
  assert resolve_impl("auto", mesh, 64) == "reference"
  narrow = dataclasses.replace(MODEL, head_dim=64)
  small = dataclasses.replace(SAMPLER, num_pages=64)
  with pytest.raises(ValueError, match="divisible by 8 and 128"):
    aot.lower_sampler(narrow, small, mesh, "pallas_tpu", steps=1)["decode"].compile()
  aot.lower_sampler(narrow, small, mesh, resolve_impl("auto", mesh, 64), steps=1)[
      "decode"].compile()


def test_flash_train_step_compiles_for_tpu_with_the_mosaic_kernels_per_device(devices):
  """attention_impl='flash' resolves to JAX's TPU flash kernel on a TPU mesh; run per device
  (shard_map), it adds no activation collective over fsdp (the kernel is not given whole
  arrays), and its forward / backward kernels are in the program."""
  mesh = sharding.make_mesh(devices[:2], {"fsdp": 2})
  cfg = LearnerConfig(mesh_axes=(("fsdp", 2), ("tp", 1)), micro_batch_rows=2,
                      logits_chunk_len=64, attention_block_len=128, attention_impl="flash")
  rep = aot.learner_report(MODEL, cfg, mesh, seq_len=128)
  assert rep["memory"]["fits"], rep["memory"]
  assert rep["mosaic_kernels"] >= 3, rep  # forward, dq and dkv kernels
  assert rep["activation_collectives_over_fsdp_in_loops"] == 0, rep


def test_weight_push_reshard_compiles_for_tpu_from_fsdp_to_tp(devices):
  """The weight channel's own plan (`WeightChannel.lower_transfer`) from an FSDP:2 learner on
  two chips to a tp:2 sampler on the other two: the learner-side hop compiles, moves shards
  with collectives over fsdp, and the cross-mesh copy writes every sampler shard once."""
  from rlax_pipe.learner import sharding as learner_sharding  # pylint: disable=import-outside-toplevel
  from rlax_pipe.pipeline.weight_channel import WeightChannel  # pylint: disable=import-outside-toplevel
  l_mesh = sharding.make_mesh(devices[:2], {"fsdp": 2})
  s_mesh = sharding.make_mesh(devices[2:], {"tp": 2})
  model = as_model(MODEL)
  abstract = model.abstract_params()
  learner_params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract, learner_sharding.param_shardings(model, l_mesh))
  out = WeightChannel(aot.sampler_params(MODEL, s_mesh)).lower_transfer(learner_params)
  assert out["sampler_hop"] is None and out["leaves_resharded"] > 0
  rep = aot.program_report(out["learner_hop"].compile(), l_mesh)
  assert rep["memory"]["fits"]
  assert any(k.endswith("@fsdp") for k in rep["collectives"]), rep["collectives"]
  total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
  # every byte lands once; only the replicated (norm) leaves land on both tp devices
  assert total <= out["device_put_bytes"] < 1.01 * total
  assert out["device_put_bytes_max_per_device"] < 0.51 * total
