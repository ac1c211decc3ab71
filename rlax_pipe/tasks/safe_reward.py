"""Reward outcomes: a verifier call either scores, or fails (raises, hangs, returns garbage).

A failed call has no reward: its `Verdict.reward` is NaN, never 0.0, so it cannot pass for a wrong
answer. Downstream, NaN rewards are excluded from their group's baseline and from the loss
(`rlax_pipe.advantages`, `pipeline.trainer`). Outcomes:

- "ok": the call returned a finite int / float (numpy scalars included; bool is not a number);
- "error": the call raised (any exception, in the verifier process);
- "timeout": the call did not return within the time limit (its process was killed);
- "invalid": the call returned something else (None, NaN, inf, a string, a list, ...).

`grade_inline` runs a verifier in the calling thread (no time limit); `verifier_pool.VerifierPool`
runs verifiers in worker processes with a hard time limit, which is what the pipeline uses.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import numpy as np

from rlax_pipe.tasks import base
from rlax_pipe.tasks.tools import ToolError

OUTCOMES: tuple[str, ...] = ("ok", "error", "timeout", "invalid")


@dataclasses.dataclass(frozen=True)
class Verdict:
  """The result of one reward call.

  Attributes:
    reward: the reward (float) when `outcome` is "ok", else NaN.
    outcome: one of `OUTCOMES`.
    detail: for failures, what went wrong (the exception's repr, the returned value's repr, or
      the time limit); "" for "ok".
  """

  reward: float
  outcome: str
  detail: str = ""

  @property
  def failed(self) -> bool:
    """True unless the call scored."""
    return self.outcome != "ok"


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
    """Calls without a reward (error, timeout or invalid)."""
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
    """Calls killed after exceeding the time limit."""
    return self.snapshot().timeout


def is_valid_reward(value) -> bool:
  """Whether `value` is a finite int / float (numpy scalars included, bool excluded)."""
  return (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, (bool, np.bool_)) and math.isfinite(value))


def call_verifier(task: base.Task, problem: base.Problem, completion: str) -> Verdict:
  """`task.reward(problem, completion)` classified into a `Verdict` (never raises an Exception)."""
  try:
    value = task.reward(problem, completion)
  except Exception as e:  # pylint: disable=broad-except  (any verifier bug is a failed reward)
    return Verdict(math.nan, "error", repr(e)[:500])
  if not is_valid_reward(value):
    return Verdict(math.nan, "invalid", f"returned {value!r:.200}")
  return Verdict(float(value), "ok")


def grade_inline(task: base.Task, problem: base.Problem, completion: str, *,
                 stats: RewardStats | None = None) -> Verdict:
  """`call_verifier` in the calling thread, counted in `stats`; no time limit, no isolation.

  Use `verifier_pool.VerifierPool` for verifiers that may hang or need the main thread
  (`signal.alarm`, e.g. math-verify).
  """
  verdict = call_verifier(task, problem, completion)
  if stats is not None:
    stats.record(verdict.outcome)
  return verdict


# A tool's text is cut to this many characters in the worker (a guard for the pipe and the
# tokenizer; `rlax_pipe.envs` then applies its token limit, `EnvConfig.max_tool_output_tokens`).
MAX_TOOL_OUTPUT_CHARS = 1 << 16
# `detail` of a failed tool call whose value is the tool's own message for the model
# (`tools.ToolError`), shown verbatim instead of a generic error text.
TOOL_MESSAGE = "message from the tool"


def call_tool(env, problem: base.Problem, call) -> tuple[Any, str, str]:
  """`env.call_tool(problem, call)` of an environment (`rlax_pipe.envs`), classified; never
  raises an Exception.

  Returns:
    (text, "ok", "") for a string; (text cut to MAX_TOOL_OUTPUT_CHARS, "too_long", its length)
    for a longer one; (its message cut to MAX_TOOL_OUTPUT_CHARS, its outcome, TOOL_MESSAGE) when
    the tool raised a `tools.ToolError`; (NaN, "error", the exception) when it raised anything
    else; (NaN, "invalid", what it returned) when that was not a string.
  """
  try:
    value = env.call_tool(problem, call)
  except ToolError as e:
    return e.message[-MAX_TOOL_OUTPUT_CHARS:], e.outcome, TOOL_MESSAGE
  except Exception as e:  # pylint: disable=broad-except  (a tool bug is a failed call)
    return math.nan, "error", repr(e)[:500]
  if not isinstance(value, str):
    return math.nan, "invalid", f"returned {value!r:.200}, not a str"
  if len(value) > MAX_TOOL_OUTPUT_CHARS:
    return value[:MAX_TOOL_OUTPUT_CHARS], "too_long", f"{len(value)} characters"
  return value, "ok", ""
