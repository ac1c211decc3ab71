"""`load_tokenizer`: picks the tokenizer backend by what a path holds."""

from __future__ import annotations

import os
import pathlib

from rlax_pipe.tokenizer import base
from rlax_pipe.tokenizer import hf_tokenizer as hf
from rlax_pipe.tokenizer import sentencepiece_tokenizer as sp

SENTENCEPIECE_FILE = "tokenizer.model"


def load_tokenizer(path: str | os.PathLike[str] | None = None, *,
                   prompt_format: base.PromptFormat = base.PromptFormat()) -> base.Tokenizer:
  """Loads the tokenizer at `path`, choosing the backend by what is there.

  - None: the shipped character-level SentencePiece tokenizer (`default_tokenizer`);
  - a `*.model` file: SentencePiece;
  - a `tokenizer.json` file, or a directory holding one: HF `tokenizers` (`HFTokenizer`), with
    special tokens, stop ids and chat template from the HF files beside it;
  - a directory holding `tokenizer.model` but no `tokenizer.json`: SentencePiece, with the chat
    template of its `tokenizer_config.json` and the extra EOS ids of `generation_config.json`.

  Args:
    path: file or directory, or None.
    prompt_format: default format of `encode_prompt` ("raw" or "chat").

  Returns:
    A `Tokenizer`.

  Raises:
    FileNotFoundError: when `path` does not exist or holds neither tokenizer file (the message
      lists what was looked for).
    ValueError: from the backend, on malformed files.
  """
  if path is None:
    tok = sp.default_tokenizer()
    return tok if prompt_format == base.PromptFormat() else sp.SentencePieceTokenizer(
        tok.path, prompt_format=prompt_format)
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"tokenizer path {path} does not exist.")
  if path.is_file():
    if path.name == hf.TOKENIZER_FILE:
      return hf.HFTokenizer(path, prompt_format=prompt_format)
    return _sentencepiece(path, path.parent if path.name == SENTENCEPIECE_FILE else None,
                          prompt_format)
  if (path / hf.TOKENIZER_FILE).is_file():
    return hf.HFTokenizer(path, prompt_format=prompt_format)
  if (path / SENTENCEPIECE_FILE).is_file():
    return _sentencepiece(path / SENTENCEPIECE_FILE, path, prompt_format)
  raise FileNotFoundError(f"{path} holds neither {hf.TOKENIZER_FILE} (HF tokenizers) nor "
                          f"{SENTENCEPIECE_FILE} (SentencePiece).")


def _sentencepiece(model: pathlib.Path, directory: pathlib.Path | None,
                   prompt_format: base.PromptFormat) -> sp.SentencePieceTokenizer:
  """A SentencePiece model, with the HF files of `directory` (if any) for template and stops."""
  if directory is None:
    return sp.SentencePieceTokenizer(model, prompt_format=prompt_format)
  config = hf.read_json(directory / hf.TOKENIZER_CONFIG_FILE)
  generation = hf.read_json(directory / hf.GENERATION_CONFIG_FILE)
  special = {n: hf.token_text(config.get(n)) for n in hf.SPECIAL_TOKEN_NAMES}
  special = {k: v for k, v in special.items() if v is not None}
  template = hf.load_chat_template(directory, config, special)
  stops = hf.as_id_list(generation.get("eos_token_id"),
                         f"{directory / hf.GENERATION_CONFIG_FILE}: eos_token_id")
  add_bos = config.get("add_bos_token")
  return sp.SentencePieceTokenizer(
      model, extra_stop_ids=stops, add_bos=add_bos if isinstance(add_bos, bool) else None,
      chat_template=template, special_tokens=tuple(special.values()),
      prompt_format=prompt_format)
