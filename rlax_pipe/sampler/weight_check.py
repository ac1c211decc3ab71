"""The engine's always-on check that it decodes with the weights its tokens are tagged with
(issue #14 item 10).

A `WeightUpdate` that carries the learner's checksums of its version (`WeightUpdate.checksum`,
`rlax_pipe.param_checksum`: exact and layout-independent) is checked once it runs: `start`
dispatches the checksums of the engine's running copy right after the swap (asynchronously, so a
decode dispatch never waits for it) and `finish`, called after the next read-back, compares them.
A channel that lands old arrays under a new version number, or an engine that keeps decoding
with old weights, raises `param_checksum.WeightMismatchError` naming the version and the leaves
that differ. Cost: one read of every parameter per swap, measured about one single-token forward
(experiments/bench_weight_check.py).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rlax_pipe import param_checksum


class WeightCheck:
  """The pending check of the engine's running weights, and what was checked so far.

  Attributes:
    count: versions whose running weights matched the learner's checksums.
    last: (version, uint32[num_leaves] checksums) of the last version checked, or None.
  """

  def __init__(self):
    self._pending: tuple | None = None  # (version, expected, computed, leaf names)
    self.count = 0
    self.last: tuple[int, np.ndarray] | None = None

  def start(self, running: Any) -> None:
    """Starts checking `running` (the engine's running `WeightUpdate`) when it carries the
    learner's checksums; completes any check still pending first.

    Raises:
      param_checksum.WeightMismatchError: from the pending check (see `finish`).
    """
    if running.checksum is None:
      return
    self.finish()
    names = [jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(running.params)[0]]
    self._pending = (running.version, running.checksum,
                     param_checksum.checksum(running.params), names)

  def finish(self) -> None:
    """Completes the pending check, if any (waits for its checksums).

    Raises:
      param_checksum.WeightMismatchError: the weights the engine decodes with are not the
        learner's weights of the version their tokens are tagged with.
    """
    check, self._pending = self._pending, None
    if check is None:
      return
    version, expected, computed, names = check
    param_checksum.compare(expected, computed, version, names=names,
                           got_from="the sampler engine")
    self.count += 1
    self.last = (version, param_checksum.host(computed))


class CheckedWeights:
  """`SamplerEngine`'s public side of its weight check (a mixin: the engine holds `_weight_check`,
  `_step_lock` and `_apply_pending_weights`)."""

  _weight_check: WeightCheck

  @property
  def weight_checks(self) -> int:
    """Versions whose running weights matched the learner's checksums."""
    return self._weight_check.count

  @property
  def last_weight_check(self) -> tuple[int, np.ndarray] | None:
    """(version, uint32[num_leaves] checksums) of the last version checked, or None."""
    return self._weight_check.last

  def check_weights(self) -> None:
    """Swaps in a pending update now and completes the check of the running weights (a step
    does both on its own; this is for an engine about to stop).

    Raises:
      param_checksum.WeightMismatchError: see `WeightCheck.finish`.
    """
    with self._step_lock:  # pylint: disable=no-member
      self._apply_pending_weights()  # pylint: disable=no-member
      self._weight_check.finish()
