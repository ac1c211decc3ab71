"""The reasoning block's markers come from the tokenizer: its chat template, else its vocabulary."""

import json
import shutil

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlax_pipe import grading
from rlax_pipe import tokenizer as tokenizer_lib

# What Qwen3's template does with reasoning (abridged): it splits earlier answers at "</think>"
# and, with enable_thinking=False, writes an empty block in the generation prompt.
QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
              "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] }}"
              "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
              "{% endif %}{% endif %}")
MAGISTRAL_LIKE = ("{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}"
                  "{# the model reasons in [THINK] ... [/THINK] #}")


def _sentencepiece_with_template(tmp_path, template, **template_kwargs):
  shutil.copy(tokenizer_lib.default_tokenizer_path(), tmp_path / "tokenizer.model")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  return tokenizer_lib.load_tokenizer(tmp_path, prompt_format=tokenizer_lib.PromptFormat(
      "chat", template_kwargs=template_kwargs))


def test_markers_from_the_chat_template(tmp_path):
  assert tokenizer_lib.default_tokenizer().reasoning_markers is None  # the shipped one: none
  tok = _sentencepiece_with_template(tmp_path, QWEN3_LIKE)
  assert tok.reasoning_markers == ("<think>", "</think>")
  (tmp_path / "m").mkdir()
  assert _sentencepiece_with_template(tmp_path / "m", MAGISTRAL_LIKE).reasoning_markers == (
      "[THINK]", "[/THINK]")


def test_markers_from_the_vocabulary(tmp_path):
  tk = tokenizers.Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  tk.train_from_iterator(["Q: 3+5\nA: 8", "so the answer is 8"] * 10, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tk.add_tokens(["<think>", "</think>"])  # as Qwen3's tokenizer.json declares them
  tk.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
  tok = tokenizer_lib.load_tokenizer(tmp_path)
  assert tok.reasoning_markers == ("<think>", "</think>")
  ids = tok.encode("<think>A: 3</think>A: 8")
  assert tok.decode(ids) == "<think>A: 3</think>A: 8"   # the markers survive decoding


@pytest.mark.parametrize("enable_thinking,completion,graded", [
    (True, "<think>\nA: 3?\n</think>\n\nA: 8", "\n\nA: 8"),
    (True, "<think>\nA: 3?", ""),                          # cut while reasoning: no answer
    (False, "A: 8", "A: 8"),                                # the prompt closed an empty block
])
def test_completion_for_grading_with_qwen3_like_prompts(tmp_path, enable_thinking, completion,
                                                        graded):
  tok = _sentencepiece_with_template(tmp_path, QWEN3_LIKE, enable_thinking=enable_thinking)
  prompt = tok.encode_prompt("Q: 3+5")
  markers = grading.resolve_reasoning_markers(tok, grading.GradingConfig())
  assert grading.completion_for_grading(tok, prompt, tok.encode(completion), markers) == graded
  explicit = grading.GradingConfig(reasoning_markers="<think> </think>")
  assert grading.resolve_reasoning_markers(tok, explicit) == ("<think>", "</think>")
  none = grading.resolve_reasoning_markers(tok, grading.GradingConfig(reasoning_markers="none"))
  assert grading.completion_for_grading(tok, prompt, tok.encode(completion), none) == completion


@pytest.mark.parametrize("bad", ["<think>", "a b c", "", 3])
def test_bad_reasoning_markers_setting(bad):
  with pytest.raises(ValueError, match="reasoning_markers"):
    grading.GradingConfig(reasoning_markers=bad)
