"""Tokenizers behind one interface: SentencePiece `tokenizer.model` or HF `tokenizer.json`.

`load_tokenizer(path)` picks the backend by what `path` holds; `default_tokenizer()` is the shipped
character-level SentencePiece model of the built-in arithmetic task. Every backend exposes the
same `Tokenizer` interface: exact round trips, BOS / EOS / PAD, `stop_ids` (every EOS and
end-of-turn id), batch encoding, and `encode_prompt` in a raw or chat-template `PromptFormat`.
"""

from rlax_pipe.tokenizer.base import PROMPT_FORMATS
from rlax_pipe.tokenizer.base import PromptFormat
from rlax_pipe.tokenizer.base import REASONING_MARKERS
from rlax_pipe.tokenizer.base import Tokenizer
from rlax_pipe.tokenizer.chat_template import ChatTemplate
from rlax_pipe.tokenizer.hf_tokenizer import HFTokenizer
from rlax_pipe.tokenizer.loading import load_tokenizer
from rlax_pipe.tokenizer.sentencepiece_tokenizer import BOS_ID
from rlax_pipe.tokenizer.sentencepiece_tokenizer import default_tokenizer
from rlax_pipe.tokenizer.sentencepiece_tokenizer import default_tokenizer_path
from rlax_pipe.tokenizer.sentencepiece_tokenizer import EOS_ID
from rlax_pipe.tokenizer.sentencepiece_tokenizer import NEWLINE_PIECE
from rlax_pipe.tokenizer.sentencepiece_tokenizer import PAD_ID
from rlax_pipe.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from rlax_pipe.tokenizer.sentencepiece_tokenizer import train_tokenizer
from rlax_pipe.tokenizer.sentencepiece_tokenizer import UNK_ID

__all__ = [
    "BOS_ID", "ChatTemplate", "EOS_ID", "HFTokenizer", "NEWLINE_PIECE", "PAD_ID", "PROMPT_FORMATS",
    "PromptFormat", "REASONING_MARKERS", "SentencePieceTokenizer", "Tokenizer", "UNK_ID",
    "default_tokenizer", "default_tokenizer_path", "load_tokenizer", "train_tokenizer",
]
