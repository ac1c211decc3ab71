"""hlo_costs: matmul FLOPs, kernel counts and bytes with loop trip counts, against closed-form
counts of small programs (2 m n k per matmul, times the loop's trips), XLA's own cost analysis
of the same loop unrolled, and the TPU compiler's count of a batched matmul."""

import jax
import jax.numpy as jnp
import pytest

from rlax_pipe import hlo_costs


def _hlo(fn, *shapes):
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  return jax.jit(fn).lower(*args).compile().as_text()


def test_matmul_flops_follow_the_loop_trip_count():
  m, k = 8, 16
  n = k

  def looped(trips):
    def fn(x, w):  # each trip depends on the last (nothing to hoist out of the loop)
      return jax.lax.fori_loop(0, trips, lambda i, acc: jnp.tanh(acc @ w), x)
    return fn

  for trips in (3, 7):
    got = hlo_costs.costs(_hlo(looped(trips), (m, k), (k, n)))
    assert got["matmul_flops"] == trips * 2 * m * k * n, got
    assert got["loops_known"] == 1 and got["loops_unknown"] == 0
  k3 = hlo_costs.costs(_hlo(looped(3), (m, k), (k, n)))["kernels"]
  k7 = hlo_costs.costs(_hlo(looped(7), (m, k), (k, n)))["kernels"]
  assert k7 > k3 > 0  # the body's kernels are counted once per trip


def test_a_data_dependent_loop_counts_its_body_once():
  def fn(x, w):
    def cond(c):
      return jnp.sum(c[1]) < 100.0
    def body(c):
      return c[0] + 1, jnp.tanh(c[1] @ w) + x
    return jax.lax.while_loop(cond, body, (0, jnp.zeros((4, 4))))[1]

  got = hlo_costs.costs(_hlo(fn, (4, 4), (4, 4)))
  assert got["matmul_flops"] == 2 * 4 * 4 * 4 and got["loops_unknown"] == 1, got


def test_no_loop_no_multiplier():
  got = hlo_costs.costs(_hlo(lambda a, b: a @ b, (5, 6), (6, 7)))
  assert got["matmul_flops"] == 2 * 5 * 6 * 7 and got["kernels"] >= 1


def _cost_bytes(compiled):
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


def test_bytes_weight_the_loop_body_by_its_trip_count():
  """Independent reference: XLA's own "bytes accessed" of the same loop UNROLLED (a
  straight-line program, where cost_analysis counts every trip). Per trip, the looped program's
  weighted bytes must equal the unrolled program's; cost_analysis of the looped program counts
  the body once (and `bytes_loop_bodies_once` reproduces that)."""
  args = [jax.ShapeDtypeStruct((64, 128), jnp.float32), jax.ShapeDtypeStruct((128, 128),
                                                                              jnp.float32)]

  def compiled(trips, unroll):
    fn = lambda x, w: jax.lax.fori_loop(0, trips, lambda i, a: jnp.tanh(a @ w), x,
                                        unroll=unroll)
    return jax.jit(fn).lower(*args).compile()

  got = {t: hlo_costs.costs(compiled(t, False).as_text()) for t in (3, 7)}
  ref = {t: _cost_bytes(compiled(t, True)) for t in (3, 7)}
  per_trip, ref_per_trip = (got[7]["bytes"] - got[3]["bytes"]) / 4, (ref[7] - ref[3]) / 4
  # The loop's counter add and compare (a few scalar bytes) are the only extra per trip.
  assert ref_per_trip <= per_trip < ref_per_trip + 64, (per_trip, ref_per_trip)
  once = _cost_bytes(compiled(3, False))
  assert abs(got[3]["bytes_loop_bodies_once"] - once) < 64, (got[3], once)
  # Unrolled (no loop): the same rules give XLA's count exactly.
  assert hlo_costs.costs(compiled(3, True).as_text())["bytes"] == ref[3]


