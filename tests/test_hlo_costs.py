"""hlo_costs: matmul FLOPs and kernel counts with loop trip counts, against closed-form counts
of small programs (2 m n k per matmul, times the loop's trips)."""

import jax
import jax.numpy as jnp

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
