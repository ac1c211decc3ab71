"""Reward evaluation that never kills the run: errors, hangs and invalid values score 0.0.

A user's verifier may raise, loop forever, or return garbage (None, NaN, a string). `safe_reward`
turns each of these into reward 0.0, counts it in a `RewardStats`, and logs it with the sample id
through absl logging (warning level).

Hangs: with `timeout_s` set, the reward function runs in a fresh daemon thread and the caller waits
at most `timeout_s` seconds. Python cannot kill a thread, so a hung call is ABANDONED: its daemon
thread keeps running (holding whatever it holds) until it returns or the process exits, and it
never blocks interpreter shutdown. Every abandoned thread is counted (`RewardStats.timeouts`); if
they pile up, the verifier itself needs fixing. With `timeout_s=None` the function runs inline
(no thread, no hang protection, exceptions still caught).
"""

from __future__ import annotations

import dataclasses
import math
import threading

from absl import logging
import numpy as np

from rlax_pipe.tasks import base

OUTCOMES: tuple[str, ...] = ("ok", "error", "timeout", "invalid")


@dataclasses.dataclass(frozen=True)
class RewardCounts:
  """A snapshot of `RewardStats`: how many reward calls ended in each outcome."""

  ok: int = 0
  error: int = 0
  timeout: int = 0
  invalid: int = 0

  @property
  def total(self) -> int:
    """All calls."""
    return self.ok + self.error + self.timeout + self.invalid

  @property
  def failed(self) -> int:
    """Calls that scored 0.0 because the reward function failed (error, timeout or invalid)."""
    return self.error + self.timeout + self.invalid


class RewardStats:
  """Thread-safe counters of reward outcomes ("ok", "error", "timeout", "invalid")."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counts = dict.fromkeys(OUTCOMES, 0)

  def record(self, outcome: str) -> None:
    """Counts one call; raises ValueError for an outcome not in `OUTCOMES`."""
    if outcome not in self._counts:
      raise ValueError(f"outcome={outcome!r}; choose one of {OUTCOMES}.")
    with self._lock:
      self._counts[outcome] += 1

  def snapshot(self) -> RewardCounts:
    """The counts so far, as an immutable `RewardCounts`."""
    with self._lock:
      return RewardCounts(**self._counts)

  @property
  def timeouts(self) -> int:
    """Calls abandoned after exceeding the timeout (their daemon threads may still be running)."""
    return self.snapshot().timeout


def _valid(value) -> bool:
  return (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, bool) and math.isfinite(value))


def safe_reward(task: base.Task, problem: base.Problem, completion: str, *, sample_id: int,
                timeout_s: float | None = 5.0, stats: RewardStats | None = None) -> float:
  """`task.reward(problem, completion)`, or 0.0 when it raises, hangs or returns a non-number.

  Args:
    task: any `base.Task`.
    problem: the problem the completion answers.
    completion: decoded completion text (no EOS).
    sample_id: id of the sample, written in the log line of a failure.
    timeout_s: seconds to wait for the reward (> 0), or None to call inline without a timeout.
    stats: counters to update (optional).

  Returns:
    The reward as a float; 0.0 on error (any Exception), timeout, or a value that is not a finite
    int/float (bool, None, NaN, inf, str, ... are "invalid").

  Raises:
    ValueError: when `timeout_s` is not None and not > 0.
  """
  if timeout_s is not None and not timeout_s > 0:
    raise ValueError(f"timeout_s={timeout_s} must be > 0 or None.")
  name = getattr(task, "name", type(task).__name__)
  box: dict[str, object] = {}

  def call():
    try:
      box["value"] = task.reward(problem, completion)
    except Exception as e:  # pylint: disable=broad-except  (any verifier bug must not kill the run)
      box["error"] = e

  if timeout_s is None:
    call()
  else:
    worker = threading.Thread(target=call, name=f"reward-{sample_id}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
      logging.warning("Reward of task %s for sample %d exceeded %.3g s; scored 0.0, thread "
                      "abandoned.", name, sample_id, timeout_s)
      _record(stats, "timeout")
      return 0.0
  if "error" in box:
    logging.warning("Reward of task %s for sample %d raised %r; scored 0.0.", name, sample_id,
                    box["error"])
    _record(stats, "error")
    return 0.0
  value = box.get("value")
  if not _valid(value):
    logging.warning("Reward of task %s for sample %d returned %r, not a finite number; scored "
                    "0.0.", name, sample_id, value)
    _record(stats, "invalid")
    return 0.0
  _record(stats, "ok")
  return float(value)


def _record(stats: RewardStats | None, outcome: str) -> None:
  if stats is not None:
    stats.record(outcome)
