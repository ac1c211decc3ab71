"""JAX's Pallas paged-attention kernels vs the jnp reference: in interpret mode on CPU where JAX
supports it, natively when the test runs on the accelerator (markers `gpu`, `tpu`), and under
shard_map over a multi-device "tp" mesh."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe.sampler import kernels
from rlax_pipe.sampler import paged_attention as pa
from rlax_pipe.sampler.page_pool import PoolLayout

K, G, D, S, P, W, L = 2, 2, 16, 4, 40, 8, 2  # kv heads, group, dim, page, pool, width, layers
H = K * G
PLATFORM = jax.devices()[0].platform


def _case(seed, lengths, layout, t=1):
  """Random pools (layers folded into pages), random non-contiguous tables, queries at the last
  t positions of each row (t > 1: a prefill chunk)."""
  rng = np.random.default_rng(seed)
  pools = tuple(jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in layout.shapes)
  perm, used = rng.permutation(layout.num_pages), 0
  tables = np.zeros((len(lengths), W), np.int32)
  for b, n in enumerate(lengths):
    k = -(-n // layout.page_size)
    tables[b, :k] = perm[used:used + k]
    used += k
  n_valid = np.minimum(lengths, t)
  offsets = np.arange(t)[None, :]
  positions = (lengths - n_valid)[:, None] + offsets
  valid = offsets < n_valid[:, None]
  heads = layout.num_kv_heads * G
  q = jnp.asarray(rng.normal(size=(len(lengths), t, heads, layout.head_dim)).astype(np.float32))
  return q, pools, jnp.asarray(tables), jnp.asarray(positions, jnp.int32), jnp.asarray(valid)


def _reference(q, pools, layout, tables, positions, valid, layer=1):
  return jax.jit(functools.partial(pa.paged_attention_reference, layout=layout, chunk_pages=2),
                 )(q, pools, layer=jnp.int32(layer), block_tables_BW=tables,
                   positions_BT=positions, valid_BT=valid)


def _kernel(impl, q, pools, layout, tables, positions, valid, mesh=None, interpret=True,
            ragged_kernel=None):
  return kernels.attend(impl, q, pools, layout, jnp.int32(1), tables, positions, valid, mesh=mesh,
                        interpret=interpret, ragged_kernel=ragged_kernel)


def test_pallas_gpu_decode_matches_reference_in_interpret_mode():
  layout = PoolLayout(L, K, P, S, D)
  case = _case(0, np.array([1, 6, 17, 32]), layout)
  np.testing.assert_allclose(_kernel("pallas_gpu", *case[:2], layout, *case[2:]),
                             _reference(case[0], case[1], layout, *case[2:]), atol=2e-5, rtol=1e-5)


def test_pallas_tpu_decode_matches_reference_in_interpret_mode():
  """The TPU kernel computes in bfloat16: compare with a reference on bf16-rounded inputs."""
  layout = PoolLayout(L, K, P, S, D)
  q, pools, *rest = _case(1, np.array([3, 12, 32]), layout)
  scale = 1.0 / np.sqrt(D)  # the wrapper pre-scales q in fp32, then the kernel rounds it
  q16 = (q * scale).astype(jnp.bfloat16).astype(jnp.float32) / scale
  pools16 = tuple(p.astype(jnp.bfloat16).astype(jnp.float32) for p in pools)
  got = _kernel("pallas_tpu", q, pools, layout, *rest)
  np.testing.assert_allclose(got, _reference(q16, pools16, layout, *rest), atol=2e-2, rtol=2e-2)


def test_ragged_wrapper_packs_queries_like_jax_reference_kernel(t=5):
  """Token packing, kv lengths and the K/V-combined layout of the ragged TPU path, with JAX's
  own pure-jnp `ref_ragged_paged_attention` in place of the kernel (the Pallas TPU interpreter
  of jax 0.10.2 fails on this kernel; the real kernel is `test_ragged_kernel_on_tpu`). Rows
  hold 1 (decode-like) and 5 (prefill) valid queries."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
  layout = PoolLayout(L, K, P, S, D, combined=True)
  case = _case(2 + t, np.array([1, 6, 17, 32]), layout, t=t)
  got = _kernel("pallas_tpu_ragged", *case[:2], layout, *case[2:],
                ragged_kernel=rpa.ref_ragged_paged_attention)
  valid = np.asarray(case[-1])
  np.testing.assert_allclose(np.asarray(got)[valid],
                             np.asarray(_reference(case[0], case[1], layout, *case[2:]))[valid],
                             atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_kernel_runs_under_shard_map_over_tp():
  """Pool split by kv head over a 2-device "tp" mesh, queries by head: same result."""
  layout = PoolLayout(L, K, P, S, D)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("tp",),
                           axis_types=(jax.sharding.AxisType.Auto,))
  q, pools, *rest = _case(3, np.array([2, 9, 30]), layout)
  pools = tuple(jax.device_put(p, layout.sharding(mesh)) for p in pools)
  assert layout.sharding(mesh).spec[0] == "tp"
  fn = jax.jit(lambda q, pools, *rest: _kernel("pallas_gpu", q, pools, layout, *rest, mesh=mesh))
  np.testing.assert_allclose(fn(q, pools, *rest), _reference(q, pools, layout, *rest),
                             atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(PLATFORM != "gpu", reason="needs a GPU (run by bench_sampler --suite=kernels)")
def test_gpu_kernel_natively():
  layout = PoolLayout(L, K, P, 16, 64)
  case = _case(4, np.array([1, 60, 128]), layout)
  # Triton's dots take fp32 operands in TF32 (10-bit mantissa): ~1e-3 relative per score.
  np.testing.assert_allclose(_kernel("pallas_gpu", *case[:2], layout, *case[2:], interpret=False),
                             _reference(case[0], case[1], layout, *case[2:]), atol=1e-2, rtol=1e-2)


@pytest.mark.tpu
@pytest.mark.skipif(PLATFORM != "tpu", reason="needs a TPU")
@pytest.mark.parametrize("t", [1, 8])
def test_ragged_kernel_on_tpu(t):
  layout = PoolLayout(L, 8, P, 16, 128, combined=True)
  case = _case(5, np.array([1, 60, 128]), layout, t=t)
  valid = np.asarray(case[-1])
  got = np.asarray(_kernel("pallas_tpu_ragged", *case[:2], layout, *case[2:], interpret=False))
  want = np.asarray(_reference(case[0], case[1], layout, *case[2:]))
  np.testing.assert_allclose(got[valid], want[valid], atol=3e-2, rtol=3e-2)


def test_decode_only_kernels_refuse_prefill_rows():
  layout = PoolLayout(L, K, P, S, D)
  case = _case(6, np.array([5, 9]), layout, t=3)
  with pytest.raises(ValueError, match="decode-only"):
    _kernel("pallas_gpu", *case[:2], layout, *case[2:])
  with pytest.raises(ValueError, match="unknown kernel"):
    _kernel("flash", *case[:2], layout, *case[2:])


def test_engine_with_a_kernel_zeroes_fresh_pages_so_stale_nan_cannot_leak():
  """JAX's kernels multiply masked probabilities by values, so a NaN left in a granted page
  would reach the output; the engine zeroes every page it grants when a kernel is in use.
  With every page poisoned by NaN, the kernel engine matches the reference engine."""
  # pylint: disable=import-outside-toplevel
  import dataclasses
  from rlax_pipe import model
  from rlax_pipe.config import ModelConfig
  from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine
  model_cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                          head_dim=16, d_ff=48, max_seq_len=40)
  params = model.init_params(model_cfg, jax.random.key(0))
  cfg = SamplerConfig(num_slots=2, page_size=4, num_pages=24, max_seq_len=40, max_new_tokens=8,
                      min_prefill_bucket=8, prefill_rows=2, attention_impl="pallas_gpu",
                      decode_steps_per_dispatch=4)
  out = {}
  for impl in ("pallas_gpu", "reference"):
    engine = SamplerEngine(model_cfg, dataclasses.replace(cfg, attention_impl=impl), params,
                           interpret_kernels=True)
    r = engine.replicas[0]
    r.pools = tuple(jnp.full(p.shape, jnp.nan, p.dtype) for p in r.pools)
    for i in range(3):
      engine.submit(Request(prompt_tokens=np.arange(1, 4 + i, dtype=np.int32), sample_id=i))
    out[impl] = engine.run_to_completion()
  for a, b in zip(out["pallas_gpu"], out["reference"]):
    np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
    np.testing.assert_allclose(a.behavior_logprobs, b.behavior_logprobs, atol=1e-5, rtol=0)
