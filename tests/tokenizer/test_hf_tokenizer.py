"""Tests of the HF `tokenizers` backend on tokenizers trained here, checked against transformers."""

import json
import shutil

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import pytest
import transformers

from rlax_pipe import tokenizer as tokenizer_lib

TEXTS = ["", "Q: 3+5+2+7\n", "  leading and trailing  ", "a  b   c", "\r\n\t tab\r\n", "é∑😀日本語",
         "<|im_start|>user\nhi<|im_end|>", "<|endoftext|><|endoftext|>", "\x00\x01\x7f", "Ġ Ċ"]


@pytest.fixture(scope="module")
def chatml(chatml_dir):
  return tokenizer_lib.load_tokenizer(chatml_dir)


@pytest.fixture(scope="module")
def llama(llama_dir):
  return tokenizer_lib.load_tokenizer(llama_dir)


def _ids(tk_dir, *names):
  vocab = json.loads((tk_dir / "tokenizer.json").read_text())["added_tokens"]
  by_name = {t["content"]: t["id"] for t in vocab}
  return [by_name[n] for n in names]


def test_special_ids_come_from_tokenizer_and_generation_config(chatml, chatml_dir, llama,
                                                              llama_dir):
  assert isinstance(chatml, tokenizer_lib.HFTokenizer)
  endoftext, im_end = _ids(chatml_dir, "<|endoftext|>", "<|im_end|>")
  assert chatml.bos_id == -1 and not chatml.add_bos_default      # Qwen: no BOS
  assert chatml.eos_id == endoftext and chatml.pad_id == endoftext
  assert chatml.stop_ids == (endoftext, im_end)                    # EOS first, list merged
  begin, end, eot = _ids(llama_dir, "<|begin_of_text|>", "<|end_of_text|>", "<|eot|>")
  assert (llama.bos_id, llama.eos_id, llama.pad_id) == (begin, end, end)
  assert llama.add_bos_default                                     # post-processor adds BOS
  assert llama.stop_ids == (end, eot)                              # end-of-turn from the template
  assert llama.encode("x", add_bos=True)[0] == begin


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_agreement_with_transformers(chatml, chatml_dir, llama, llama_dir, text):
  for tok, path in ((chatml, chatml_dir), (llama, llama_dir)):
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = tok.encode(text)
    assert ids == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text, add_bos=tok.add_bos_default) == ref(text)["input_ids"]
    stops = [tok.id_to_piece(i) for i in tok.stop_ids]   # added tokens: their content
    without_stops, first_stop = text, len(text)
    for piece in stops:
      without_stops = without_stops.replace(piece, "")
      first_stop = min(first_stop, text.find(piece) % (len(text) + 1))
    assert tok.decode(ids, stop_at_eos=False) == without_stops
    assert tok.decode(ids) == text[:first_stop]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_level_round_trip_is_exact(chatml, text):
  text = text.encode("utf-8", "replace").decode("utf-8")  # Drop lone surrogates (not text).
  ids = chatml.encode(text)
  assert all(0 <= i < chatml.vocab_size for i in ids)
  if not set(chatml.stop_ids) & set(ids):   # text spelling a stop token's content
    assert chatml.decode(ids) == text


def test_added_tokens_are_single_ids(chatml, chatml_dir):
  im_start, im_end = _ids(chatml_dir, "<|im_start|>", "<|im_end|>")
  assert chatml.encode("<|im_start|>") == [im_start]
  assert chatml.encode("a<|im_end|>b")[1] == im_end


def test_decode_stops_at_any_stop_id_and_skips_bos_and_pad(chatml, llama):
  body = chatml.encode("A: 72")
  endoftext, im_end = chatml.stop_ids
  for stop in (endoftext, im_end):
    assert chatml.decode(body + [stop] + chatml.encode("junk")) == "A: 72"
  assert chatml.decode(np.asarray(body + [im_end], np.int32)) == "A: 72"
  assert chatml.decode(body + [im_end] + body, stop_at_eos=False) == "A: 72A: 72"
  assert llama.decode([llama.bos_id] + llama.encode("x") + [llama.pad_id] * 2) == "x"


