"""Chat templates: the Jinja template of an HF tokenizer, rendered the way transformers renders it.

A model's chat template is a Jinja2 program stored in `tokenizer_config.json` ("chat_template",
a string or a list of named templates) or in `chat_template.jinja`. transformers renders it in a
sandboxed Jinja environment with these settings, which `ChatTemplate` reproduces (documented in
the transformers guide "Templates for chat models", section on writing templates):

- `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the `loopcontrols`
  extension (`{% break %}`, `{% continue %}`);
- a `tojson` filter that does not escape HTML (json.dumps with ensure_ascii=False and the
  `indent`, `separators`, `sort_keys` options);
- the globals `raise_exception(message)` (raises a template error) and `strftime_now(format)`;
- the `{% generation %}...{% endgeneration %}` block (marks assistant text; rendered as its body);
- the variables `messages`, `add_generation_prompt`, `tools`, `documents` and the tokenizer's
  named special tokens as strings (`bos_token`, `eos_token`, `pad_token`, `unk_token`, ...).

The rendered text is then encoded without adding BOS (the template writes it where the model
expects it), as `apply_chat_template(..., tokenize=True)` does.
"""

from __future__ import annotations

from collections.abc import Sequence
import datetime
import json

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2 import sandbox


class _GenerationBlock(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def _environment() -> sandbox.ImmutableSandboxedEnvironment:
  env = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


def _check_messages(messages) -> list[dict]:
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
    raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                     f"got {messages!r:.80}.")
  out = []
  for k, m in enumerate(messages):
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
      raise ValueError(f"message {k} must be a dict with 'role' and 'content', got {m!r:.80}.")
    out.append({key: value for key, value in m.items() if value is not None})
  return out


class ChatTemplate:
  """A compiled chat template plus the special-token strings it may refer to.

  Example:
    >>> t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    ...                  "{% if add_generation_prompt %}<assistant>{% endif %}")
    >>> t.render([{"role": "user", "content": "hi"}])
    '<user>hi<assistant>'
  """

  def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
    """Compiles `source`.

    Args:
      source: the Jinja2 template text.
      special_tokens: named special tokens visible to the template, e.g. {"bos_token": "<s>"}.

    Raises:
      ValueError: when `source` is not a string or does not compile (the message has the line).
    """
    if not isinstance(source, str) or not source.strip():
      raise ValueError(f"chat template must be a non-empty string, got {source!r:.80}.")
    try:
      self._template = _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
      raise ValueError(f"chat template does not compile (line {e.lineno}): {e.message}") from e
    self.source = source
    self.special_tokens = dict(special_tokens or {})

  def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, documents: list[dict] | None = None,
             **kwargs) -> str:
    """The conversation as the model sees it.

    Args:
      messages: list of {"role": str, "content": ...} dicts (None-valued keys are dropped, as
        transformers does).
      add_generation_prompt: append the header that starts an assistant turn.
      tools, documents: passed to the template as is (JSON-schema dicts / document dicts).
      **kwargs: extra template variables; they override special tokens of the same name.

    Returns:
      The rendered text.

    Raises:
      ValueError: on malformed messages, or when the template raises (e.g. via
        `raise_exception`) or fails; the message says which.
    """
    messages = _check_messages(messages)
    variables = {**self.special_tokens, **kwargs}
    try:
      return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   tools=tools, documents=documents, **variables)
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"chat template failed: {e}") from e

  def end_of_turn_text(self) -> str | None:
    """The text the template writes right after an assistant message's content, or None.

    Found by rendering [user "u", assistant <sentinel>] and reading what follows the sentinel
    (e.g. "<|im_end|>\\n" for ChatML templates, "<|eot_id|>" for Llama 3). A template that
    refuses this conversation gives None.
    """
    sentinel = "\u2063rlax-pipe-end-of-turn-probe\u2063"
    try:
      text = self.render([{"role": "user", "content": "u"},
                          {"role": "assistant", "content": sentinel}],
                         add_generation_prompt=False)
    except ValueError:
      return None
    at = text.rfind(sentinel)
    return text[at + len(sentinel):] if at >= 0 else None
