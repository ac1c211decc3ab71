"""The built-in arithmetic task with a calculator tool (plain-text protocol).

An episode (prompt "Q: 3+5+2+7\\n" as in `rlax_pipe.tasks.arithmetic`):

    3+5+2+7=</s>          <- model turn 1: an expression line ending in "=", then a stop id
    17\\n                  <- the calculator's result (environment tokens, loss mask 0)
    A: 17</s>             <- model turn 2: no call, so the episode ends and is graded

A turn whose last non-empty line is an expression of integers joined by "+" / "-" and ending in
"=" calls the tool "calc"; `CALCULATOR_PROTOCOL` parses it and renders the result as
"<value>\\n". The model may still add up line by line as the single-turn task does (no call):
tool use is a choice the policy can learn. Reward: the arithmetic task's, on the last turn's
text. The calculator parses the expression itself (no `eval`), refuses expressions longer than
`MAX_EXPRESSION_CHARS` or with more than `MAX_TERMS` terms, and runs in the verifier worker
processes like every tool.
"""

from __future__ import annotations

import re

from rlax_pipe.tasks import base as task_base
from rlax_pipe.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from rlax_pipe.tasks.tools import ToolCall

MAX_EXPRESSION_CHARS = 256
MAX_TERMS = 64
_TERM = re.compile(r"([+-]?)\s*(\d{1,18})\s*")



def evaluate(expression: str) -> int:
  """The value of a sum of signed integers, e.g. "3+5-2" -> 6 (exact integer arithmetic).

  Raises:
    ValueError: on anything but integers joined by "+" / "-" (spaces allowed), more than
      MAX_TERMS terms, or more than MAX_EXPRESSION_CHARS characters.
  """
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
  text, pos, total, terms = expression.strip(), 0, 0, 0
  while pos < len(text):
    m = _TERM.match(text, pos)
    if m is None or (terms and not m.group(1)):
      raise ValueError(f"cannot read {text[pos:pos + 20]!r}")
    total += -int(m.group(2)) if m.group(1) == "-" else int(m.group(2))
    terms, pos = terms + 1, m.end()
    if terms > MAX_TERMS:
      raise ValueError(f"more than {MAX_TERMS} terms")
  if not terms:
    raise ValueError("empty expression")
  return total


class CalculatorArithmeticTask(ArithmeticTask):
  """The arithmetic task as an environment with one tool, "calc" (see the module docstring).

  Example:
    >>> env = CalculatorArithmeticTask()
    >>> env.call_tool(env.problem(0), ToolCall("calc", "3+5+2"))
    '10'
  """

  name = "arithmetic_calculator"
  # The plain-text protocol's call (`rlax_pipe.envs.PlainTextProtocol.call_pattern`): the last
  # line of a turn is a sum of integers ending in "=".
  call_pattern = r"(?P<arguments>[-+0-9 ]*[0-9][-+0-9 ]*)="

  def __init__(self, config: ArithmeticConfig = ArithmeticConfig()):
    super().__init__(config)

  def tool_names(self) -> tuple[str, ...]:
    """("calc",)."""
    return ("calc",)

  def tool_schemas(self) -> tuple[dict, ...]:
    """The JSON schema of "calc" (OpenAI function format), declared in chat prompts."""
    return ({"type": "function", "function": {
        "name": "calc", "description": "Exact value of a sum of integers, e.g. 3+5-2.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "description": "integers joined by + and -"}},
                       "required": ["expression"]}}},)

  def call_tool(self, problem: task_base.Problem, call: ToolCall) -> str:
    """The value of the call's expression as text (runs in a worker process). The arguments
    are the expression (plain-text protocol) or {"expression": ...} (chat tool calls).

    Raises:
      ValueError: for another tool, arguments without an expression, or an expression
        `evaluate` refuses.
    """
    del problem
    if call.name != "calc":
      raise ValueError(f"unknown tool {call.name!r}")
    args = call.arguments
    if isinstance(args, dict):
      if "expression" not in args:
        raise ValueError('calc needs {"expression": "<integers joined by + and ->"}')
      args = args["expression"]
    return str(evaluate(str(args)))

  def tool_solution(self, problem: task_base.Problem) -> tuple[str, str, str]:
    """A reference episode for warm starts: (turn 1 text, calculator result text, final turn
    text), e.g. ("3+5+2=", "10\\n", "A: 10"); each model turn ends with a stop id."""
    expression = problem.prompt.removeprefix("Q:").strip()
    return f"{expression}=", f"{evaluate(expression)}\n", f"{task_base.ANSWER_MARKER} {problem.answer}"
