"""The environment protocol of multi-turn, tool-calling episodes, its messages and limits.

An episode starts from a task prompt. After each model turn (a completion that ended on a stop
id) the environment's protocol (`rlax_pipe.envs.protocols`) parses the turn's text into tool
calls; the tools run in worker processes with a hard time limit (`ToolPool`), and their results
are rendered once into tokens that the sampler appends to the sequence (a prefill continuation:
`SamplerEngine.continue_sequence`). A turn without a tool call ends the episode, which the
environment grades like a single-turn task (`reward` of the last turn's text). Limits:
`EnvConfig` (turns, calls per turn, tool output tokens, time); the episode's token budget is the
sampler request's `max_new_tokens`.

Where code runs: `parse_tool_calls` and the rendering run in the sampler's process (pure string
work); `call_tool` and `reward` run in the verifier worker processes (the environment is
pickled to them as a task is), so a tool that raises, hangs or floods cannot stop the run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

from rlax_pipe.tasks import base as task_base
from rlax_pipe.tasks.python_tool import PythonToolTask, SandboxConfig
from rlax_pipe.tasks.tools import ToolCall

# Outcome of one tool call: "ok"; "error" (it raised, or its worker died); "timeout" (no result
# within EnvConfig.tool_timeout_s; the worker is killed; or a time limit the tool enforces
# itself, `tasks.tools.ToolError`); "invalid" (not a str); "too_long" (over
# EnvConfig.max_tool_output_tokens tokens, or the tool's own output cap); "unknown" (no tool of
# that name); "resource" (a memory limit the tool enforces, e.g. the Python sandbox's).
TOOL_OUTCOMES: tuple[str, ...] = ("ok", "error", "timeout", "invalid", "too_long", "unknown",
                                  "resource")
TOOL_FAILURE_POLICIES: tuple[str, ...] = ("message", "end")
ADDED_TOOLS: tuple[str, ...] = ("", "python")  # EnvConfig.tool


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """Limits and failure handling of multi-turn episodes.

  Attributes:
    max_turns: model turns per episode (>= 1); a turn that still calls a tool at the limit ends
      the episode (graded on that turn's text).
    max_calls_per_turn: tool calls run per turn (>= 1); further calls in the same turn are
      answered with an error message.
    max_tool_output_tokens: tokens of one rendered tool result (>= 1); a longer result becomes
      an error message (outcome "too_long").
    tool_timeout_s: hard time limit of one wave of tool calls in the worker processes (seconds,
      > 0); a call still running is a "timeout" and its worker is killed.
    tool_workers: worker processes running tools at once (>= 1).
    on_tool_failure: what a failed call (error, timeout, invalid, too long, unknown tool) does:
      "message" = the model gets an error message as the tool's result and the episode goes on;
      "end" = the episode ends there (graded on the turn's text). Counted either way.
    tool: a tool added to a task without tools: "" (none) or "python" (the sandboxed Python
      tool, `rlax_pipe.tasks.python_tool`; the task becomes an environment).
    python: limits of the Python tool's snippets (`SandboxConfig`); its wall_s must be below
      tool_timeout_s.
  """

  max_turns: int = 4
  max_calls_per_turn: int = 2
  max_tool_output_tokens: int = 32
  tool_timeout_s: float = 5.0
  tool_workers: int = 1
  on_tool_failure: str = "message"
  tool: str = ""
  python: SandboxConfig = SandboxConfig()

  def __post_init__(self):
    for name in ("max_turns", "max_calls_per_turn", "max_tool_output_tokens", "tool_workers"):
      if getattr(self, name) < 1:
        raise ValueError(f"--config.env.{name}={getattr(self, name)} must be >= 1.")
    if not self.tool_timeout_s > 0:
      raise ValueError(f"--config.env.tool_timeout_s={self.tool_timeout_s} must be > 0 seconds.")
    if self.on_tool_failure not in TOOL_FAILURE_POLICIES:
      raise ValueError(f"--config.env.on_tool_failure={self.on_tool_failure!r}; choose one of "
                       f"{TOOL_FAILURE_POLICIES}.")
    if self.tool not in ADDED_TOOLS:
      raise ValueError(f"--config.env.tool={self.tool!r}; choose one of {ADDED_TOOLS}.")
    if self.tool == "python" and not self.python.wall_s < self.tool_timeout_s:
      raise ValueError(
          f"--config.env.python.wall_s={self.python.wall_s:g} must be below "
          f"--config.env.tool_timeout_s={self.tool_timeout_s:g}: the sandbox stops a snippet "
          "itself (an error message to the model) before the worker pool's hard limit kills "
          "the worker; raise tool_timeout_s or lower python.wall_s.")


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """The answer to one `ToolCall`.

  Attributes:
    call: the call.
    content: the text the model sees (the tool's output, or an error message when it failed).
    outcome: one of TOOL_OUTCOMES.
  """

  call: ToolCall
  content: str
  outcome: str

  @property
  def failed(self) -> bool:
    """Whether the call did not return a usable result."""
    return self.outcome != "ok"


@runtime_checkable
class Environment(task_base.Task, Protocol):
  """A task whose episodes may call tools (the `Task` protocol plus the methods below).

  It must be picklable by reference to an importable module (it runs in the verifier worker
  processes, as a task does).
  """

  def tool_names(self) -> tuple[str, ...]:
    """Names of the tools `call_tool` serves."""

  def call_tool(self, problem: task_base.Problem, call: ToolCall) -> str:
    """Runs one tool call in a worker process and returns its text output (may raise)."""


def is_environment(task: Any) -> bool:
  """Whether `task` implements the `Environment` protocol (has tools)."""
  return callable(getattr(task, "call_tool", None)) and callable(getattr(task, "tool_names", None))


def add_tool(task: Any, cfg: EnvConfig) -> Any:
  """`task` with the tool `cfg.tool` added (`PythonToolTask` for "python"), or `task` itself
  when `cfg.tool` is "".

  Raises:
    ValueError: when the task already has tools of its own.
  """
  if not cfg.tool:
    return task
  return PythonToolTask(task, cfg.python)