def test_an_in_place_update_counts_the_update_not_the_buffer():
  """A loop writing one row per trip into a donated buffer: the bytes do not grow with the
  buffer (dynamic-update-slice writes the update in place), and slicing reads count the slice."""
  def fn(buf, x):
    def body(i, b):
      row = jax.lax.dynamic_slice_in_dim(b, i, 1) * 2.0 + x
      return jax.lax.dynamic_update_slice_in_dim(b, row, i + 1, 0)
    return jax.lax.fori_loop(0, 5, body, buf)

  def bytes_for(rows):
    args = [jax.ShapeDtypeStruct((rows, 128), jnp.float32),
            jax.ShapeDtypeStruct((1, 128), jnp.float32)]
    return hlo_costs.costs(jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text())

  small, big = bytes_for(64), bytes_for(4096)
  assert small["bytes"] == big["bytes"], (small, big)
  # 5 trips x (slice + x read, row written, row read back, written in place) + loop scalars:
  # far below one pass over even the small buffer.
  assert small["bytes"] < 5 * 5 * 128 * 4 + 512 < 64 * 128 * 4, small


def test_tpu_batched_matmul_flops_count_real_window_taps():
  """The TPU compiler writes a batched matmul (attention scores) as a convolution with
  padded / dilated windows; counted FLOPs must equal the closed form 2 b h q k d and the TPU
  compiler's own cost_analysis flops (no loop here)."""
  pytest.importorskip("libtpu", reason="needs libtpu for a deviceless TPU compile")
  from rlax_pipe import aot  # pylint: disable=import-outside-toplevel
  dev = aot.topology_devices("v5e:2x2")[0]
  sh = jax.sharding.SingleDeviceSharding(dev)
  b, q, k, h, d = 4, 256, 256, 4, 128
  args = [jax.ShapeDtypeStruct((b, q, h, d), jnp.bfloat16, sharding=sh),
          jax.ShapeDtypeStruct((b, k, h, d), jnp.bfloat16, sharding=sh)]
  with jax.default_matmul_precision("default"):
    compiled = jax.jit(lambda x, y: jnp.einsum("bqhd,bkhd->bhqk", x, y)).lower(*args).compile()
  got = hlo_costs.costs(compiled.as_text())["matmul_flops"]
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  assert got == 2 * b * h * q * k * d == cost["flops"], (got, cost["flops"])


_NESTED = """HloModule nested
%fused_inner (p0: f32[28,64,64], p1: s32[]) -> f32[64,64] {
  %p0 = f32[28,64,64]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %ds = f32[1,64,64]{2,1,0} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,64,64}
  ROOT %b = f32[64,64]{1,0} bitcast(%ds)
}

%fused_outer (q0: f32[28,64,64], q1: s32[], q2: f32[8,64]) -> f32[8,64] {
  %q0 = f32[28,64,64]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %q2 = f32[8,64]{1,0} parameter(2)
  %w = f32[64,64]{1,0} fusion(%q0, %q1), kind=kLoop, calls=%fused_inner
  ROOT %d = f32[8,64]{1,0} dot(%q2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[28,64,64], i: s32[], x: f32[8,64]) -> f32[8,64] {
  %a = f32[28,64,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[8,64]{1,0} parameter(2)
  ROOT %f = f32[8,64]{1,0} fusion(%a, %i, %x), kind=kOutput, calls=%fused_outer
}
"""


def test_a_slice_inside_a_nested_fusion_reads_one_layer_of_a_stacked_weight():
  """A fused layer body hands the stacked [28, 64, 64] weight to an inner fusion that
  dynamic-slices one layer (what the TPU compiler emits for a scanned decoder): the kernel reads
  that layer (64 x 64 x 4 B), the index, x, and writes the output; not all 28 layers."""
  got = hlo_costs.costs(_NESTED)
  assert got["bytes"] == 64 * 64 * 4 + 4 + 8 * 64 * 4 + 8 * 64 * 4, got
  assert got["matmul_flops"] == 2 * 8 * 64 * 64 and got["kernels"] == 1, got
