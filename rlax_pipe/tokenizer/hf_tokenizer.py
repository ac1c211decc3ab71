"""HF `tokenizers` backend of `Tokenizer`: a `tokenizer.json` plus the HF files around it.

An HF model directory describes its tokenizer in up to four files, all read here:

- `tokenizer.json`: the tokenizer itself (vocabulary, merges, pre-tokenizer, added tokens), loaded
  with the `tokenizers` library (Llama 3, Qwen2/2.5/3 ship byte-level BPE);
- `tokenizer_config.json`: the named special tokens (`bos_token`, `eos_token`, `pad_token`, ...,
  as strings or AddedToken dicts), `add_bos_token`, and the `chat_template`;
- `chat_template.jinja`: the chat template, where newer transformers save it;
- `generation_config.json`: `eos_token_id` (an int or a list: chat models declare several, e.g.
  end-of-text and end-of-turn), `bos_token_id`, `pad_token_id`.

Special ids: BOS = `bos_token` of tokenizer_config, else (when tokenizer_config does not mention it)
`bos_token_id` of generation_config, else none (-1; Qwen declares `"bos_token": null`). EOS =
`eos_token` of tokenizer_config, else the first `eos_token_id`.
`stop_ids` = EOS, then every `eos_token_id` of generation_config, then the end-of-turn token of the
chat template (the added token the template writes right after an assistant message, e.g.
"<|im_end|>"), without duplicates. PAD = `pad_token`, else `pad_token_id`, else EOS (padding is
masked, so any valid id works).

Round trips: for a byte-level BPE without a normalizer (the usual `tokenizer.json` of Llama 3 and
Qwen) `decode(encode(s)) == s` exactly for every string; text containing an added token's content
(e.g. "<|im_start|>") encodes it as that one id, as transformers does.
"""

from __future__ import annotations

from collections.abc import Sequence
import json
import os
import pathlib

import tokenizers

from rlax_pipe.tokenizer import base
from rlax_pipe.tokenizer import chat_template as chat_lib

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Named special tokens that transformers passes to chat templates.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


def read_json(path: pathlib.Path) -> dict:
  """The JSON object in `path`, {} when the file is absent.

  Raises:
    ValueError: naming the file, when it is not a JSON object.
  """
  if not path.is_file():
    return {}
  try:
    obj = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(obj, dict):
    raise ValueError(f"{path} must hold a JSON object, got {type(obj).__name__}.")
  return obj


