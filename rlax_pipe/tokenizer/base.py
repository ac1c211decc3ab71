"""The `Tokenizer` interface every backend implements, and how prompts become token ids.

Backends: `SentencePieceTokenizer` (a `tokenizer.model`) and `HFTokenizer` (a `tokenizer.json` of
the HF `tokenizers` library); `load_tokenizer` picks one by what a path holds.

Conventions shared by every backend:

- `encode(text)` never adds a special token unless asked (`add_bos` / `add_eos`), and special-token
  text inside `text` follows the backend's rule (HF: added tokens such as "<|im_start|>" are
  matched as one id, as transformers does; SentencePiece: never, "<s>" is spelled out).
- `decode(ids)` skips BOS and PAD, and by default stops at the first id of `stop_ids` (every EOS
  and end-of-turn id), so a sampled completion decodes to its text only.
- Prompts are turned into ids by `encode_prompt`, in one of two formats (`PromptFormat`): "raw"
  (the text itself, with BOS when the tokenizer adds one by default) or "chat" (the text as the
  user message of the model's chat template, rendered with the generation prompt, as
  transformers' `apply_chat_template(..., add_generation_prompt=True)` does). The sampler gets
  these ids and the learner trains on the same ids plus the sampled completion ids: nothing is
  re-tokenised on the way.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
import dataclasses
import pathlib
from typing import Any

import numpy as np

from rlax_pipe.tokenizer import chat_template as chat_lib

PROMPT_FORMATS: tuple[str, ...] = ("raw", "chat")
# (open, close) markers of a reasoning block, as model families write them: Qwen3 / QwQ /
# DeepSeek-R1 "<think>", Anthropic-style "<thinking>", Mistral's Magistral "[THINK]", Cohere's
# "<|START_THINKING|>", GPT-OSS's analysis and final channels.
REASONING_MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"), ("<thinking>", "</thinking>"), ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<|channel|>analysis<|message|>", "<|channel|>final<|message|>"),
)


@dataclasses.dataclass(frozen=True)
class PromptFormat:
  """How a task's prompt text becomes prompt token ids.

  Attributes:
    kind: "raw" (the text as is, BOS prepended when the tokenizer adds one by default) or "chat"
      (the text is the content of a user message rendered with the tokenizer's chat template and
      its generation prompt; BOS only where the template writes it).
    system_prompt: optional system message placed before the user message ("chat" only).
    template_kwargs: extra variables for the chat template as (name, value) pairs (a dict is
      accepted and stored sorted), e.g. {"enable_thinking": False} for Qwen3 ("chat" only).
  """

  kind: str = "raw"
  system_prompt: str | None = None
  template_kwargs: Any = ()

  def __post_init__(self):
    if self.kind not in PROMPT_FORMATS:
      raise ValueError(f"PromptFormat.kind={self.kind!r}; choose one of {PROMPT_FORMATS}.")
    items = self.template_kwargs
    if isinstance(items, dict):
      items = tuple(sorted(items.items()))
    if not isinstance(items, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in items):
      raise ValueError(f"PromptFormat.template_kwargs={self.template_kwargs!r} must be a dict or "
                       "(name, value) pairs.")
    object.__setattr__(self, "template_kwargs", items)
    if items and self.kind != "chat":
      raise ValueError("PromptFormat.template_kwargs needs kind='chat'.")
    if self.system_prompt is not None and self.kind != "chat":
      raise ValueError("PromptFormat.system_prompt needs kind='chat' (a raw prompt has no system "
                       "message); prepend the text to the prompt instead.")


class Tokenizer(abc.ABC):
  """Text <-> token ids, special ids, and prompt rendering; see the module docstring.

  Subclasses implement `_encode_text`, `_decode_ids`, `id_to_piece` and the id properties.

  Attributes (read-only properties):
    vocab_size: number of ids; every id produced by `encode` is in [0, vocab_size).
    bos_id: beginning-of-sequence id, or -1 when the tokenizer has none.
    eos_id: the primary end-of-sequence id (always >= 0).
    stop_ids: tuple of every id that ends a completion (EOS first, then other EOS / end-of-turn
      ids, no duplicates); the sampler stops on any of them.
    pad_id: id used to pad batches (padding is masked, so any valid id works).
    add_bos_default: whether a raw prompt gets BOS (`encode_prompt` with kind "raw").
    chat_template: the chat template, or None when the tokenizer ships none.
    prompt_format: the `PromptFormat` `encode_prompt` uses by default.
    prompt_tools: JSON-schema tool descriptions that "chat" prompts declare (the template's
      `tools=`), set by `set_prompt_tools` for an environment's episodes; None = no tools.
  """

  def __init__(self, *, chat_template: chat_lib.ChatTemplate | None = None,
               prompt_format: PromptFormat = PromptFormat()):
    if prompt_format.kind == "chat" and chat_template is None:
      raise ValueError(f"{self.source}: prompt format 'chat' needs a chat template, and this "
                       "tokenizer has none (no 'chat_template' in tokenizer_config.json and no "
                       "chat_template.jinja); use PromptFormat('raw').")
    self._chat_template = chat_template
    self._prompt_format = prompt_format
    self._prompt_tools: tuple[dict, ...] | None = None

  # ---- backend ----------------------------------------------------------------------------------
  @property
  @abc.abstractmethod
  def source(self) -> pathlib.Path:
    """The file or directory this tokenizer was loaded from."""

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids (int)."""

  @property
  @abc.abstractmethod
  def bos_id(self) -> int:
    """Beginning-of-sequence id (int), -1 when the tokenizer has none."""

  @property
  @abc.abstractmethod
  def eos_id(self) -> int:
    """Primary end-of-sequence id (int >= 0)."""

  @property
  @abc.abstractmethod
  def stop_ids(self) -> tuple[int, ...]:
    """Every id that ends a completion (EOS first); see the class docstring."""

  @property
  @abc.abstractmethod
  def pad_id(self) -> int:
    """Padding id (int >= 0)."""

  @property
  @abc.abstractmethod
  def add_bos_default(self) -> bool:
    """Whether raw prompts get BOS."""

  @abc.abstractmethod
  def id_to_piece(self, token_id: int) -> str:
    """The vocabulary entry of one id (e.g. "<0xC3>", "Ġthe"); ValueError if out of range."""

  @abc.abstractmethod
  def _encode_text(self, text: str) -> list[int]:
    """Ids of `text` without any added BOS/EOS."""

  @abc.abstractmethod
  def _decode_ids(self, ids: list[int]) -> str:
    """Text of `ids` (already validated and stripped of BOS/PAD/stops)."""

  def _encode_texts(self, texts: list[str]) -> list[list[int]]:
    """Batch form of `_encode_text`; backends with a parallel batch encoder override it."""
    return [self._encode_text(t) for t in texts]

  def encode_chat_text(self, text: str) -> list[int]:
    """Ids of rendered chat-template text, whose special-token texts ("<s>", "<|im_start|>")
    become their ids (no BOS added). HF tokenizers match added tokens in any text, so this is
    `encode`; SentencePiece maps its special tokens here only."""
    return self.encode(text)

  # ---- shared ----------------------------------------------------------------------------------
  @property
  def chat_template(self) -> chat_lib.ChatTemplate | None:
    """The chat template, or None."""
    return self._chat_template

  @property
  def prompt_format(self) -> PromptFormat:
    """Default `PromptFormat` of `encode_prompt`."""
    return self._prompt_format

  @property
  def reasoning_markers(self) -> tuple[str, str] | None:
    """The (open, close) markers of the model's reasoning block, or None when it has none.

    The first pair of `REASONING_MARKERS` that the chat template writes (both strings in its
    source, e.g. Qwen3's and DeepSeek-R1's "<think>" / "</think>"), else whose strings are both
    single tokens of the vocabulary (added tokens). The shipped character-level tokenizer has
    none. Grading reads only the text after the block (`rlax_pipe.grading`).
    """
    source = self._chat_template.source if self._chat_template is not None else ""
    for pair in REASONING_MARKERS:
      if all(m in source for m in pair):
        return pair
    for pair in REASONING_MARKERS:
      if all(len(self.encode(m)) == 1 for m in pair):
        return pair
    return None

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Encodes one string.

    Args:
      text: any Python string (lone surrogates, which are not valid Unicode text, excepted).
      add_bos: prepend `bos_id`.
      add_eos: append `eos_id`.

    Returns:
      list[int] of ids in [0, vocab_size).

    Raises:
      TypeError: when `text` is not a str.
      ValueError: when `add_bos` is set and the tokenizer has no BOS.
    """
    self._check_text(text)
    return self._wrap(self._encode_text(text), add_bos, add_eos)

  def encode_batch(self, texts: Iterable[str], *, add_bos: bool = False,
                   add_eos: bool = False) -> list[list[int]]:
    """`encode` of each string (HF: the parallel batch encoder); one list[int] per string."""
    texts = list(texts)
    for t in texts:
      self._check_text(t)
    return [self._wrap(ids, add_bos, add_eos) for ids in self._encode_texts(texts)]

  def decode(self, ids: Sequence[int] | np.ndarray, *, stop_at_eos: bool = True) -> str:
    """Decodes one id sequence.

    BOS and PAD ids are skipped wherever they occur. With `stop_at_eos`, decoding stops at the first
    id of `stop_ids` (exclusive), so a padded or over-generated row decodes to its text only;
    otherwise stop ids are skipped like BOS and PAD. Bytes that do not form valid UTF-8 (possible
    in model samples) decode to U+FFFD.

    Args:
      ids: int sequence or 1-D integer array [T].
      stop_at_eos: stop at the first stop id.

    Returns:
      The decoded string.

    Raises:
      ValueError: when an id is outside [0, vocab_size) or `ids` is not 1-D.
    """
    ids = self._as_id_list(ids)
    stops = set(self.stop_ids)
    if stop_at_eos:
      for k, i in enumerate(ids):
        if i in stops:
          ids = ids[:k]
          break
    skip = {self.bos_id, self.pad_id} | stops
    return self._decode_ids([i for i in ids if i not in skip])

  def decode_batch(self, batch: Iterable[Sequence[int]] | np.ndarray, *,
                   stop_at_eos: bool = True) -> list[str]:
    """`decode` applied to each row of a ragged list or of an int array [B, T] (e.g. padded)."""
    return [self.decode(row, stop_at_eos=stop_at_eos) for row in batch]

  def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                          **kwargs) -> str:
    """Renders messages with the chat template (see `chat_template.ChatTemplate.render`).

    Raises:
      ValueError: when the tokenizer has no chat template or the messages are malformed.
    """
    if self._chat_template is None:
      raise ValueError(f"{self.source} has no chat template (no 'chat_template' in "
                       "tokenizer_config.json and no chat_template.jinja).")
    return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                      **kwargs)

  @property
  def prompt_tools(self) -> tuple[dict, ...] | None:
    """The tool schemas "chat" prompts declare (`set_prompt_tools`), or None."""
    return self._prompt_tools

  def set_prompt_tools(self, tools: Sequence[dict] | None) -> None:
    """Declares tools in every "chat" prompt `encode_prompt` renders from now on: the chat
    template gets `tools=list(tools)` (as transformers' `apply_chat_template(tools=...)`), so
    the model sees the schemas of the tools its episodes may call. None or () = no tools. Raw
    prompts are unchanged (a raw prompt has no place for schemas)."""
    self._prompt_tools = tuple(tools) if tools else None

  def encode_prompt(self, prompt: str, prompt_format: PromptFormat | None = None) -> list[int]:
    """Token ids of a task prompt in `prompt_format` (default: `self.prompt_format`).

    "raw": `encode(prompt, add_bos=add_bos_default)`. "chat": the template rendered for
    [system?, user=prompt] with the generation prompt, `template_kwargs` and the declared
    `prompt_tools` (as `tools=`, when set), encoded without adding BOS (the template writes BOS
    where the model expects it), as transformers does for `tokenize=True`.

    Args:
      prompt: the prompt text.
      prompt_format: overrides the tokenizer's default format.

    Returns:
      list[int], non-empty.

    Raises:
      ValueError: for "chat" without a chat template, or an empty result.
    """
    fmt = prompt_format or self._prompt_format
    if fmt.kind == "raw":
      ids = self.encode(prompt, add_bos=self.add_bos_default)
    else:
      messages = ([{"role": "system", "content": fmt.system_prompt}]
                  if fmt.system_prompt is not None else [])
      messages.append({"role": "user", "content": prompt})
      tools = {} if self._prompt_tools is None else {"tools": list(self._prompt_tools)}
      ids = self.encode_chat_text(self.apply_chat_template(
          messages, add_generation_prompt=True, **tools, **dict(fmt.template_kwargs)))
    if not ids:
      raise ValueError(f"prompt {prompt!r} encodes to no token (format {fmt.kind!r}, no BOS); "
                       "a completion needs at least one prompt token to condition on.")
    return ids

  # ---- helpers ---------------------------------------------------------------------------------
  @staticmethod
  def _check_text(text) -> None:
    if not isinstance(text, str):
      raise TypeError(f"Tokenizer.encode expects str, got {type(text).__name__}.")

  def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
    if add_bos:
      if self.bos_id < 0:
        raise ValueError(f"{self.source} defines no BOS token; call encode with add_bos=False.")
      ids = [self.bos_id] + ids
    if add_eos:
      ids = ids + [self.eos_id]
    return ids

  def _as_id_list(self, ids: Sequence[int] | np.ndarray) -> list[int]:
    if isinstance(ids, np.ndarray):
      if ids.ndim != 1:
        raise ValueError(f"decode expects a 1-D id array, got shape {ids.shape}.")
      ids = ids.tolist()
    ids = [int(i) for i in ids]
    self._check_ids(ids)
    return ids

  def _check_ids(self, ids: Sequence[int]) -> None:
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"Token ids {bad[:5]} are outside [0, {self.vocab_size}) for {self.source}.")
