"""Tool-call protocols: how a model turn's text becomes tool calls, and how tool results become
the tokens appended to the episode (rendered once; the model's tokens are never re-tokenized).

- `PlainTextProtocol`: for raw prompts and the built-in SentencePiece tokenizer. A call is the
  last non-empty line of the turn when it matches a regular expression; results are formatted
  text, encoded on their own (`Tokenizer.encode`) and appended after the turn's stop id.
- `CodeBlockProtocol`: for raw prompts with a code tool: a turn that ends with a ```python
  block calls it; the output is appended as a ```output block.
- `ChatToolProtocol`: for HF tokenizers whose chat template renders tool messages. Calls are
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the Hermes / Qwen format);
  results are "tool" messages rendered by the chat template. The tokens appended are the part of
  the rendering that follows the assistant turn's end-of-turn token: the template is rendered
  for a fixed probe conversation [user, assistant] with and without the tool messages (plus the
  generation prompt), and the difference after the assistant's end-of-turn token is taken. This
  is checked to be a pure suffix (a template that re-renders earlier turns differently once a
  tool message follows is refused with a clear error).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

from rlax_pipe.envs.base import ToolCall, ToolResult
from rlax_pipe.tasks.calculator import CalculatorArithmeticTask
from rlax_pipe.tokenizer import Tokenizer

_PROBE = ({"role": "user", "content": "u"}, {"role": "assistant", "content": "a"})


@dataclasses.dataclass(frozen=True)
class PlainTextProtocol:
  """Tool calls as one line of plain text.

  Attributes:
    call_pattern: regular expression matched in full (`re.fullmatch`) against the last non-empty
      line of the turn's text (stripped); group "arguments" is the call's argument string, an
      optional group "name" its tool name (else `default_name`).
    default_name: tool name when the pattern has no "name" group.
    result_format: text appended for a result; "{content}" is the result's text.
    error_format: text appended for a failed call; "{content}" is the error message.
  """

  call_pattern: str = r"(?P<name>[A-Za-z_]\w*)\((?P<arguments>.*)\)"
  default_name: str = ""
  result_format: str = "{content}\n"
  error_format: str = "error: {content}\n"

  def __post_init__(self):
    try:
      compiled = re.compile(self.call_pattern)
    except re.error as e:
      raise ValueError(f"PlainTextProtocol.call_pattern={self.call_pattern!r} is not a regular "
                       f"expression: {e}.") from e
    if "arguments" not in compiled.groupindex:
      raise ValueError(f"PlainTextProtocol.call_pattern={self.call_pattern!r} needs a named "
                       "group (?P<arguments>...).")

  def parse(self, text: str) -> list[ToolCall]:
    """The tool call of a turn (at most one: its last non-empty line), or [] (a final turn)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
      return []
    m = re.fullmatch(self.call_pattern, lines[-1])
    if m is None:
      return []
    name = m.groupdict().get("name") or self.default_name
    return [ToolCall(name, m.group("arguments"))]

  def render(self, tok: Tokenizer, results: Sequence[ToolResult]) -> list[int]:
    """Token ids of the results' text (encoded on its own, no special tokens added)."""
    text = "".join((self.error_format if r.failed else self.result_format).format(
        content=r.content) for r in results)
    return tok.encode(text)


