"""The engine's weights: the running `WeightUpdate`, a pending one, per-replica views, and when a
donated version may be freed.

Ownership (`rlax_pipe.types.WeightUpdate`): the engine owns an update from `offer` on; a donated
version is deleted once a newer one replaced it AND no dispatch launched with it is still in
flight (replicas read back in turn, so a replica may still decode with the previous version for
one dispatch after the swap). A superseded pending update that never ran is freed at once.

Threading: `offer` may be called from any thread (it never waits for the device); `swap`,
`release_retired` and the views belong to the engine's thread.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Iterable

import jax
from jax.sharding import Mesh

from rlax_pipe import sharding as sharding_lib
from rlax_pipe.types import WeightUpdate


def release(update: WeightUpdate | None, keep: Any = None) -> None:
  """Deletes the arrays of a donated update that are not also in `keep`."""
  if update is None or not update.donated:
    return
  kept = {id(x) for x in jax.tree.leaves(keep)}
  for x in jax.tree.leaves(update.params):
    if isinstance(x, jax.Array) and id(x) not in kept and not x.is_deleted():
      x.delete()


def check_same_layout(old, new) -> None:
  """Raises ValueError (naming the leaf) if `new` differs from `old` in tree, shape, dtype or
  sharding (a different layout would recompile the decode dispatch) or is not a jax.Array.
  (Committedness and weak types, which would recompile too, are evened out by `canonical`.)"""
  old_leaves, old_def = jax.tree_util.tree_flatten_with_path(old)
  new_leaves, new_def = jax.tree_util.tree_flatten_with_path(new)
  if old_def != new_def:
    raise ValueError(f"update_weights: parameter tree differs from the current one:\n{new_def}\n"
                     f"vs\n{old_def}")
  for (path, a), (_, b) in zip(old_leaves, new_leaves):
    name = jax.tree_util.keystr(path)
    if not isinstance(b, jax.Array):
      raise ValueError(f"update_weights: {name} is a {type(b).__name__}, not a jax.Array; place "
                       "the weights on the sampler mesh first (weight channel).")
    if a.shape != b.shape or a.dtype != b.dtype or a.sharding != b.sharding:
      raise ValueError(f"update_weights: {name} is {b.shape} {b.dtype} {b.sharding}, the running "
                       f"weights are {a.shape} {a.dtype} {a.sharding}; a different layout would "
                       "recompile the decode step.")


def _canonical_leaf(x):
  if not isinstance(x, jax.Array):
    return x
  if x.weak_type:  # a copy (only weak scalars of an eager init have one)
    x = jax.lax.convert_element_type(x, x.dtype)
  return x if x.committed else jax.device_put(x, x.sharding)  # zero-copy


def canonical(update: WeightUpdate | None) -> WeightUpdate | None:
  """`update` with every array committed to its own sharding and strongly typed.

  jit compiles separately for an uncommitted and a committed argument of the same shape and
  sharding, and for a weak and a strong dtype; engines get committed, strong arrays from the
  weight channel and from `load_state_dict`, so initial weights made by `jnp` or an eager init
  (uncommitted) would leave the decode program `warmup` compiled unused after the first swap
  (#27 item 10). Arrays already canonical are kept as they are (same objects).
  """
  if update is None or all(not isinstance(x, jax.Array) or (x.committed and not x.weak_type)
                           for x in jax.tree.leaves(update.params)):
    return update
  return dataclasses.replace(update, params=jax.tree.map(_canonical_leaf, update.params))


class EngineWeights:
  """Running and pending versions of one engine, and their per-replica views.

  Args:
    initial: the initial weights (owned from now on).
    meshes: one mesh per data replica (views share the device buffers of the full-mesh arrays).
    head_mask: optional `head_mask(view, i) -> bool [V] or None` (a jitted program; i the
      replica), run once per installed version on each replica's view: `masks[i]` is what replica i's dispatches get
      beside `views[i]` (the ids whose output-head column is non-finite, #27 item 1).
  """

  def __init__(self, initial: WeightUpdate, meshes: list[Mesh],
               head_mask: Callable[[Any], Any] | None = None):
    initial = canonical(initial)
    check_same_layout(initial.params, initial.params)
    self.meshes = meshes
    self._head_mask = head_mask
    self.masks: list[Any] = []
    self.lock = threading.Lock()  # guards running / pending
    self.running = initial
    self.pending: WeightUpdate | None = None
    self.views = self._views(initial.params)
    self._retired: list[WeightUpdate] = []

  @property
  def version(self) -> int:
    """Version of the running weights."""
    return self.running.version

  @property
  def latest_version(self) -> int:
    """The pending update's version, else the running one's."""
    with self.lock:
      return (self.running if self.pending is None else self.pending).version

  def _views(self, params) -> list[Any]:
    """Per-replica views of `params`; also sets `masks` (one per view) for them."""
    if len(self.meshes) == 1:
      views = [params]
    else:
      views = [jax.tree.map(lambda x, m=m: sharding_lib.replica_view(x, m), params)
               for m in self.meshes]
    self.masks = [None if self._head_mask is None else self._head_mask(v, i)
                  for i, v in enumerate(views)]
    return views

  def update_weights(self, update: WeightUpdate) -> None:
    """Makes `update` the pending version (a superseded pending donated one is freed).

    Raises:
      ValueError: if its version is not newer than the running one or older than the pending
        one, or its layout differs from the running weights.
    """
    update = canonical(update)
    check_same_layout(self.running.params, update.params)
    with self.lock:
      pending = None if self.pending is None else self.pending.version
      if update.version <= self.running.version or (
          pending is not None and update.version < pending):
        raise ValueError(f"update_weights: version {update.version} is not newer than the "
                         f"running version {self.running.version} (pending: {pending}).")
      superseded, self.pending = self.pending, update
    release(superseded, keep=update.params)

  def swap(self) -> bool:
    """Runs the pending version from now on (engine thread); the old one is retired. Returns
    whether a swap happened."""
    with self.lock:
      pending, self.pending = self.pending, None
      if pending is None:
        return False
      old, self.running = self.running, pending
    self.views = self._views(pending.params)
    if old.donated:
      self._retired.append(old)
    return True

  def release_retired(self, in_flight_versions: Iterable[int]) -> None:
    """Frees retired donated versions that no dispatch in flight still uses."""
    busy = set(in_flight_versions)
    keep = [u for u in self._retired if u.version in busy]
    for u in self._retired:
      if u.version not in busy:
        release(u, keep=self.running.params)
    self._retired = keep

  def replace_all(self, running: WeightUpdate, pending: WeightUpdate | None) -> None:
    """Installs restored versions (load_state_dict); the previous ones are released."""
    running, pending = canonical(running), canonical(pending)
    with self.lock:
      old, old_pending = self.running, self.pending
      self.running, self.pending = running, pending
    self.views = self._views(running.params)
    for u in [old, old_pending] + self._retired:
      release(u)
    self._retired = []
