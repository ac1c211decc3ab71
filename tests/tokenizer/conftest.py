"""Fixtures: byte-level BPE tokenizers trained here by `tokenizers`, saved in HF layout.

Two layouts, as real models ship them:
- "chatml" (Qwen-like): no BOS, EOS "<|endoftext|>", generation_config eos
  [<|im_end|>, <|endoftext|>], a ChatML chat template in tokenizer_config.json;
- "llama" (Llama-3-like): BOS "<|begin_of_text|>" prepended by the post-processor, EOS
  "<|end_of_text|>", the end-of-turn token "<|eot|>" only in the template (chat_template.jinja).
"""

import json

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "Q: 3+5+2+7\n3+5=8\n8+2=10\n10+7=17\nA: 17",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "The answer is \\boxed{\\frac{1}{2}}. Answer: 0.5",
    "naïve café ∑x² 😀 日本語 — tabs\tand  double  spaces\r\n",
] * 20

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start|>", "<|eot|>"]

# Written for these tests (ChatML layout); exercises trim_blocks / lstrip_blocks, slicing, tojson,
# raise_exception and a default system message.
CHATML_TEMPLATE = """{% if messages[0]['role'] == 'system' %}
{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{% set rest = messages[1:] %}
{% else %}
<|im_start|>system
You are a careful solver.<|im_end|>
{% set rest = messages %}
{% endif %}
{% if tools %}
    <|im_start|>tools
{{ tools | tojson }}<|im_end|>
{% endif %}
{% for m in rest %}
    {% if m['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + m['role']) }}
    {% endif %}
<|im_start|>{{ m['role'] }}
{{ m['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

# Llama-3-like: BOS from the template, namespace, loop controls, a {% generation %} block.
LLAMA_TEMPLATE = """{{ bos_token }}{% set ns = namespace(system='') %}
{% for m in messages %}
{% if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif %}
<|start|>{{ m.role }}
{% if ns.system and m.role == 'user' %}{{ ns.system }}

{% set ns.system = '' %}{% endif %}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|eot|>{% endgeneration %}
{% else %}{{ m.content }}<|eot|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|start|>assistant
{% endif %}"""


def _train(specials):
  tk = tokenizers.Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tk.train_from_iterator(CORPUS, trainer)
  return tk


def _write(directory, tk, tokenizer_config, generation_config=None, template_file=None):
  directory.mkdir(parents=True, exist_ok=True)
  tk.save(str(directory / "tokenizer.json"))
  tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}
  (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
  if generation_config is not None:
    (directory / "generation_config.json").write_text(json.dumps(generation_config))
  if template_file is not None:
    (directory / "chat_template.jinja").write_text(template_file)
  return directory


def make_chatml_dir(directory):
  """A Qwen-like HF tokenizer directory (see the module docstring)."""
  tk = _train(CHATML_SPECIALS)
  ids = {s: tk.token_to_id(s) for s in CHATML_SPECIALS}
  return _write(directory, tk,
                {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None,
                 "chat_template": CHATML_TEMPLATE},
                {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                 "bos_token_id": ids["<|endoftext|>"]})  # as Qwen ships it; tokenizer_config wins


def make_llama_dir(directory):
  """A Llama-3-like HF tokenizer directory (see the module docstring)."""
  tk = _train(LLAMA_SPECIALS)
  bos = "<|begin_of_text|>"
  tk.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tk.token_to_id(bos))])
  return _write(directory, tk,
                {"bos_token": {"content": bos, "special": True, "__type": "AddedToken"},
                 "eos_token": "<|end_of_text|>"},
                {"bos_token_id": tk.token_to_id(bos),
                 "eos_token_id": tk.token_to_id("<|end_of_text|>")},
                template_file=LLAMA_TEMPLATE)


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory):
  return make_chatml_dir(tmp_path_factory.mktemp("hf") / "chatml")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
  return make_llama_dir(tmp_path_factory.mktemp("hf") / "llama")
