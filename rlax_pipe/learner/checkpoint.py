"""Orbax checkpoints of the train state plus a JSON "extra" dict, with fallback on bad steps.

Layout (orbax v0 `CheckpointManager`, one directory per step):

  <dir>/<step>/state/...            the TrainState pytree (params, optimizer state, version, rng,
                                    counters), OCDBT, written from whatever mesh holds it
  <dir>/<step>/extra/metadata       the JSON extra dict (pipeline queue, task iterator, ...)
  <dir>/<step>/commit_success.txt   orbax's commit marker, written last, before the atomic rename

Saves are asynchronous: `save` returns after the device-to-host copy, the files are written in a
background thread. Restores read onto the shardings of the abstract target given, so a state
saved on one mesh (e.g. 2 x 2 fsdp x tp on devices 0-3) restores onto another (e.g. 4-way tp
on devices 4-7). Restoring the latest checkpoint falls back to older ones when the newest is
incomplete (no commit marker) or unreadable, with an absl error log line per bad step. Bad step
directories are left in place (a wrong abstract target would fail the same way and must not
destroy good checkpoints); the next `save` of the same step replaces one.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

from absl import logging
import orbax.checkpoint as ocp

COMMIT_MARKER = "commit_success.txt"


class CheckpointError(RuntimeError):
  """No usable checkpoint (all candidates incomplete or unreadable), or a bad explicit step."""


class Restored(NamedTuple):
  """What `Checkpointer.restore` returns.

  Attributes:
    step: the checkpoint step that was restored.
    state: the restored pytree, on the shardings of the abstract target.
    extra: the JSON dict saved with it.
    skipped: steps newer than `step` that were found incomplete or unreadable.
  """

  step: int
  state: Any
  extra: dict
  skipped: tuple[int, ...]


class Checkpointer:
  """Thin shell over an orbax `CheckpointManager`: keep-last-N, async save, robust restore.

  Example:
    >>> ckpt = Checkpointer("/tmp/run/ckpt", keep=3)
    >>> ckpt.save(10, state, {"queue": [...]})
    >>> restored = ckpt.restore(sharded_abstract_state)   # newest usable step
  """

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    """Opens (and creates) a checkpoint directory.

    Args:
      directory: checkpoint root (absolute or relative path).
      keep: keep the newest `keep` (>= 1) steps; older ones are deleted after each save.
      async_save: write files in a background thread after the device-to-host copy.
    """
    if keep < 1:
      raise ValueError(f"Checkpointer keep={keep} must be >= 1.")
    self._dir = os.path.abspath(directory)
    self._options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    self._manager = ocp.CheckpointManager(self._dir, item_names=("state", "extra"),
                                          options=self._options)

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
      Restored(step, state, extra, skipped).

    Raises:
      CheckpointError: when `step` is given and is incomplete or unreadable, or when no step
        in the directory can be restored (the message lists each failure).
    """
    self.wait()
    self._manager.reload()  # see steps written by others since this manager was opened
    candidates = [step] if step is not None else sorted(self._manager.all_steps(), reverse=True)
    if not candidates:
      raise CheckpointError(f"no checkpoint in {self._dir}.")
    failures, skipped = [], []
    for s in candidates:
      try:
        return Restored(s, *self._restore_step(s, abstract_state), skipped=tuple(skipped))
      except Exception as e:  # pylint: disable=broad-except  (any read failure = bad step)
        reason = f"{type(e).__name__}: {str(e)[:300]}"
        failures.append(f"step {s}: {reason}")
        if step is not None:
          break
        skipped.append(s)
        logging.error(
            "Checkpointer: checkpoint step %d in %s is incomplete or corrupt (%s); falling back "
            "to the previous checkpoint.", s, self._dir, reason)
    raise CheckpointError(f"could not restore from {self._dir}: " + "; ".join(failures))

  def close(self) -> None:
    """Waits for pending saves and releases orbax resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def _restore_step(self, step: int, abstract_state: Any):
    marker = os.path.join(self._dir, str(step), COMMIT_MARKER)
    if not os.path.exists(marker):
      raise CheckpointError(f"missing commit marker {marker} (the save did not finish)")
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), extra=ocp.args.JsonRestore()))
    return out.state, dict(out.extra or {})
