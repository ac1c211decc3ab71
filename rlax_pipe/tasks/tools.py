"""The tool-call message: what an environment's tool receives in a verifier worker process.

Defined here, in the light `tasks` layer, so that a worker process unpickling a call imports
no JAX (`rlax_pipe.envs` holds the rest of the environment machinery).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One tool call parsed from a model turn.

  Attributes:
    name: the tool's name.
    arguments: its arguments as the protocol parsed them (a dict for JSON tool calls, a string
      for the plain-text protocol).
  """

  name: str
  arguments: Any


class ToolError(Exception):
  """Raised by a tool to answer the model with its own error message and outcome.

  `safe_reward.call_tool` turns it into a failed call whose message the model sees verbatim
  (e.g. a Python traceback), counted under `outcome`, without killing the worker process.

  Attributes:
    message: the text the model sees.
    outcome: "error" (the call failed), "timeout" (a time limit the tool enforces itself),
      "too_long" (its output exceeded a limit) or "resource" (a memory limit).
  """

  OUTCOMES = ("error", "timeout", "too_long", "resource")

  def __init__(self, message: str, outcome: str = "error"):
    if outcome not in self.OUTCOMES:
      raise ValueError(f"ToolError outcome={outcome!r}; choose one of {self.OUTCOMES}.")
    super().__init__(message)
    self.message, self.outcome = str(message), outcome

  def __reduce__(self):
    return (type(self), (self.message, self.outcome))
