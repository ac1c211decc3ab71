"""HF model directories: weights + tokenizer + generation config, in and out.

An HF model directory (what `transformers` `save_pretrained` writes and the hub serves) holds
config.json and *.safetensors (the weights, `model.hf_io`), the tokenizer (tokenizer.json with
tokenizer_config.json and maybe chat_template.jinja, or a SentencePiece tokenizer.model) and
generation_config.json (its eos_token_id list is the stop set of a chat model).

- `has_tokenizer(path)`: whether a directory holds a tokenizer (the RL job and SFT then use it);
  `stop_set(tok)`: the sampler's stop ids from it.
- `export_model_dir(path, params, model_cfg, tok)`: writes such a directory from trained params
  and the tokenizer they were trained with, so transformers (and `RunConfig.init`) load it back.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any, Mapping

from rlax_pipe.config import ModelConfig
from rlax_pipe.model import hf_io
from rlax_pipe.tokenizer import PromptFormat, Tokenizer, load_tokenizer

# Tokenizer files of an HF directory, copied as they are.
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json",
                                    "chat_template.jinja", "special_tokens_map.json",
                                    "tokenizer.model")
GENERATION_CONFIG = "generation_config.json"


def has_tokenizer(path: str | os.PathLike[str]) -> bool:
  """Whether directory `path` holds tokenizer.json or tokenizer.model."""
  p = pathlib.Path(path)
  return p.is_dir() and any((p / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))


def tokenizer_for(init: str | os.PathLike[str] | None, tokenizer_path: str | None = None,
                  prompt_format: PromptFormat = PromptFormat()) -> tuple[Tokenizer, str | None]:
  """The tokenizer of a run: `tokenizer_path` if given, else the one in model directory `init`
  (when it holds one), else the shipped tokenizer.

  Returns:
    (tokenizer, the path it was loaded from or None for the shipped one).

  Raises:
    FileNotFoundError / ValueError: from `tokenizer.load_tokenizer`.
  """
  path = tokenizer_path
  if path is None and init is not None and has_tokenizer(init):
    path = str(init)
  return load_tokenizer(path, prompt_format=prompt_format), path


def stop_set(tok: Tokenizer, model_eos_ids: tuple[int, ...] = ()) -> tuple[int, ...]:
  """The sampler's stop set (`SamplerConfig.eos_id`): the tokenizer's stop ids (EOS,
  generation_config's eos_token_id list, the chat template's end-of-turn id) and the model
  config's EOS ids (`ModelConfig.eos_token_ids`, from config.json / generation_config.json),
  each once, in that order."""
  return tuple(dict.fromkeys(int(i) for i in (*tok.stop_ids, *model_eos_ids)))


def generation_config(tok: Tokenizer) -> dict:
  """generation_config.json fields of `tok`: bos, the stop set as eos_token_id, pad."""
  out: dict[str, Any] = {"eos_token_id": list(tok.stop_ids), "pad_token_id": tok.pad_id}
  if tok.bos_id >= 0:
    out["bos_token_id"] = tok.bos_id
  return out


def export_model_dir(path: str | os.PathLike[str], params: Mapping[str, Any],
                     model_cfg: ModelConfig, tok: Tokenizer) -> list[pathlib.Path]:
  """Writes `params` of the built-in model with `tok`'s files as an HF model directory.

  Weights: `hf_io.save_hf_checkpoint` (config.json gets bos / eos / pad ids). Tokenizer: the
  files beside `tok.source` (TOKENIZER_FILES) are copied. generation_config.json: copied from
  the tokenizer's directory when it has one, else written from `generation_config(tok)`.

  Args:
    path: target directory (created; must not hold a checkpoint already).
    params: host or device params in the layout of `model.transformer.param_specs(model_cfg)`.
    model_cfg: the model's config.
    tok: the tokenizer the params were trained with.

  Returns:
    The paths written.

  Raises:
    FileExistsError / ValueError: from `hf_io.save_hf_checkpoint`.
  """
  path = pathlib.Path(path)
  extra = {"pad_token_id": tok.pad_id}
  if not model_cfg.eos_token_ids:  # else config.json gets the model's own EOS ids
    extra["eos_token_id"] = tok.eos_id
  if tok.bos_id >= 0:
    extra["bos_token_id"] = tok.bos_id
  written = list(hf_io.save_hf_checkpoint(path, params, model_cfg, extra_config=extra))
  source = pathlib.Path(tok.source)
  src_dir = source.parent if source.is_file() else source
  copies = {name: name for name in TOKENIZER_FILES}
  if source.is_file() and source.name not in TOKENIZER_FILES:  # e.g. a SentencePiece char.model
    copies = {source.name: "tokenizer.model"}
  for name, target in copies.items():
    if (src_dir / name).is_file() and not (path / target).exists():
      shutil.copyfile(src_dir / name, path / target)
      written.append(path / target)
  gen = path / GENERATION_CONFIG
  if (src_dir / GENERATION_CONFIG).is_file():
    shutil.copyfile(src_dir / GENERATION_CONFIG, gen)
  else:
    gen.write_text(json.dumps(generation_config(tok), indent=2))
  written.append(gen)
  return written
