"""SentencePiece backend of `Tokenizer`: loads any `tokenizer.model`; trains the shipped one.

The tokenizer shipped in `rlax_pipe/assets/tokenizer.model` (see `default_tokenizer`) was trained by
`experiments/train_tokenizer.py` on text of the built-in arithmetic task. It is a character-level
SentencePiece model with these properties (all set by `train_tokenizer`):

- ids 0..3 are `<pad>`, `<unk>`, `<s>` (BOS), `</s>` (EOS); id 4 is the user-defined piece "\\n",
  so a newline is one token and is never normalized away;
- identity normalization, no dummy prefix, no whitespace collapsing: `decode(encode(s)) == s`
  exactly for every string `s` (runs of spaces, tabs, "\\r\\n", leading/trailing spaces);
- digits are split into single tokens (`split_digits`), which the arithmetic traces rely on;
- byte fallback: a character outside the training alphabet (letters, "é", "∑", emoji, ...) is
  spelled as its UTF-8 bytes, one byte piece each, so nothing ever maps to `<unk>`.

Byte fallback costs 256 pieces: the shipped vocabulary is 5 special pieces + 256 byte pieces + the
17 characters of the arithmetic alphabet = 278 ids. With tied embeddings at d_model 128 the byte rows
are 33k parameters, negligible next to the tiny model, and every ASCII character still costs exactly
one token, so a bigger character inventory would not shorten any sequence.

SentencePiece itself maps the space character to the meta symbol "▁" (U+2581), so a literal "▁" in
the input would decode as a space. `SentencePieceTokenizer` spells a literal "▁" with its byte pieces instead,
which keeps the round trip exact; this needs a model with byte pieces.

Reference: Kudo & Richardson, "SentencePiece: A simple and language independent subword tokenizer
and detokenizer for Neural Text Processing", EMNLP 2018 (demo track).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import importlib.resources
import os
import pathlib
import re

import sentencepiece as spm

from rlax_pipe.tokenizer import base
from rlax_pipe.tokenizer import chat_template as chat_lib

# The meta symbol SentencePiece uses for a space inside its pieces.
_META_SPACE = "\u2581"

# Special ids of every tokenizer trained by `train_tokenizer`.
PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
NEWLINE_PIECE = "\n"


class SentencePieceTokenizer(base.Tokenizer):
  """A SentencePiece model behind the `Tokenizer` interface, with exact round trips.

  `stop_ids` is (eos_id,) plus any further EOS ids given (e.g. from `generation_config.json`).
  Raw prompts get BOS whenever the model has a BOS piece (`add_bos_default`), unless told otherwise.

  `encode` spells special-token text out ("<s>" is three pieces); only the text of a rendered chat
  template has its special tokens (the model's control pieces and `special_tokens` given, e.g.
  bos_token "<s>" of tokenizer_config.json) mapped to their ids, as transformers' SentencePiece
  tokenizers do.

  Example:
    >>> tok = default_tokenizer()
    >>> ids = tok.encode("Q: 3+5\\n", add_bos=True)
    >>> tok.decode(ids + [tok.eos_id, 7, 7])   # BOS skipped, stops at EOS
    'Q: 3+5\\n'
  """

  def __init__(self, model_path: str | os.PathLike[str], *, pad_id: int | None = None,
               extra_stop_ids: Sequence[int] = (), add_bos: bool | None = None,
               chat_template: chat_lib.ChatTemplate | None = None,
               special_tokens: Sequence[str] = (),
               prompt_format: base.PromptFormat = base.PromptFormat()):
    """Loads a SentencePiece model file.

    Args:
      model_path: path of a `*.model` file written by SentencePiece (ours or anyone's).
      pad_id: padding id to use when the model defines no `<pad>` piece; ignored otherwise.
        Without either, the unk id pads (padding is masked, so any valid id works).
      extra_stop_ids: further ids that end a completion (other EOS / end-of-turn ids).
      add_bos: whether raw prompts get BOS; None = whenever the model has a BOS piece.
      chat_template: the model's chat template, if any.
      special_tokens: special-token texts of rendered chat templates besides the model's
        control pieces (each must be a piece of the model).
      prompt_format: default format of `encode_prompt`.

    Raises:
      FileNotFoundError: when `model_path` does not exist.
      ValueError: when the file is not a SentencePiece model, the model has no EOS piece, or
        `pad_id` / a stop id / a special token is not in the model.
    """
    path = pathlib.Path(model_path)
    if not path.is_file():
      raise FileNotFoundError(f"Tokenizer model not found: {path}")
    self._path = path
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.load(str(path))
    except (OSError, RuntimeError) as e:
      raise ValueError(f"{path} is not a SentencePiece model: {e}") from e
    self._vocab_size = int(self._sp.get_piece_size())
    if self._sp.eos_id() < 0:
      raise ValueError(f"{path} defines no EOS piece; generation needs one to stop.")
    if self._sp.pad_id() >= 0:
      self._pad_id = int(self._sp.pad_id())
    elif pad_id is not None:
      if not 0 <= pad_id < self._vocab_size:
        raise ValueError(f"pad_id={pad_id} is outside [0, {self._vocab_size}).")
      self._pad_id = int(pad_id)
    else:
      self._pad_id = int(self._sp.unk_id())
    self._check_ids(list(extra_stop_ids))
    self._stop_ids = tuple(dict.fromkeys([int(self._sp.eos_id())] + [int(i) for i in
                                                                       extra_stop_ids]))
    self._add_bos = self._sp.bos_id() >= 0 if add_bos is None else bool(add_bos)
    meta_bytes = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _META_SPACE.encode("utf-8")]
    has_bytes = all(self._sp.is_byte(i) for i in meta_bytes)
    self._meta_space_ids = meta_bytes if has_bytes else None
    self._special = {self._sp.id_to_piece(i): i for i in range(self._vocab_size)
                     if self._sp.is_control(i)}
    for text in special_tokens:
      token_id = self._sp.piece_to_id(text)
      if self._sp.id_to_piece(token_id) != text:
        raise ValueError(f"special token {text!r} is not a piece of {path}.")
      self._special[text] = int(token_id)
    self._special_re = re.compile("(" + "|".join(
        re.escape(t) for t in sorted(self._special, key=len, reverse=True)) + ")")
    super().__init__(chat_template=chat_template, prompt_format=prompt_format)

  @property
  def path(self) -> pathlib.Path:
    """The model file this tokenizer was loaded from."""
    return self._path

  @property
  def source(self) -> pathlib.Path:
    """The model file this tokenizer was loaded from."""
    return self._path

  @property
  def vocab_size(self) -> int:
    """Number of ids (int)."""
    return self._vocab_size

  @property
  def bos_id(self) -> int:
    """Beginning-of-sequence id (int), -1 when the model has none."""
    return int(self._sp.bos_id())

  @property
  def eos_id(self) -> int:
    """End-of-sequence id (int)."""
    return int(self._sp.eos_id())

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """(eos_id, *extra_stop_ids), without duplicates."""
    return self._stop_ids

  @property
  def pad_id(self) -> int:
    """Padding id (int); see `__init__` for the rule when the model has no `<pad>`."""
    return self._pad_id

  @property
  def add_bos_default(self) -> bool:
    """Whether raw prompts get BOS."""
    return self._add_bos

  def id_to_piece(self, token_id: int) -> str:
    """The SentencePiece piece of one id, e.g. "<0xC3>" or "7"; ValueError if out of range."""
    self._check_ids([token_id])
    return self._sp.id_to_piece(int(token_id))

  def _encode_text(self, text: str) -> list[int]:
    if self._meta_space_ids is None or _META_SPACE not in text:
      return list(self._sp.encode(text))
    ids: list[int] = []
    for k, segment in enumerate(text.split(_META_SPACE)):
      if k:
        ids.extend(self._meta_space_ids)
      ids.extend(self._sp.encode(segment))
    return ids

  def _decode_ids(self, ids: list[int]) -> str:
    return self._sp.decode(ids)

  def encode_chat_text(self, text: str) -> list[int]:
    ids: list[int] = []
    for k, part in enumerate(self._special_re.split(text) if self._special else [text]):
      if k % 2:
        ids.append(self._special[part])
      elif part:
        ids.extend(self._encode_text(part))
    return ids


def train_tokenizer(texts: Iterable[str], model_prefix: str | os.PathLike[str], *,
                    vocab_size: int = 512, model_type: str = "char") -> SentencePieceTokenizer:
  """Trains a SentencePiece model with exact round trips and loads it.

  Options (see the module docstring for why): pad/unk/bos/eos = 0/1/2/3, "\\n" as a user-defined
  piece (id 4), identity normalization, no dummy prefix, no whitespace collapsing, split digits,
  byte fallback, full character coverage. Newlines inside `texts` are fine: each text is split
  into lines for training, because the newline is a piece of its own.

  Args:
    texts: training strings (e.g. task prompts + reference completions).
    model_prefix: writes `<model_prefix>.model` and `<model_prefix>.vocab`; parent dirs must exist.
    vocab_size: upper bound on the number of pieces (>= 262 = 5 specials + 256 bytes + 1). For
      `model_type="char"` the size is 261 + the number of distinct characters, capped here.
    model_type: "char", "bpe" or "unigram" (SentencePiece model types).

  Returns:
    The trained `SentencePieceTokenizer`.

  Raises:
    ValueError: on a bad `vocab_size` or `model_type`, or when `texts` holds no characters.
  """
  if model_type not in ("char", "bpe", "unigram"):
    raise ValueError(f"model_type={model_type!r}; choose one of 'char', 'bpe', 'unigram'.")
  if vocab_size < 262:
    raise ValueError(f"vocab_size={vocab_size} < 262 (5 specials + 256 byte pieces + 1).")
  lines = [line for text in texts for line in text.split("\n") if line]
  if not lines:
    raise ValueError("train_tokenizer got no non-empty text.")
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines),
      model_prefix=str(model_prefix),
      model_type=model_type,
      vocab_size=vocab_size,
      hard_vocab_limit=False,
      character_coverage=1.0,
      split_digits=True,
      byte_fallback=True,
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      add_dummy_prefix=False,
      user_defined_symbols=[NEWLINE_PIECE],
      pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
      max_sentence_length=1 << 16,
      num_threads=1,
      minloglevel=2,
  )
  return SentencePieceTokenizer(f"{model_prefix}.model")


def default_tokenizer_path() -> pathlib.Path:
  """Path of the tokenizer model shipped in `rlax_pipe/assets/tokenizer.model`."""
  return pathlib.Path(str(importlib.resources.files("rlax_pipe") / "assets" / "tokenizer.model"))


def default_tokenizer() -> SentencePieceTokenizer:
  """Loads the shipped character-level tokenizer (278 ids; pad 0, unk 1, BOS 2, EOS 3, "\\n" 4)."""
  return SentencePieceTokenizer(default_tokenizer_path())
