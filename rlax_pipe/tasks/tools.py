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
