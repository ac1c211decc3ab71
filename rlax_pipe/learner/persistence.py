"""`Learner` state in and out: `state_dict` / `load_state_dict` and checkpoints (`save` /
`restore` through `learner.checkpoint.Checkpointer`). A mixin of `Learner` (it uses the learner's
state, mesh, optimizer, checkpointer and LoRA base), kept apart by concept.

A LoRA learner's checkpoint holds the adapters and, in its extra dict, the checksums of the
frozen base they were trained on (`lora_base.LORA_BASE_KEY`); `restore` refuses another base.
"""

from __future__ import annotations

from absl import logging
import jax

from rlax_pipe.learner import checkpoint as checkpoint_lib
from rlax_pipe.learner import lora_base
from rlax_pipe.learner import train_state as train_state_lib

# pylint: disable=no-member  (attributes of `Learner`, which this mixin is part of)


class LearnerPersistence:
  """`Learner` methods for its state as a whole: snapshots and checkpoints."""

  def state_dict(self) -> train_state_lib.TrainState:
    """The learner's whole state (device arrays, donated by the next `train_step`)."""
    return self._state

  def load_state_dict(self, state: train_state_lib.TrainState) -> None:
    """Replaces the state by `state` (any placement: copied onto the learner shardings).

    Raises:
      ValueError: if its tree differs from this learner's state (the message names both).
    """
    want, got = jax.tree.structure(self._state), jax.tree.structure(state)
    if want != got:
      raise ValueError(f"Learner.load_state_dict: state tree {got} differs from {want}.")
    self._state, self._pending = jax.device_put(state, self.state_shardings), None
    self._read_counters()

  def save(self, extra: dict | None = None) -> int:
    """Starts an asynchronous checkpoint of the state (+ JSON `extra`); returns its step id.

    Raises:
      ValueError: if `LearnerConfig.checkpoint.directory` is None.
      TypeError: if `extra` is not JSON-serializable.
    """
    if self._checkpointer is None:
      raise ValueError("Learner.save: LearnerConfig.checkpoint.directory is None.")
    if self.lora is not None:  # the adapters are only meaningful on top of this very base
      extra = {**(extra or {}), lora_base.LORA_BASE_KEY: lora_base.base_checksum(self._frozen)}
    step = self.step
    self._checkpointer.save(step, self.state_dict(), extra)
    logging.info("Learner: saving checkpoint step %d (version %d) to %s.", step, self.version,
                 self._checkpointer.directory)
    return step

  def restore(self, step: int | None = None) -> dict:
    """Restores a checkpoint (newest usable one by default) onto THIS learner's mesh.

    Returns:
      The JSON extra dict saved with it.

    Raises:
      ValueError: if `LearnerConfig.checkpoint.directory` is None.
      checkpoint.CheckpointError: if no usable checkpoint exists (or `step` is unusable);
        `CheckpointMismatchError` too when a LoRA checkpoint's adapters were trained on another
        base than this learner's `base_params` (exact checksums compared).
    """
    if self._checkpointer is None:
      raise ValueError("Learner.restore: LearnerConfig.checkpoint.directory is None.")
    target = train_state_lib.sharded_abstract_state(self._space, self._tx, self.mesh)
    restored = self._checkpointer.restore(target, step)
    base = restored.extra.pop(lora_base.LORA_BASE_KEY, None)
    if self.lora is not None and base is not None and base != lora_base.base_checksum(self._frozen):
      raise checkpoint_lib.CheckpointMismatchError(
          f"checkpoint step {restored.step} in {self._checkpointer.directory} holds LoRA adapters "
          "trained on another base than the params this learner was given: pass the same "
          "initial params (RunConfig.init) as the run that saved it.")
    self._state, self._pending = restored.state, None
    self._read_counters()
    self.last_restore = restored._replace(state=None)  # step, skipped steps and why
    logging.info("Learner: restored checkpoint step %d (version %d) from %s%s.", restored.step,
                 self.version, self._checkpointer.directory,
                 f", skipping bad steps {list(restored.skipped)}" if restored.skipped else "")
    return restored.extra

  def close(self) -> None:
    """Waits for pending checkpoint writes."""
    if self._checkpointer is not None:
      self._checkpointer.close()