@dataclasses.dataclass(frozen=True)
class ChatToolProtocol:
  """Tool calls in the chat template's format (see the module docstring).

  Attributes:
    tools: JSON-schema tool descriptions passed to the chat template (`tools=`), as a tuple.
    open_tag, close_tag: the markers around one JSON tool call in the assistant's text.
    tool_role: the role of result messages ("tool" for most templates).
    template_kwargs: extra chat-template variables as (name, value) pairs.
  """

  tools: tuple[Any, ...] = ()
  open_tag: str = "<tool_call>"
  close_tag: str = "</tool_call>"
  tool_role: str = "tool"
  template_kwargs: tuple[tuple[str, Any], ...] = ()

  def parse(self, text: str) -> list[ToolCall]:
    """Every `<tool_call>{json}</tool_call>` block of the turn, in order. A block that is not a
    JSON object with a string "name" becomes a call of the tool "" (answered "unknown")."""
    calls, start = [], 0
    while True:
      i = text.find(self.open_tag, start)
      if i < 0:
        return calls
      j = text.find(self.close_tag, i + len(self.open_tag))
      body = text[i + len(self.open_tag):j if j >= 0 else len(text)].strip()
      start = len(text) if j < 0 else j + len(self.close_tag)
      try:
        obj = json.loads(body)
        name = obj["name"]
        if not isinstance(name, str):
          raise TypeError(name)
        calls.append(ToolCall(name, obj.get("arguments", {})))
      except (ValueError, KeyError, TypeError):
        calls.append(ToolCall("", body))

  def prompt_ids(self, tok: Tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a conversation (e.g. [system?, user]) with the tools declared and the
    generation prompt: the prompt of an episode."""
    text = tok.apply_chat_template(list(messages), add_generation_prompt=True,
                                   tools=list(self.tools) or None, **dict(self.template_kwargs))
    return tok.encode_chat_text(text)

  def render(self, tok: Tokenizer, results: Sequence[ToolResult]) -> list[int]:
    """Token ids that follow the assistant turn's end-of-turn token: the tool messages and the
    next generation prompt, as the chat template renders them (see the module docstring).

    Raises:
      ValueError: when the tokenizer has no chat template, the template writes no stop id after
        an assistant message, or the rendering with tool messages does not extend the one
        without them (the template re-renders earlier turns).
    """
    kwargs = dict(tools=list(self.tools) or None, **dict(self.template_kwargs))
    probe = [dict(m) for m in _PROBE]
    base = tok.encode_chat_text(tok.apply_chat_template(probe, add_generation_prompt=False,
                                                        **kwargs))
    tool_msgs = [{"role": self.tool_role, "content": r.content, "name": r.call.name}
                 for r in results]
    full = tok.encode_chat_text(tok.apply_chat_template(probe + tool_msgs,
                                                        add_generation_prompt=True, **kwargs))
    stops = set(tok.stop_ids)
    ends = [k for k, t in enumerate(base) if t in stops]
    if not ends:
      raise ValueError(f"ChatToolProtocol: the chat template of {tok.source} writes no stop id "
                       f"{sorted(stops)} after an assistant message; tool results cannot be "
                       "appended after the turn. Use PlainTextProtocol.")
    k = ends[-1] + 1
    if full[:k] != base[:k]:
      raise ValueError(f"ChatToolProtocol: the chat template of {tok.source} renders the "
                       "conversation before a tool message differently from the conversation "
                       "alone; tool results cannot be appended without re-tokenizing earlier "
                       "turns.")
    return full[k:]


@dataclasses.dataclass(frozen=True)
class CodeBlockProtocol:
  """Tool calls as a fenced code block that ends the turn (tool-integrated reasoning on raw
  prompts, e.g. the Python tool of `rlax_pipe.tasks.python_tool`):

      Let me compute it.
      ```python
      print(3 + 5 + 2)
      ```</s>             <- the turn ends (a stop id) right after the block: a call
      ```output
      10
      ```                 <- the result, appended as environment tokens (loss mask 0)

  Attributes:
    language: the fence's language tag ("```python").
    tool: the tool called with {"code": <the block's text>}.
    result_format, error_format: text appended for a result / a failed call; "{content}" is
      its text with trailing newlines removed.
  """

  language: str = "python"
  tool: str = "python"
  result_format: str = "```output\n{content}\n```\n"
  error_format: str = "```output\n{content}\n```\n"

  def parse(self, text: str) -> list[ToolCall]:
    """The call of a turn whose text ends with a ```<language> block (the closing fence may
    be missing: a stop id can end the turn first), or [] (a final turn). A block followed by
    more text is not a call."""
    opening = f"```{self.language}"
    i = text.rfind(opening)
    if i < 0:
      return []
    rest = text[i + len(opening):]
    if not rest.startswith(("\n", "\r\n")):
      return []  # "```python3", "```pythonic": another tag
    j = rest.find("```")
    code = rest if j < 0 else rest[:j]
    if j >= 0 and rest[j + 3:].strip():
      return []
    code = code.strip("\r\n")
    return [ToolCall(self.tool, {"code": code})] if code.strip() else []

  def render(self, tok: Tokenizer, results: Sequence[ToolResult]) -> list[int]:
    """Token ids of the results' text (encoded on its own, no special tokens added)."""
    text = "".join((self.error_format if r.failed else self.result_format).format(
        content=r.content.rstrip("\n")) for r in results)
    return tok.encode(text)


# The calculator environment's protocol (`rlax_pipe.tasks.calculator`): a turn whose last line is
# a sum of integers ending in "=" calls "calc"; the result is appended as "<value>\n".
CALCULATOR_PROTOCOL = PlainTextProtocol(call_pattern=CalculatorArithmeticTask.call_pattern,
                                        default_name="calc", result_format="{content}\n",
                                        error_format="error: {content}\n")


def declare_tools(tok: Tokenizer, env) -> tuple[dict, ...] | None:
  """Makes "chat" prompts of `tok` declare `env`'s tool schemas (`Tokenizer.set_prompt_tools`,
  the chat template's `tools=`), as `ChatToolProtocol` renders tool results with them. No-op
  for raw prompts or an environment without `tool_schemas()`. A template that ignores `tools`
  (renders the same prompt with and without them) is left as is: nothing to declare.

  Returns:
    The declared schemas, or None when nothing was declared.
  """
  schemas = getattr(env, "tool_schemas", None)
  if tok.prompt_format.kind != "chat" or not callable(schemas):
    return None
  tools = tuple(schemas())
  probe = [{"role": "user", "content": "u"}]
  if not tools or tok.apply_chat_template(probe, tools=list(tools)) == tok.apply_chat_template(
      probe):
    return None  # the template has no place for tool schemas
  tok.set_prompt_tools(tools)
  return tools


def protocol_for(env, chat: bool = False):
  """The tool-call protocol of an environment: `ChatToolProtocol` with the environment's
  `tool_schemas()` (if it has them) for chat prompts; else `CodeBlockProtocol` when it has a
  `code_fence` language (the Python tool), else `PlainTextProtocol` with its
  `call_pattern` attribute and first tool name (if it has one), or the protocol's defaults."""
  if chat:
    schemas = getattr(env, "tool_schemas", None)
    return ChatToolProtocol(tools=tuple(schemas()) if callable(schemas) else ())
  fence = getattr(env, "code_fence", None)
  if fence is not None:
    return CodeBlockProtocol(language=fence, tool=env.tool_names()[0])
  pattern = getattr(env, "call_pattern", None)
  if pattern is None:
    return PlainTextProtocol()
  return PlainTextProtocol(call_pattern=pattern, default_name=env.tool_names()[0])
