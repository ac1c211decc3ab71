"""The engine's always-on check that it decodes with the weights its tokens are tagged with
(issue #14 item 10; issue #27 item 3).

A `WeightUpdate` that carries the learner's checksums of its version (`WeightUpdate.checksum`,
`rlax_pipe.param_checksum`: exact and layout-independent) is checked on what decodes: the first
decode dispatch of each replica with that version hands the check the very arrays it passed to
the compiled step (`Launched.params`); `observe` dispatches their checksums right behind it
(asynchronously, so no dispatch waits for it) and `finish`, called after the next read-back,
compares them. Checking the arrays the engine *stores* (`EngineWeights.running`) was not enough
(issue #27 item 3): an engine whose dispatch kept reading an older copy (a per-replica view not
refreshed, a cached argument) passed that check. A channel that lands old arrays under a new
version number, or an engine that keeps decoding with old weights, raises
`param_checksum.WeightMismatchError` naming the version, the replica and the leaves that differ.
Cost: one read of every parameter per swap and replica, measured about one single-token forward
(experiments/bench_weight_check.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import numpy as np

from rlax_pipe import param_checksum


class WeightCheck:
  """Expected checksums of the running version, checks of dispatched weights in flight, and
  what was checked so far.

  Attributes:
    count: versions whose dispatched weights matched the learner's checksums (each counted once,
      on its first matching replica; every other replica's dispatch is checked too).
    last: (version, uint32[num_leaves] checksums) of the last dispatch checked, or None.
    log: (version, uint32[num_leaves] checksums) of every counted version, oldest first (one
      entry per increment of `count`): several checks can complete within one engine step, so
      a reader that polls only `last` between steps can miss a version.
  """

  def __init__(self):
    self._expected: tuple | None = None  # (version, learner checksums, leaf names)
    self._seen: set[int] = set()  # replicas whose dispatch of the expected version is checked
    self._pending: list[tuple] = []  # (version, replica, expected, computed, names)
    self.last: tuple[int, np.ndarray] | None = None
    self.log: list[tuple[int, np.ndarray]] = []

  @property
  def count(self) -> int:
    """Versions whose dispatched weights matched (one `log` entry each)."""
    return len(self.log)

  def expect(self, running: Any) -> None:
    """From now on, dispatches tagged with `running.version` (the engine's running
    `WeightUpdate`) are checked against `running.checksum` (no check when it has none)."""
    self._seen = set()
    if running.checksum is None:
      self._expected = None
      return
    names = [jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(running.params)[0]]
    self._expected = (running.version, running.checksum, names)

  def observe(self, replica: int, version: int, dispatched: Any) -> None:
    """Starts checking the weights `dispatched` (the arrays a decode dispatch of `replica`
    passed to its compiled step, its tokens tagged `version`), once per replica and version."""
    if self._expected is None or replica in self._seen:
      return
    expected_version, expected, names = self._expected
    if version != expected_version:  # a dispatch with another version than the running one
      expected = None  # is a mismatch of its own: the tags would be wrong
    self._seen.add(replica)
    self._pending.append((version, replica, expected, expected_version,
                          param_checksum.checksum(dispatched), names))

  def unchecked(self, replicas: Iterable[int]) -> list[int]:
    """The replicas in `replicas` whose dispatch of the running version is not checked yet
    (empty when the running version has no checksums)."""
    return [] if self._expected is None else [r for r in replicas if r not in self._seen]

  def finish(self) -> None:
    """Completes the pending checks, if any (waits for their checksums).

    Raises:
      param_checksum.WeightMismatchError: the weights a dispatch decoded with are not the
        learner's weights of the version its tokens are tagged with.
    """
    pending, self._pending = self._pending, []
    for version, replica, expected, expected_version, computed, names in pending:
      where = f"the sampler engine's decode dispatch (replica {replica})"
      if expected is None:
        raise param_checksum.WeightMismatchError(
            f"{where} decoded with weights tagged version {version} while the engine runs "
            f"version {expected_version}: its tokens' version tags are wrong.")
      param_checksum.compare(expected, computed, version, names=names, got_from=where)
      self.last = (version, param_checksum.host(computed))
      if not self.log or self.log[-1][0] != version:  # counted once, on its first replica
        self.log.append(self.last)


class CheckedWeights:
  """`SamplerEngine`'s public side of its weight check (a mixin: the engine holds `_weight_check`,
  `_step_lock`, `weights`, `replicas` and `_apply_pending_weights`)."""

  _weight_check: WeightCheck

  @property
  def weight_checks(self) -> int:
    """Versions whose dispatched weights matched the learner's checksums."""
    return self._weight_check.count

  @property
  def last_weight_check(self) -> tuple[int, np.ndarray] | None:
    """(version, uint32[num_leaves] checksums) of the last dispatch checked, or None."""
    return self._weight_check.last

  def weight_checks_since(self, n: int) -> list[tuple[int, np.ndarray]]:
    """(version, uint32[num_leaves] checksums) of the checked versions after the first `n`
    (`n` = the `weight_checks` count a reader saw last), oldest first: every version, even
    when several checks complete within one step."""
    return list(self._weight_check.log[n:])

  def check_weights(self) -> None:
    """Swaps in a pending update now and completes the check of the running weights (a step
    does both on its own; this is for an engine about to stop): a replica that has not run a
    dispatch with them yet is checked on the arrays its next dispatch would be given.

    Raises:
      param_checksum.WeightMismatchError: see `WeightCheck.finish`.
    """
    with self._step_lock:  # pylint: disable=no-member
      self._apply_pending_weights()  # pylint: disable=no-member
      self._check_undispatched()

  def _check_undispatched(self) -> None:
    """Checks the running version on replicas that never ran a dispatch with it, on the views
    their next dispatch would be given, and completes every pending check (blocking). Called
    before such a version is swapped out (an idle replica) and when the engine stops, so every
    version the engine installed is checked on every replica."""
    check = self._weight_check
    views = self.weights.views  # pylint: disable=no-member
    for i in check.unchecked(range(len(views))):
      check.observe(i, self.weights.version, views[i])  # pylint: disable=no-member
    check.finish()
