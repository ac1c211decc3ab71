"""Exact, layout-independent checksums of parameter trees: which weights a copy really holds.

For leaf number s of a tree, with n elements in row-major order, element i's bit pattern b_i
(its dtype's bits read as an unsigned integer, widened to 32 bits; 8-byte dtypes as two 32-bit
words) and the odd multiplicative weight w_i = (i * 2654435761 + s * 40503) | 1 (Knuth's
multiplicative hash constant, TAOCP vol. 3, 6.4):

    c_s = sum_i b_i * w_i   (mod 2^32)

Integer addition modulo 2^32 is associative and commutative, so c_s does not depend on the mesh,
the sharding or the order of the reduction: the learner (learner mesh and layout) and a sampler
(its own mesh and layout) compute bit-identical values for identical arrays, and the check needs
no tolerance. The position weights make a permuted, shifted or stale copy change the value; a
random change of a leaf goes unnoticed with probability 2^-32.

Computed by one jitted program over the whole tree (one read of every parameter, about the cost
of one decode step's weight reads); the result is a uint32[num_leaves] array replicated on the
tree's mesh. `compare` names the leaves that differ.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

_GOLDEN = np.uint32(2654435761)
_SALT = np.uint32(40503)


class WeightMismatchError(RuntimeError):
  """Weights on the sampler differ from the learner's weights of the version they are tagged
  with (the message names the version, both sides and the differing leaves)."""


def _bits_u32(x: jax.Array) -> jax.Array:
  """The element bit patterns as uint32 (8-byte elements: two words along a new last axis)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return lax.bitcast_convert_type(x, jnp.uint32)
  if size == 8:
    return lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
  unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
  return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_checksum(x: jax.Array, salt: int) -> jax.Array:
  bits = _bits_u32(x)
  index = jnp.zeros(bits.shape, jnp.uint32)
  stride = np.uint32(1)
  for axis in reversed(range(bits.ndim)):
    index = index + lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * stride
    stride = np.uint32((int(stride) * bits.shape[axis]) % (1 << 32))
  weight = (index * _GOLDEN + np.uint32((salt * int(_SALT)) % (1 << 32))) | np.uint32(1)
  return jnp.sum(bits * weight, dtype=jnp.uint32)


@functools.partial(jax.jit)
def _checksums(leaves: list[jax.Array]) -> jax.Array:
  return jnp.stack([_leaf_checksum(x, s) for s, x in enumerate(leaves)])


def checksum(tree: Any) -> jax.Array:
  """Starts computing the checksums of every leaf of `tree` (asynchronous dispatch).

  Args:
    tree: a pytree of `jax.Array`s (any mesh, any sharding) or numpy arrays.

  Returns:
    uint32[num_leaves], in `jax.tree.leaves` order; `np.asarray` it when needed.
  """
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((0,), jnp.uint32)
  return _checksums(leaves)


def host(values: Any) -> np.ndarray:
  """Checksums as a host uint32 array (waits for a device computation)."""
  return np.asarray(jax.device_get(values), np.uint32)


def compare(expected: Any, got: Any, version: int, *, names: Sequence[str] | None = None,
            expected_from: str = "the learner", got_from: str = "the sampler") -> None:
  """Checks that two checksum vectors of version `version` are equal.

  Args:
    expected: checksums of the reference copy (device or host array).
    got: checksums of the copy under test.
    version: the policy version both copies claim to be.
    names: leaf names for the message (e.g. `jax.tree_util.keystr` paths).
    expected_from, got_from: who computed each side, for the message.

  Raises:
    WeightMismatchError: naming the version, both sides and up to 5 differing leaves.
  """
  e, g = host(expected), host(got)
  if e.shape == g.shape and np.array_equal(e, g):
    return
  if e.shape != g.shape:
    raise WeightMismatchError(
        f"weights of version {version}: {expected_from} has {e.size} leaves, {got_from} "
        f"{g.size}.")
  bad = np.flatnonzero(e != g)
  label = [names[i] if names is not None and i < len(names) else f"leaf {i}" for i in bad[:5]]
  raise WeightMismatchError(
      f"weights tagged version {version} on {got_from} are not {expected_from}'s version "
      f"{version}: {bad.size} of {e.size} leaf checksums differ ({', '.join(label)}"
      f"{', ...' if bad.size > 5 else ''}; e.g. {label[0]}: {expected_from} {int(e[bad[0]])}, "
      f"{got_from} {int(g[bad[0]])}).")
