"""Tool calls in the verifier worker processes, with a hard time limit and an output limit.

`ToolPool` sends an environment (`rlax_pipe.envs.base.Environment`) to `VerifierPool` workers
once and runs `env.call_tool(problem, call)` there in waves sharing one deadline
(`EnvConfig.tool_timeout_s`): a tool that hangs is killed with its worker, one that raises or
returns a non-string is an error, and a result longer than `EnvConfig.max_tool_output_tokens`
tokens is refused. A tool may answer with its own error message (`tasks.tools.ToolError`, e.g.
the Python sandbox's traceback), kept to the token limit by its tail. Each failure becomes a
`ToolResult` whose content is an error message for the model; nothing is raised into the run.
Outcomes are counted (`counts`).
"""

from __future__ import annotations

from typing import Sequence

from rlax_pipe.envs.base import EnvConfig, TOOL_OUTCOMES, ToolCall, ToolResult
from rlax_pipe.tasks import base as task_base
from rlax_pipe.tasks import safe_reward
from rlax_pipe.tasks.verifier_pool import VerifierPool
from rlax_pipe.tokenizer import Tokenizer


class ToolPool:
  """Runs tool calls of one environment in worker processes (see the module docstring).

  Args:
    env: the environment (picklable by reference to an importable module).
    cfg: limits (`tool_timeout_s`, `tool_workers`, `max_tool_output_tokens`).
    tok: the tokenizer that measures a result's length in tokens.

  Raises:
    ValueError: when the environment cannot be sent to a worker process (`VerifierPool`).
  """

  def __init__(self, env, cfg: EnvConfig, tok: Tokenizer):
    self.env, self.cfg, self.tok = env, cfg, tok
    self.names = tuple(env.tool_names())
    self._pool = VerifierPool(env, timeout_s=cfg.tool_timeout_s, num_workers=cfg.tool_workers)
    self.counts = {k: 0 for k in TOOL_OUTCOMES}

  @property
  def restarts(self) -> int:
    """Workers killed because a tool hung or its process died."""
    return self._pool.restarts

  def close(self) -> None:
    """Ends the worker processes (idempotent)."""
    self._pool.close()

  def run(self, items: Sequence[tuple[task_base.Problem, ToolCall]]) -> list[ToolResult]:
    """One `ToolResult` per (problem, call), in order; failures carry an error message.

    Raises:
      RuntimeError: when the worker processes cannot be started at all.
    """
    out: list[ToolResult | None] = [None] * len(items)
    todo = []
    for k, (problem, call) in enumerate(items):
      if call.name not in self.names:
        out[k] = ToolResult(call, f"unknown tool {call.name!r}; tools: "
                                  f"{', '.join(self.names)}", "unknown")
      else:
        todo.append(k)
    replies = self._pool.run_calls([items[k] for k in todo], "tool") if todo else []
    limit = self.cfg.max_tool_output_tokens
    for k, (value, outcome, detail) in zip(todo, replies):
      call = items[k][1]
      if detail == safe_reward.TOOL_MESSAGE:  # the tool's own message (`tools.ToolError`)
        out[k] = ToolResult(call, self._fit(value), outcome)
      elif outcome == "ok":
        n = len(self.tok.encode(value))
        out[k] = (ToolResult(call, value, "ok") if n <= limit else
                  ToolResult(call, f"output too long ({n} tokens > {limit})", "too_long"))
      elif outcome == "too_long":
        out[k] = ToolResult(call, f"output too long ({detail} > {limit} tokens)", "too_long")
      elif outcome == "timeout":
        out[k] = ToolResult(call, f"timed out after {self.cfg.tool_timeout_s:g} s", "timeout")
      else:
        out[k] = ToolResult(call, f"tool failed: {detail}"[:200], outcome)
    for r in out:
      self.counts[r.outcome] += 1
    return out

  def _fit(self, message: str) -> str:
    """`message`, or its tail after "...", within `max_tool_output_tokens` tokens (a traceback's
    last lines say the most)."""
    limit = self.cfg.max_tool_output_tokens
    ids = self.tok.encode(message)
    keep = limit - len(self.tok.encode("..."))
    while len(ids) > limit and keep > 0:
      message = "..." + self.tok.decode(ids[-keep:])
      ids, keep = self.tok.encode(message), keep - 1
    return message if len(ids) <= limit else ""
