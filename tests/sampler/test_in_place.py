"""KV writes are in place, checked on the compiled programs (not by belief): the pool is aliased
input -> output, no copy of a pool-shaped buffer appears, and temporary memory does not grow
with the pool."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import model
from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import as_model
from rlax_pipe.sampler import device_loop, page_pool

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=48, max_seq_len=256)
B, S, W = 4, 8, 8


def _compiled(num_pages, program):
  params = model.abstract_params(MODEL)
  layout = page_pool.PoolLayout(MODEL.n_layers, MODEL.n_kv_heads, num_pages, S, MODEL.head_dim)
  mesh = page_pool.default_mesh()
  pools = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in layout.shapes)
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


def test_decode_and_prefill_write_the_pool_in_place():
  for program in ("decode", "prefill"):
    (small, small_layout), (big, big_layout) = _compiled(256, program), _compiled(4096, program)
    for compiled, layout in ((small, small_layout), (big, big_layout)):
      mem = compiled.memory_analysis()
      assert mem.alias_size_in_bytes >= layout.nbytes, (program, mem)  # pools donated + aliased
      assert not _pool_copies(compiled.as_text(), layout), program
    # 16x the pool, same temporaries: a step never stages a copy of the pool.
    assert small.memory_analysis().temp_size_in_bytes == big.memory_analysis().temp_size_in_bytes
    assert big.memory_analysis().temp_size_in_bytes < 0.05 * big_layout.nbytes, program
