"""Chat templates rendered by rlax_pipe agree with transformers' own rendering, text and ids."""

import json
import shutil

import jinja2
import pytest
import transformers

from rlax_pipe import tokenizer as tokenizer_lib

CONVERSATIONS = [
    [{"role": "user", "content": "What is 3+5?"}],
    [{"role": "system", "content": "Answer after 'A:'."}, {"role": "user", "content": " 7*6 \n"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "naïve café ∑ 😀"}],
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds — ünïcode",
                                           "parameters": {"a": "int"}}}]


def _both(path):
  return (tokenizer_lib.load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(str(path)))


def _input_ids(out):
  return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("layout", ["chatml_dir", "llama_dir"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_matches_transformers(request, layout, conversation, add_generation_prompt):
  tok, ref = _both(request.getfixturevalue(layout))
  messages = CONVERSATIONS[conversation]
  text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  assert text == ref.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
  assert tok.encode(text) == _input_ids(ref.apply_chat_template(
      messages, tokenize=True, add_generation_prompt=add_generation_prompt))


def test_tools_render_as_unescaped_json_like_transformers(chatml_dir):
  tok, ref = _both(chatml_dir)
  text = tok.apply_chat_template(CONVERSATIONS[0], tools=TOOLS)
  assert "ünïcode" in text and "—" in text
  assert text == ref.apply_chat_template(CONVERSATIONS[0], tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True)


@pytest.mark.parametrize("layout", ["chatml_dir", "llama_dir"])
@pytest.mark.parametrize("system_prompt", [None, "Think step by step."])
def test_encode_prompt_in_chat_format_is_transformers_ids(request, layout, system_prompt):
  path = request.getfixturevalue(layout)
  fmt = tokenizer_lib.PromptFormat("chat", system_prompt=system_prompt)
  tok = tokenizer_lib.load_tokenizer(path, prompt_format=fmt)
  ref = transformers.AutoTokenizer.from_pretrained(str(path))
  messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
      {"role": "user", "content": "Q: 3+5+2\n"}]
  expected = _input_ids(ref.apply_chat_template(messages, tokenize=True,
                                                add_generation_prompt=True))
  assert tok.encode_prompt("Q: 3+5+2\n") == expected
  # The same tokenizer renders raw prompts when asked to.
  assert tok.encode_prompt("Q: 1", tokenizer_lib.PromptFormat("raw")) == tok.encode(
      "Q: 1", add_bos=tok.add_bos_default)
  # BOS appears once, where the template writes it (never added a second time).
  if tok.bos_id >= 0:
    assert tok.encode_prompt("x").count(tok.bos_id) == 1


def test_template_errors_are_clear(chatml_dir):
  tok, ref = _both(chatml_dir)
  bad_role = [{"role": "tool", "content": "x"}]
  with pytest.raises(ValueError, match="Unknown role: tool"):
    tok.apply_chat_template(bad_role)
  with pytest.raises(jinja2.exceptions.TemplateError, match="Unknown role: tool"):
    ref.apply_chat_template(bad_role, tokenize=False)
  for bad in ([], "hi", [{"content": "no role"}]):
    with pytest.raises(ValueError, match="role"):
      tok.apply_chat_template(bad)
  with pytest.raises(ValueError, match="does not compile"):
    tokenizer_lib.ChatTemplate("{% for m in messages %}")
  with pytest.raises(ValueError, match="has no chat template"):
    tokenizer_lib.default_tokenizer().apply_chat_template(CONVERSATIONS[0])
  with pytest.raises(ValueError, match="needs a chat template"):
    tokenizer_lib.load_tokenizer(None, prompt_format=tokenizer_lib.PromptFormat("chat"))
  with pytest.raises(ValueError, match="kind"):
    tokenizer_lib.PromptFormat("jinja")


def test_sandbox_blocks_attribute_escapes():
  template = tokenizer_lib.ChatTemplate("{{ messages.__class__.__mro__ }}")
  with pytest.raises(Exception, match="unsafe|not safely|access"):
    template.render([{"role": "user", "content": "x"}])


def test_end_of_turn_text(chatml_dir, llama_dir):
  assert tokenizer_lib.load_tokenizer(chatml_dir).chat_template.end_of_turn_text() == (
      "<|im_end|>\n")
  assert tokenizer_lib.load_tokenizer(llama_dir).chat_template.end_of_turn_text() == "<|eot|>"
  refusing = tokenizer_lib.ChatTemplate("{{ raise_exception('user only') }}")
  assert refusing.end_of_turn_text() is None


def test_template_kwargs_reach_the_template(tmp_path, chatml_dir):
  path = tmp_path / "thinking"
  shutil.copytree(chatml_dir, path)
  config = json.loads((path / "tokenizer_config.json").read_text())
  config["chat_template"] = (
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n"
      "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
      "{% endif %}")
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  fmt = tokenizer_lib.PromptFormat("chat", template_kwargs={"enable_thinking": False})
  tok = tokenizer_lib.load_tokenizer(path, prompt_format=fmt)
  ref = transformers.AutoTokenizer.from_pretrained(str(path))
  messages = [{"role": "user", "content": "2+2?"}]
  expected = _input_ids(ref.apply_chat_template(messages, tokenize=True,
                                                add_generation_prompt=True,
                                                enable_thinking=False))
  assert tok.encode_prompt("2+2?") == expected
  assert tok.decode(tok.encode_prompt("2+2?"), stop_at_eos=False).endswith("<think></think>")
  with pytest.raises(ValueError, match="needs kind='chat'"):
    tokenizer_lib.PromptFormat("raw", template_kwargs={"enable_thinking": False})