def token_text(value) -> str | None:
  """The string of a special-token entry: a str, an AddedToken dict ({"content": ...}) or None."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  raise ValueError(f"special token entry {value!r:.80} is neither a string nor "
                   '{"content": ...}.')


def load_chat_template(directory: pathlib.Path, tokenizer_config: dict,
                       special_tokens: dict[str, str]) -> chat_lib.ChatTemplate | None:
  """The chat template of an HF directory (tokenizer_config.json first, then chat_template.jinja).

  A list of named templates (`[{"name": ..., "template": ...}]`) gives the one named "default".

  Raises:
    ValueError: when the entry is malformed or the template does not compile.
  """
  source = tokenizer_config.get("chat_template")
  if isinstance(source, list):
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    if "default" not in named:
      raise ValueError(f"{directory / TOKENIZER_CONFIG_FILE}: chat_template lists "
                       f"{sorted(named)} but no 'default' template.")
    source = named["default"]
  if source is None and (directory / CHAT_TEMPLATE_FILE).is_file():
    source = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
  if source is None:
    return None
  return chat_lib.ChatTemplate(source, special_tokens)


def as_id_list(value, where: str) -> list[int]:
  """[] for None, [v] for an int, the list for a list of ints; else ValueError naming `where`."""
  if value is None:
    return []
  values = value if isinstance(value, list) else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
    raise ValueError(f"{where} must be an int or a list of ints, got {value!r}.")
  return list(values)


class HFTokenizer(base.Tokenizer):
  """A `tokenizer.json` (HF `tokenizers`) behind the `Tokenizer` interface; see the module doc.

  Example:
    >>> tok = HFTokenizer("path/to/Qwen2.5-0.5B-Instruct")
    >>> tok.stop_ids                      # <|im_end|>, <|endoftext|>
    (151645, 151643)
  """

  def __init__(self, path: str | os.PathLike[str], *,
               prompt_format: base.PromptFormat = base.PromptFormat()):
    """Loads the tokenizer of an HF directory (or the directory of a `tokenizer.json` path).

    Args:
      path: an HF model/tokenizer directory holding `tokenizer.json`, or that file.
      prompt_format: default format of `encode_prompt`.

    Raises:
      FileNotFoundError: when there is no `tokenizer.json`.
      ValueError: when a file is malformed, a named special token is not in the vocabulary, or no
        EOS is declared anywhere.
    """
    path = pathlib.Path(path)
    directory = path if path.is_dir() else path.parent
    file = directory / TOKENIZER_FILE
    if not file.is_file():
      raise FileNotFoundError(f"no {TOKENIZER_FILE} in {directory}.")
    self._dir = directory
    try:
      self._tk = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception type for malformed files
      raise ValueError(f"{file} is not a tokenizers file: {e}") from e
    config = read_json(directory / TOKENIZER_CONFIG_FILE)
    generation = read_json(directory / GENERATION_CONFIG_FILE)
    self._declared = {name for name in SPECIAL_TOKEN_NAMES if name in config}
    self._special = {name: token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    self._special = {k: v for k, v in self._special.items() if v is not None}
    self._bos = self._named_id("bos_token", generation.get("bos_token_id"), -1)
    gen_eos = as_id_list(generation.get("eos_token_id"), f"{directory / GENERATION_CONFIG_FILE}"
                          ": eos_token_id")
    self._eos = self._named_id("eos_token", gen_eos[0] if gen_eos else None, -1)
    if self._eos < 0:
      raise ValueError(f"{directory} declares no EOS: set 'eos_token' in {TOKENIZER_CONFIG_FILE} "
                       f"or 'eos_token_id' in {GENERATION_CONFIG_FILE}; generation needs one to "
                       "stop.")
    self._pad = self._named_id("pad_token", generation.get("pad_token_id"), self._eos)
    template = load_chat_template(directory, config, self._special)
    end_of_turn = self._end_of_turn_id(template)
    self._stop_ids = tuple(dict.fromkeys(
        [self._eos] + gen_eos + ([end_of_turn] if end_of_turn is not None else [])))
    self._check_ids(list(self._stop_ids) + [self._pad] + ([self._bos] if self._bos >= 0 else []))
    add_bos = config.get("add_bos_token")
    self._add_bos = (bool(add_bos) if isinstance(add_bos, bool)
                     else self._bos >= 0 and self._post_processor_adds_bos())
    super().__init__(chat_template=template, prompt_format=prompt_format)

  def _named_id(self, name: str, fallback: int | None, default: int) -> int:
    """The id of tokenizer_config's `name`; if it does not mention `name` at all, `fallback`
    (from generation_config.json); else (declared null, or no fallback) `default`."""
    text = self._special.get(name)
    if text is not None:
      token_id = self._tk.token_to_id(text)
      if token_id is None:
        raise ValueError(f"{self._dir / TOKENIZER_CONFIG_FILE}: {name}={text!r} is not in the "
                         f"vocabulary of {TOKENIZER_FILE}.")
      return int(token_id)
    if name in self._declared or fallback is None:
      return default
    return int(fallback)

  def _post_processor_adds_bos(self) -> bool:
    with_specials = self._tk.encode("a", add_special_tokens=True).ids
    return bool(with_specials) and with_specials[0] == self._bos and (
        self._tk.encode("a", add_special_tokens=False).ids[:1] != [self._bos])

  def _end_of_turn_id(self, template: chat_lib.ChatTemplate | None) -> int | None:
    """The first added token the template writes after an assistant message (whitespace skipped)."""
    text = template.end_of_turn_text() if template is not None else None
    if not text:
      return None
    added = set(self._tk.get_added_tokens_decoder())
    for token_id in self._tk.encode(text, add_special_tokens=False).ids:
      if self._tk.decode([token_id], skip_special_tokens=False).strip():
        return int(token_id) if token_id in added else None
    return None

  @property
  def source(self) -> pathlib.Path:
    """The directory holding `tokenizer.json`."""
    return self._dir

  @property
  def special_tokens(self) -> dict[str, str]:
    """Named special tokens of tokenizer_config.json as strings, e.g. {"eos_token": "</s>"}."""
    return dict(self._special)

  @property
  def vocab_size(self) -> int:
    """Number of ids, added tokens included (int)."""
    return int(self._tk.get_vocab_size(with_added_tokens=True))

  @property
  def bos_id(self) -> int:
    """Beginning-of-sequence id, -1 when none is declared."""
    return self._bos

  @property
  def eos_id(self) -> int:
    """Primary end-of-sequence id."""
    return self._eos

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """EOS, every generation_config EOS id, the template's end-of-turn id (module docstring)."""
    return self._stop_ids

  @property
  def pad_id(self) -> int:
    """Padding id (`pad_token`, else `pad_token_id`, else EOS)."""
    return self._pad

  @property
  def add_bos_default(self) -> bool:
    """`add_bos_token` of tokenizer_config.json, else whether the post-processor prepends BOS."""
    return self._add_bos

  def id_to_piece(self, token_id: int) -> str:
    """The vocabulary entry of one id (byte-level form, e.g. "Ġthe"); ValueError if out of
    range."""
    self._check_ids([token_id])
    return self._tk.id_to_token(int(token_id))

  def _encode_text(self, text: str) -> list[int]:
    return list(self._tk.encode(text, add_special_tokens=False).ids)

  def _encode_texts(self, texts: list[str]) -> list[list[int]]:
    return [list(e.ids) for e in self._tk.encode_batch(texts, add_special_tokens=False)]

  def _decode_ids(self, ids: Sequence[int]) -> str:
    return self._tk.decode(list(ids), skip_special_tokens=False)