def test_batch_encode(chatml, llama):
  for tok in (chatml, llama):
    batch = tok.encode_batch(TEXTS, add_bos=tok.bos_id >= 0, add_eos=True)
    assert batch == [tok.encode(t, add_bos=tok.bos_id >= 0, add_eos=True) for t in TEXTS]
    plain = [t for t in TEXTS if "<|" not in t]
    assert tok.decode_batch(tok.encode_batch(plain, add_eos=True)) == plain
  with pytest.raises(TypeError):
    chatml.encode_batch(["ok", b"bytes"])


def test_raw_prompt_ids(chatml, llama):
  assert chatml.encode_prompt("Q: 1+2\n") == chatml.encode("Q: 1+2\n")
  assert llama.encode_prompt("Q: 1+2\n") == [llama.bos_id] + llama.encode("Q: 1+2\n")
  with pytest.raises(ValueError, match="BOS"):
    chatml.encode("x", add_bos=True)
  with pytest.raises(ValueError, match="encodes to no token"):
    chatml.encode_prompt("")


def _copy(src, dst, **edits):
  shutil.copytree(src, dst)
  for name, change in edits.items():
    path = dst / name
    if change is None:
      path.unlink()
    else:
      obj = json.loads(path.read_text())
      obj.update(change)
      path.write_text(json.dumps(obj))
  return dst


def test_load_errors_name_the_file_and_the_fix(chatml_dir, tmp_path):
  no_eos = _copy(chatml_dir, tmp_path / "no_eos", **{
      "tokenizer_config.json": {"eos_token": None}, "generation_config.json": None})
  with pytest.raises(ValueError, match="declares no EOS"):
    tokenizer_lib.load_tokenizer(no_eos)
  bad_token = _copy(chatml_dir, tmp_path / "bad_token",
                    **{"tokenizer_config.json": {"pad_token": "<|nope|>"}})
  with pytest.raises(ValueError, match="pad_token='<|nope|>' is not in the vocabulary"):
    tokenizer_lib.load_tokenizer(bad_token)
  bad_eos_list = _copy(chatml_dir, tmp_path / "bad_list",
                       **{"generation_config.json": {"eos_token_id": ["x"]}})
  with pytest.raises(ValueError, match="eos_token_id"):
    tokenizer_lib.load_tokenizer(bad_eos_list)
  broken = _copy(chatml_dir, tmp_path / "broken")
  (broken / "tokenizer_config.json").write_text("{not json")
  with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
    tokenizer_lib.load_tokenizer(broken)
  with pytest.raises(FileNotFoundError, match="neither tokenizer.json"):
    tokenizer_lib.load_tokenizer(tmp_path)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    tokenizer_lib.load_tokenizer(tmp_path / "missing")


def test_factory_picks_by_what_the_path_holds(chatml_dir, tmp_path):
  assert isinstance(tokenizer_lib.load_tokenizer(chatml_dir / "tokenizer.json"),
                    tokenizer_lib.HFTokenizer)
  assert isinstance(tokenizer_lib.load_tokenizer(), tokenizer_lib.SentencePieceTokenizer)
  # A SentencePiece model in an HF directory: its template and generation_config stops are used.
  sp_dir = tmp_path / "sp"
  sp_dir.mkdir()
  shutil.copy(tokenizer_lib.default_tokenizer_path(), sp_dir / "tokenizer.model")
  (sp_dir / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}",
       "add_bos_token": False}))
  (sp_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
  sp = tokenizer_lib.load_tokenizer(sp_dir, prompt_format=tokenizer_lib.PromptFormat("chat"))
  assert isinstance(sp, tokenizer_lib.SentencePieceTokenizer)
  assert sp.stop_ids == (3, 4) and not sp.add_bos_default
  assert sp.decode(sp.encode_prompt("Q: 1")) == "[user]Q: 1[assistant]"
