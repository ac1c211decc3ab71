"""The SentencePiece backend: exact round trips, special ids, batching, loading, training."""

import shutil

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import pytest

from rlax_pipe import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.default_tokenizer()


def test_shipped_special_ids(tok):
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
  assert tok.vocab_size == 278
  assert tok.encode("\n") == [4]


ROUND_TRIPS = [
    "", "0123456789", "12345678901234567890", "Q: 3+5+2+7\n", "3+5=8\n8+2=10\n10+7=17\nA: 17",
    "   ", "a  b   c    d", "  leading and trailing  ", "\n", "\n\n\n", "line\n\n  indented\n",
    "\r\n\t tab\r\n", "+-*/=()<>%^&|!?", "1*2-3/4=(5)", "é", "∑", "😀", "naïve café ∑x² 😀🎉",
    "日本語", "\u2581", "a\u2581b \u2581\u2581 c", "<s></s><pad><unk>", "\x00\x01\x7f",
]


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_round_trip(tok, text):
  ids = tok.encode(text)
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(tok, text):
  text = text.encode("utf-8", "replace").decode("utf-8")  # Drop lone surrogates (not text).
  assert tok.decode(tok.encode(text)) == text


def test_digits_and_arithmetic_alphabet_are_single_tokens(tok):
  assert len(tok.encode("1234567890")) == 10
  for ch in "0123456789+-=:QA \n":
    ids = tok.encode(ch)
    assert len(ids) == 1 and not tok.id_to_piece(ids[0]).startswith("<0x"), ch


def test_unknown_characters_use_byte_fallback_not_unk(tok):
  for text in ("é", "∑", "😀", "\u2581"):
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(tok.id_to_piece(i).startswith("<0x") for i in ids)
    assert 1 not in ids  # <unk>


def test_specials_not_split_and_text_never_makes_special_ids(tok):
  ids = tok.encode("<s>x</s><pad>", add_bos=True, add_eos=True)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  inner = ids[1:-1]
  assert not {tok.bos_id, tok.eos_id, tok.pad_id} & set(inner)
  assert tok.decode(ids) == "<s>x</s><pad>"


def test_decode_skips_bos_pad_and_stops_at_eos(tok):
  body = tok.encode("3+4=7")
  ids = [tok.bos_id] + body + [tok.eos_id] + tok.encode("junk") + [tok.pad_id] * 3
  assert tok.decode(ids) == "3+4=7"
  assert tok.decode(ids, stop_at_eos=False) == "3+4=7junk"
  assert tok.decode(np.asarray(ids, np.int32)) == "3+4=7"


def test_decode_rejects_bad_ids(tok):
  with pytest.raises(ValueError, match="outside"):
    tok.decode([5, tok.vocab_size])
  with pytest.raises(ValueError, match="outside"):
    tok.decode([-1])
  with pytest.raises(ValueError, match="1-D"):
    tok.decode(np.zeros((2, 2), np.int32))
  with pytest.raises(TypeError):
    tok.encode(b"bytes")


def test_batch(tok):
  texts = ["Q: 1+2\n", "", "∑ 😀\n\n", "12   34"]
  batch = tok.encode_batch(texts, add_bos=True, add_eos=True)
  assert batch == [tok.encode(t, add_bos=True, add_eos=True) for t in texts]
  assert tok.decode_batch(batch) == texts
  width = max(map(len, batch))
  padded = np.full((len(batch), width), tok.pad_id, np.int32)
  for row, ids in enumerate(batch):
    padded[row, :len(ids)] = ids
  assert tok.decode_batch(padded) == texts


def test_load_from_arbitrary_path(tok, tmp_path):
  path = tmp_path / "some" / "where" / "my.model"
  path.parent.mkdir(parents=True)
  shutil.copy(tokenizer_lib.default_tokenizer_path(), path)
  other = tokenizer_lib.SentencePieceTokenizer(path)
  assert tokenizer_lib.load_tokenizer(path).encode("Q: 9+9\n") == tok.encode("Q: 9+9\n")
  assert other.vocab_size == tok.vocab_size
  assert other.encode("Q: 9+9\n") == tok.encode("Q: 9+9\n")


def test_load_errors(tmp_path):
  with pytest.raises(FileNotFoundError):
    tokenizer_lib.SentencePieceTokenizer(tmp_path / "missing.model")
  bad = tmp_path / "bad.model"
  bad.write_bytes(b"not a model")
  with pytest.raises(ValueError, match="not a SentencePiece model"):
    tokenizer_lib.SentencePieceTokenizer(bad)


def test_train_tokenizer(tmp_path):
  texts = ["hello world\nhello  there", "x=1\ny=22"]
  tok = tokenizer_lib.train_tokenizer(texts, tmp_path / "tiny", vocab_size=400)
  assert (tmp_path / "tiny.model").is_file()
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  assert tok.vocab_size == 5 + 256 + len(set("".join(texts)) - {"\n"})
  for text in texts + ["unseen ∑ chars\n"]:
    assert tok.decode(tok.encode(text)) == text
  with pytest.raises(ValueError, match="vocab_size"):
    tokenizer_lib.train_tokenizer(texts, tmp_path / "t2", vocab_size=100)
  with pytest.raises(ValueError, match="model_type"):
    tokenizer_lib.train_tokenizer(texts, tmp_path / "t3", model_type="word")
  with pytest.raises(ValueError, match="no non-empty text"):
    tokenizer_lib.train_tokenizer(["\n\n"], tmp_path / "t4")


def test_public_functions_have_docstrings():
  for name in ("Tokenizer", "train_tokenizer", "default_tokenizer", "default_tokenizer_path"):
    assert getattr(tokenizer_lib, name).__doc__
  for name in ("encode", "decode", "encode_batch", "decode_batch", "vocab_size", "bos_id",
               "eos_id", "pad_id", "id_to_piece"):
    assert getattr(tokenizer_lib.Tokenizer, name).__doc__, name


def test_stop_ids_and_raw_prompts(tok):
  assert tok.stop_ids == (tok.eos_id,)
  assert tok.add_bos_default and tok.encode_prompt("Q: 1\n") == tok.encode("Q: 1\n", add_bos=True)
  more = tokenizer_lib.SentencePieceTokenizer(tokenizer_lib.default_tokenizer_path(),
                                              extra_stop_ids=[4, 3])
  assert more.stop_ids == (3, 4) and more.decode(more.encode("1\n2")) == "1"
  with pytest.raises(ValueError, match="outside"):
    tokenizer_lib.SentencePieceTokenizer(tokenizer_lib.default_tokenizer_path(),
                                         extra_stop_ids=[10_000])


def test_special_text_maps_to_ids_only_in_rendered_chat_text(tok):
  assert tok.encode_chat_text("<s>x</s>") == [tok.bos_id] + tok.encode("x") + [tok.eos_id]
  assert tok.bos_id not in tok.encode("<s>x</s>")   # plain text is spelled out
  with pytest.raises(ValueError, match="not a piece"):
    tokenizer_lib.SentencePieceTokenizer(tokenizer_lib.default_tokenizer_path(),
                                         special_tokens=["<|im_start|>"])
