"""KV writes are in place, checked on the compiled programs (not by belief): the pool is aliased
input -> output, no copy of a pool-shaped buffer appears, and temporary memory does not grow
with the pool, for every cache dtype (issue #28: a bf16 pool was converted to f32 and back
around every write on CPU)."""

import dataclasses
import functools
import re

import pytest

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import model
from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import as_model
from rlax_pipe.sampler import device_loop, page_pool
from rlax_pipe.sampler.config import CACHE_DTYPES

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=48, max_seq_len=256)
B, S, W = 4, 8, 8


def _compiled(num_pages, program, dtype="float32"):
  params = model.abstract_params(MODEL)
  mesh = page_pool.default_mesh()
  layout = page_pool.PoolLayout(MODEL.n_layers, MODEL.n_kv_heads, num_pages, S, MODEL.head_dim,
                                dtype, bits=page_pool.needs_bits(dtype, "cpu"))
  pools = tuple(jax.ShapeDtypeStruct(s, layout.storage_dtype) for s in layout.shapes)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  static = dict(model=as_model(MODEL), layout=layout, impl="reference", chunk_pages=2, mesh=None,
                interpret=False, sharding=layout.sharding(mesh))
  if program == "decode":
    state = jax.eval_shape(lambda: device_loop.SlotState.zeros(B, jax.random.key(0)))
    lowered = device_loop.decode_dispatch.lower(
        params, pools, i32(B, W), state, i32(device_loop.UPDATE_ROWS, B),
        jax.ShapeDtypeStruct((), jnp.int32), sampling=SamplingConfig(), stop_ids=(3,), steps=4,
        replicated=page_pool.replicated(mesh), **static)
  else:
    lowered = device_loop.prefill_step.lower(params, pools, i32(2, W), i32(2, 32), i32(2),
                                             i32(2), **static)
  return lowered.compile(), layout


def _pool_copies(hlo: str, layout) -> list[str]:
  shape = ",".join(map(str, layout.shapes[0]))
  return [line for line in hlo.splitlines()
          if re.search(r"\bcopy\(", line) and f"[{shape}]" in line.split("=")[1][:60]]


# Every cache dtype's decode; prefill (same write path) for the two dtypes accelerators use.
@pytest.mark.parametrize("dtype,programs", [(d, ("decode", "prefill") if d != "float16" else
                                             ("decode",)) for d in CACHE_DTYPES])
def test_decode_and_prefill_write_the_pool_in_place(dtype, programs):
  for program in programs:
    (small, small_layout), (big, big_layout) = (_compiled(256, program, dtype),
                                                _compiled(4096, program, dtype))
    for compiled, layout in ((small, small_layout), (big, big_layout)):
      mem = compiled.memory_analysis()
      assert mem.alias_size_in_bytes >= layout.nbytes, (program, mem)  # pools donated + aliased
      assert not _pool_copies(compiled.as_text(), layout), program
    # 16x the pool, same temporaries: a step never stages a copy of the pool.
    assert small.memory_analysis().temp_size_in_bytes == big.memory_analysis().temp_size_in_bytes
    assert big.memory_analysis().temp_size_in_bytes < 0.05 * big_layout.nbytes, program


def test_bf16_pool_is_stored_as_bits_only_on_cpu():
  assert page_pool.needs_bits("bfloat16", "cpu")
  assert not any(page_pool.needs_bits("bfloat16", p) for p in ("gpu", "tpu"))
  assert not any(page_pool.needs_bits(d, "cpu") for d in ("float32", "float16"))


@pytest.mark.parametrize("combined", (False, True))
def test_bits_storage_reads_and_writes_the_same_values(combined):
  """A pool stored as bits holds bit-identical bf16 values to a bf16 pool (independent check:
  the plain bf16 scatter/gather)."""
  plain = page_pool.PoolLayout(2, 2, 8, 4, 8, "bfloat16", combined=combined)
  bits = dataclasses.replace(plain, bits=True)
  rng = np.random.default_rng(0)
  k, v = (jnp.asarray(rng.normal(size=(3, 2, 2, 8)), jnp.float32) for _ in range(2))
  pages = jnp.asarray([[1, 1], [5, 6], [7, 7]], jnp.int32)
  offsets = jnp.asarray([[0, 1], [3, 0], [2, 3]], jnp.int32)
  valid = jnp.asarray([[True, True], [True, False], [False, True]])
  @functools.partial(jax.jit, static_argnums=0)
  def run(layout):
    pools = tuple(jnp.zeros(s, layout.storage_dtype) for s in layout.shapes)
    pools = layout.write(pools, 1, k, v, pages, offsets, valid)
    pools = layout.copy_pages(pools, jnp.asarray([5]), jnp.asarray([2]))
    return pools, layout.read_chunk(pools, 1, jnp.asarray([[1, 2, 6, 7]] * 3))

  outs = []
  for layout in (plain, bits):
    pools, read = run(layout)
    assert all(p.dtype == layout.storage_dtype for p in pools)
    outs.append(read)
  for a, b in zip(*outs):
    assert a.dtype == b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert np.any(np.asarray(outs[1][0], np.float32) != 0)
