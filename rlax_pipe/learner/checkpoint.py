"""Orbax checkpoints of the train state plus a JSON "extra" dict, with fallback on bad steps.

Layout (orbax v0 `CheckpointManager`, one directory per step):

  <dir>/<step>/state/...            the TrainState pytree (params, optimizer state, version, rng,
                                    counters), OCDBT, written from whatever mesh holds it
  <dir>/<step>/extra/metadata       the JSON extra dict (pipeline queue, task iterator, ...)
  <dir>/<step>/commit_success.txt   orbax's commit marker, written last, before the atomic rename

Saves are asynchronous: `save` returns after the device-to-host copy, the files are written in a
background thread. Restores read onto the shardings of the abstract target given, so a state
saved on one mesh (e.g. 2 x 2 fsdp x tp on devices 0-3) restores onto another (e.g. 4-way tp
on devices 4-7).

What can go wrong with a restore is told apart (issue #14 item 11), each its own error class:
  * `CheckpointNotFoundError`: no checkpoint in the directory, or the step asked for is not there
    (the message lists the steps that are);
  * `CheckpointCorruptError`: a step is incomplete (no commit marker: the save did not finish) or
    its files cannot be read;
  * `CheckpointMismatchError`: the step is readable but holds another tree than the target (a
    leaf missing, extra, or of another shape or dtype: another model or optimizer); raised at
    once, never a reason to fall back (an older step of the same run would not fit either);
  * `CheckpointTargetError` (issue #27 item 4): no restore target was given (None, an empty
    tree) or a leaf of it is not an array description (`jax.ShapeDtypeStruct`); raised at once;
  * `CheckpointTopologyError` (issue #27 item 4): target leaves without a sharding whose saved
    sharding names devices this job does not have (the device count or topology changed: orbax
    would put such a leaf back on the saved devices); raised at once, never a fallback.
Restoring the newest checkpoint falls back to older ones only past corrupt steps, loudly: an
absl error line per skipped step, and `Restored.skipped` / `Restored.skip_reasons` for the
caller's metrics. Bad step directories are left in place (the next `save` of the same step
replaces one).

Multi-process jobs: pass `active_processes` (the processes whose devices hold the state, e.g.
the learner's processes); only they call the checkpointer, with orbax barriers among them.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple, Sequence

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

COMMIT_MARKER = "commit_success.txt"


class CheckpointError(RuntimeError):
  """A checkpoint could not be restored (base class of the specific errors below)."""


class CheckpointNotFoundError(CheckpointError):
  """No checkpoint in the directory, or the requested step does not exist."""


class CheckpointCorruptError(CheckpointError):
  """A step is incomplete (the save did not finish) or its files cannot be read."""


class CheckpointMismatchError(CheckpointError):
  """A readable step holds another tree (leaves, shapes, dtypes) than the restore target."""


class CheckpointTargetError(CheckpointError):
  """The restore target is missing (None, an empty tree) or not a tree of array descriptions."""


class CheckpointTopologyError(CheckpointError):
  """Target leaves without a sharding cannot go back onto the saved devices (another topology)."""


class Restored(NamedTuple):
  """What `Checkpointer.restore` returns.

  Attributes:
    step: the checkpoint step that was restored.
    state: the restored pytree, on the shardings of the abstract target.
    extra: the JSON dict saved with it.
    skipped: steps newer than `step` that were found incomplete or unreadable.
    skip_reasons: one message per skipped step, same order.
  """

  step: int
  state: Any
  extra: dict
  skipped: tuple[int, ...]
  skip_reasons: tuple[str, ...] = ()


class Checkpointer:
  """Thin shell over an orbax `CheckpointManager`: keep-last-N, async save, robust restore.

  Example:
    >>> ckpt = Checkpointer("/tmp/run/ckpt", keep=3)
    >>> ckpt.save(10, state, {"queue": [...]})
    >>> restored = ckpt.restore(sharded_abstract_state)   # newest usable step
  """

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
               active_processes: Sequence[int] | None = None):
    """Opens (and creates) a checkpoint directory.

    Args:
      directory: checkpoint root (absolute or relative path; shared by every active process).
      keep: keep the newest `keep` (>= 1) steps; older ones are deleted after each save.
      async_save: write files in a background thread after the device-to-host copy.
      active_processes: in a multi-process job, the processes that hold the state and call
        this checkpointer (the lowest one writes the JSON extra); None = every process.
    """
    if keep < 1:
      raise ValueError(f"Checkpointer keep={keep} must be >= 1.")
    self._dir = os.path.abspath(directory)
    multiprocessing = ocp.options.MultiprocessingOptions()
    if active_processes is not None and jax.process_count() > 1:
      active = sorted(set(int(p) for p in active_processes))
      multiprocessing = ocp.options.MultiprocessingOptions(
          primary_host=active[0], active_processes=set(active),
          barrier_sync_key_prefix="learner")
      os.makedirs(self._dir, exist_ok=True)  # orbax cannot create it for a process subset
    self._options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save,
        create=multiprocessing.active_processes is None,
        multiprocessing_options=multiprocessing)
    self._manager = ocp.CheckpointManager(
        self._dir, options=self._options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "extra": ocp.JsonCheckpointHandler()})

  @property
  def directory(self) -> str:
    return self._dir

  def steps(self) -> list[int]:
    """Steps orbax lists in the directory (finalized by rename), ascending."""
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, extra: dict | None = None) -> None:
    """Starts saving `state` and `extra` as checkpoint `step` (returns before files are written).

    An existing checkpoint with the same step is replaced.

    Args:
      step: non-negative step id.
      state: pytree of jax arrays (any sharding) and scalars.
      extra: JSON-serializable dict (default {}).

    Raises:
      TypeError: if `extra` is not JSON-serializable.
    """
    extra = {} if extra is None else extra
    try:
      json.dumps(extra)
    except (TypeError, ValueError) as e:
      raise TypeError(f"checkpoint extra must be JSON-serializable: {e}") from None
    if step in self._manager.all_steps():
      self._manager.wait_until_finished()
      logging.info("Checkpointer: replacing existing checkpoint step %d in %s.", step, self._dir)
      self._manager.delete(step)
    if jax.process_count() > 1 and all(
        getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(state)):
      # One process holds the whole state in a multi-process job (a one-process learner): orbax
      # refuses process-local arrays there, so the host copy is written (same files; restores
      # onto any sharding like a saved global array).
      state = jax.device_get(state)
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)), force=True)

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk."""
    self._manager.wait_until_finished()

  def restore(self, abstract_state: Any, step: int | None = None) -> Restored:
    """Restores a checkpoint onto the shardings carried by `abstract_state`.

    Args:
      abstract_state: pytree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` with the
        structure of the saved state (the target mesh may differ from the saving one).
      step: a specific step, or None for the newest usable one.

    Returns:
      Restored(step, state, extra, skipped, skip_reasons).

    Raises:
      CheckpointNotFoundError: no checkpoint in the directory, or `step` is not one of them.
      CheckpointCorruptError: `step` (or, with step None, every step) is incomplete or
        unreadable; the message lists each failure.
      CheckpointMismatchError: the step holds another tree than `abstract_state` (names the
        differing leaves).
      CheckpointTargetError: `abstract_state` is None, empty, or has leaves that are not array
        descriptions.
      CheckpointTopologyError: leaves of `abstract_state` without a sharding were saved on
        devices this job does not have (the message names them and the device counts).
    """
    check_target(abstract_state, f"Checkpointer.restore from {self._dir}")
    self.wait()
    self._manager.reload()  # see steps written by others since this manager was opened
    available = sorted(self._manager.all_steps(), reverse=True)
    if not available:
      raise CheckpointNotFoundError(f"no checkpoint in {self._dir}.")
    if step is not None and step not in available:
      raise CheckpointNotFoundError(
          f"checkpoint step {step} is not in {self._dir}; it holds steps {sorted(available)}.")
    failures, skipped = [], []
    for s in [step] if step is not None else available:
      try:
        state, extra = self._restore_step(s, abstract_state)
        return Restored(s, state, extra, skipped=tuple(skipped),
                        skip_reasons=tuple(failures))
      except CheckpointCorruptError as e:
        failures.append(f"step {s}: {e}")
        if step is not None:
          raise
        skipped.append(s)
        logging.error(
            "Checkpointer: checkpoint step %d in %s is incomplete or corrupt (%s); falling back "
            "to the previous checkpoint.", s, self._dir, e)
    raise CheckpointCorruptError(f"could not restore from {self._dir}: " + "; ".join(failures))

  def restore_extra(self, step: int | None = None) -> dict:
    """The JSON extra dict of `step` (default: the newest step with a commit marker).

    Raises:
      CheckpointNotFoundError: no such step.
      CheckpointCorruptError: its extra cannot be read.
    """
    self.wait()
    self._manager.reload()
    steps = [s for s in sorted(self._manager.all_steps(), reverse=True)
             if os.path.exists(os.path.join(self._dir, str(s), COMMIT_MARKER))]
    if not steps or (step is not None and step not in steps):
      raise CheckpointNotFoundError(f"no complete checkpoint{'' if step is None else f' {step}'} "
                                    f"in {self._dir}.")
    s = steps[0] if step is None else step
    try:
      out = self._manager.restore(s, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointCorruptError(f"step {s}: extra unreadable ({type(e).__name__}: "
                                   f"{str(e)[:200]})") from None
    return dict(out.extra or {})

  def close(self) -> None:
    """Waits for pending saves and releases orbax resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def _restore_step(self, step: int, abstract_state: Any):
    marker = os.path.join(self._dir, str(step), COMMIT_MARKER)
    if not os.path.exists(marker):
      raise CheckpointCorruptError(f"missing commit marker {marker} (the save did not finish)")
    try:
      saved = self._manager.item_metadata(step)["state"]
    except Exception as e:  # pylint: disable=broad-except  (any read failure = corrupt step)
      raise CheckpointCorruptError(
          f"state metadata unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    if saved is None:
      raise CheckpointCorruptError("no state metadata")
    what = f"checkpoint step {step} in {self._dir}"
    check_tree_matches(saved, abstract_state, what)
    check_topology(saved, abstract_state, what)
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), extra=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except  (any read failure = corrupt step)
      if "Topology mismatch" in str(e):  # orbax's words when a saved sharding cannot be rebuilt
        raise CheckpointTopologyError(f"{what}: {str(e)[:300]} {_TOPOLOGY_FIX}") from None
      raise CheckpointCorruptError(
          f"unreadable ({type(e).__name__}: {str(e)[:300]})") from None
    return out.state, dict(out.extra or {})


def _path_names(path) -> tuple[str, ...]:
  out = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        out.append(str(getattr(k, attr)))
        break
    else:
      out.append(str(k))
  return tuple(out)


def _leaves_by_path(tree: Any) -> dict[tuple[str, ...], Any]:
  leaves = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
  return {_path_names(p): leaf for p, leaf in leaves}


_TARGET_FIX = ("Pass the abstract state of the model and optimizer being trained, every leaf a "
               "jax.ShapeDtypeStruct(shape, dtype, sharding=...) on the mesh to restore onto "
               "(`learner.train_state.sharded_abstract_state(model, tx, mesh)`; "
               "`Learner.restore` builds it).")
_TOPOLOGY_FIX = ("To restore onto this job's devices, give every target leaf a sharding on its "
                 "mesh (`learner.train_state.sharded_abstract_state(model, tx, mesh)`, as "
                 "`Learner.restore` does); orbax then reshards on load.")


def _is_array_description(x: Any) -> bool:
  return isinstance(x, (jax.ShapeDtypeStruct, jax.Array, np.ndarray))


def check_target(abstract_state: Any, what: str) -> None:
  """Checks that a restore target is given and describes arrays.

  Raises:
    CheckpointTargetError: if `abstract_state` is None or has no leaf (naming the fix), or has
      leaves that are not `jax.ShapeDtypeStruct`, `jax.Array` or `np.ndarray` (naming up to 5;
      e.g. numpy or Python scalars, which orbax cannot restore into).
  """
  leaves = _leaves_by_path(abstract_state)
  if not leaves:
    raise CheckpointTargetError(
        f"{what}: no restore target ({type(abstract_state).__name__} with no array leaf); "
        f"the target gives each restored array its shape, dtype and devices. {_TARGET_FIX}")
  bad = [f"{'/'.join(p)}: {type(x).__name__}" for p, x in sorted(leaves.items())
         if not _is_array_description(x)]
  if bad:
    raise CheckpointTargetError(
        f"{what}: target leaves that are not array descriptions: {bad[:5]}"
        f"{' ...' if len(bad) > 5 else ''}. {_TARGET_FIX}")


def _saved_devices(sharding_metadata: Any) -> str:
  """'N devices (mesh fsdp=2 x tp=2)' from orbax sharding metadata, as far as it tells."""
  mesh = getattr(getattr(sharding_metadata, "device_mesh", None), "mesh", None)
  count = None if mesh is None else len(jax.tree.leaves(
      mesh, is_leaf=lambda d: hasattr(d, "id")))
  names, shape = (getattr(sharding_metadata, "axis_names", None),
                  getattr(sharding_metadata, "shape", None))
  axes = (" (mesh " + " x ".join(f"{n}={int(k)}" for n, k in zip(names, shape)) + ")"
          if names is not None and shape is not None else "")
  if count is None and shape is not None:
    count = int(np.prod(shape))
  return f"{'an unknown number of' if count is None else count} devices{axes}"


def check_topology(saved_metadata: Any, abstract_state: Any, what: str) -> None:
  """Target leaves without a sharding are restored onto their saved sharding (orbax); this
  checks that the saved devices exist here.

  Raises:
    CheckpointTopologyError: naming up to 5 such leaves, the devices they were saved on and the
      devices this job has, and the fix (target shardings on the current mesh).
  """
  saved = _leaves_by_path(getattr(saved_metadata, "tree", saved_metadata))
  unplaceable, where = [], None
  for p, leaf in sorted(_leaves_by_path(abstract_state).items()):
    if getattr(leaf, "sharding", None) is not None or p not in saved:
      continue
    meta = getattr(saved[p], "sharding", None)
    if meta is None or not hasattr(meta, "to_jax_sharding"):
      continue
    try:
      meta.to_jax_sharding()
    except ValueError:
      unplaceable.append("/".join(p))
      where = where or _saved_devices(meta)
  if unplaceable:
    raise CheckpointTopologyError(
        f"{what} was saved on {where}, which this job does not have ({jax.device_count()} "
        f"devices in {jax.process_count()} process(es)): the device count or topology changed, "
        f"and target leaves {unplaceable[:5]}{' ...' if len(unplaceable) > 5 else ''} have no "
        f"sharding to restore onto instead. {_TOPOLOGY_FIX}")


def check_tree_matches(saved_metadata: Any, abstract_state: Any, what: str) -> None:
  """Compares a saved state's metadata tree (orbax `TreeMetadata` or a pytree of objects with
  shape and dtype) with a restore target.

  Raises:
    CheckpointMismatchError: naming up to 5 missing / unexpected leaves or the first leaves
      whose shape or dtype differ, with both sides.
  """
  saved = _leaves_by_path(getattr(saved_metadata, "tree", saved_metadata))
  want = _leaves_by_path(abstract_state)
  missing = sorted("/".join(p) for p in want.keys() - saved.keys())
  extra = sorted("/".join(p) for p in saved.keys() - want.keys())
  if missing or extra:
    raise CheckpointMismatchError(
        f"{what} holds another tree than the restore target: target leaves missing from it "
        f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, leaves only in it {extra[:5]}"
        f"{' ...' if len(extra) > 5 else ''} (another model or optimizer? restore with the "
        "configuration it was saved with).")
  bad = []
  for p, leaf in want.items():
    got = saved[p]
    if not (hasattr(got, "shape") and hasattr(got, "dtype")):
      continue
    if tuple(got.shape) != tuple(leaf.shape) or np.dtype(got.dtype) != np.dtype(leaf.dtype):
      bad.append(f"{'/'.join(p)}: saved {tuple(got.shape)} {np.dtype(got.dtype).name}, target "
                 f"{tuple(leaf.shape)} {np.dtype(leaf.dtype).name}")
  if bad:
    raise CheckpointMismatchError(
        f"{what} does not fit the restore target: {'; '.join(bad[:5])}"
        f"{' ...' if len(bad) > 5 else ''} (another model size or dtype?).")
