"""Tool-call protocols: a chat template with tool calls round-trips (a tiny HF tokenizer written
here): prompt + sampled turn tokens + rendered environment tokens == the template's rendering of
the whole conversation, as transformers tokenizes it; the plain-text protocol; the calculator."""

import json

import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlax_pipe import envs
from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.tokenizer import chat_template

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A ChatML template with tools and tool messages (Qwen-like, written for this test).
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>tool name={{ m.name }}\n"
    "{{ m.content }}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = ({"type": "function", "function": {"name": "calc", "parameters": {"expr": "str"}}},)
CORPUS = ['<tool_call>{"name": "calc", "arguments": {"expr": "3+5"}}</tool_call>',
          "Q: 3+5+2\nA: 10", "tool name=calc\n8\nTools: system user assistant"] * 20


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  tk = tokenizers.Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=300, special_tokens=SPECIALS, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  d = tmp_path_factory.mktemp("toolchat")
  tk.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
      "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": TEMPLATE}))
  return d


def test_chat_tool_round_trip_equals_the_templates_rendering(hf_dir):
  tok = tokenizer_lib.load_tokenizer(hf_dir)
  ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
  proto = envs.ChatToolProtocol(tools=TOOLS)
  end = tok.encode("<|im_end|>")
  assert len(end) == 1 and end[0] in tok.stop_ids
  user = {"role": "user", "content": "Q: 3+5+2"}
  call_text = '<tool_call>{"name": "calc", "arguments": {"expr": "3+5+2"}}</tool_call>'
  # token-in, token-out: the sampler's tokens are kept as drawn (here: an encoding of the text)
  prompt = proto.prompt_ids(tok, [user])
  turn1 = tok.encode(call_text) + end
  calls = proto.parse(tok.decode(turn1))
  assert calls == [envs.ToolCall("calc", {"expr": "3+5+2"})]
  env_ids = proto.render(tok, [envs.ToolResult(calls[0], "10", "ok")])
  turn2 = tok.encode("A: 10") + end
  episode = prompt + turn1 + env_ids + turn2
  conversation = [user, {"role": "assistant", "content": call_text},
                  {"role": "tool", "name": "calc", "content": "10"},
                  {"role": "assistant", "content": "A: 10"}]
  expected = ref.apply_chat_template(conversation, tools=list(TOOLS), tokenize=True,
                                     add_generation_prompt=False)
  expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
  # the template closes the last assistant turn with "<|im_end|>\n"; the model stops at <|im_end|>
  assert episode == expected[:-1] and tok.decode([expected[-1]]) == "\n"
  assert tok.decode(env_ids, stop_at_eos=False).startswith("\n<|im_start|>tool name=calc\n10")


def test_chat_parse_malformed_and_several_calls(hf_dir):
  proto = envs.ChatToolProtocol()
  text = ('x<tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call>'
          '<tool_call>not json</tool_call><tool_call>{"name": 3}</tool_call>')
  assert proto.parse(text) == [envs.ToolCall("a", {"k": 1}), envs.ToolCall("", "not json"),
                               envs.ToolCall("", '{"name": 3}')]
  assert proto.parse("no call here") == []


def test_plain_text_protocol_and_calculator():
  tok = tokenizer_lib.default_tokenizer()
  proto = envs.CALCULATOR_PROTOCOL
  assert proto.parse("3+5=8\n8+2+7=") == [envs.ToolCall("calc", "8+2+7")]
  assert proto.parse("3+5=8\nA: 17") == [] and proto.parse("") == []
  call = envs.ToolCall("calc", "12-5+3")
  assert tok.decode(proto.render(tok, [envs.ToolResult(call, "10", "ok")])) == "10\n"
  assert tok.decode(proto.render(tok, [envs.ToolResult(call, "x", "timeout")])) == "error: x\n"
  assert envs.evaluate(" 3 + 5 -12") == -4 and envs.evaluate("7") == 7
  for bad in ("3*5", "3+", "", "+".join(["1"] * 65), "__import__('os')"):
    with pytest.raises(ValueError):
      envs.evaluate(bad)
  env = envs.CalculatorArithmeticTask()
  assert envs.is_environment(env) and not envs.is_environment(object())
  p = env.problem(3)
  first, result, last = env.tool_solution(p)
  assert env.call_tool(p, proto.parse(first)[0]) + "\n" == result
  assert env.reward(p, last) == 1.0
  with pytest.raises(ValueError, match="on_tool_failure"):
    envs.EnvConfig(on_tool_failure="ignore")
  with pytest.raises(ValueError, match="arguments"):
    envs.PlainTextProtocol(call_pattern="(?P<name>x)")


def test_chat_prompts_declare_the_environments_tool_schemas(hf_dir):
  """The pipeline's prompt path (`Tokenizer.encode_prompt`, what the rollout worker, the
  evaluation and the SFT use) declares the environment's tools once `declare_tools` ran: the
  ids equal transformers' `apply_chat_template(tools=...)`; a template without a place for
  tools is left as is; raw prompts are untouched."""
  env = envs.CalculatorArithmeticTask()
  fmt = tokenizer_lib.PromptFormat(kind="chat")
  tok = tokenizer_lib.load_tokenizer(hf_dir, prompt_format=fmt)
  ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
  prompt = env.problem(0).prompt
  plain = tok.encode_prompt(prompt)
  assert envs.declare_tools(tok, env) == env.tool_schemas() == tok.prompt_tools
  expected = ref.apply_chat_template([{"role": "user", "content": prompt}],
                                     tools=list(env.tool_schemas()), tokenize=True,
                                     add_generation_prompt=True)
  expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
  declared = tok.encode_prompt(prompt)
  assert declared == expected and declared != plain
  assert "calc" in tok.decode(declared, stop_at_eos=False)
  # the chat protocol's tool calls reach the calculator with JSON arguments
  proto = envs.protocol_for(env, chat=True)
  call = proto.parse('<tool_call>{"name": "calc", "arguments": {"expression": "3+4"}}'
                     '</tool_call>')[0]
  assert proto.tools == env.tool_schemas() and env.call_tool(env.problem(0), call) == "7"
  with pytest.raises(ValueError, match="expression"):
    env.call_tool(env.problem(0), envs.ToolCall("calc", {"expr": "3+4"}))
  # a template that ignores tools: nothing declared
  no_tools = tokenizer_lib.load_tokenizer(hf_dir, prompt_format=fmt)
  no_tools._chat_template = chat_template.ChatTemplate(  # pylint: disable=protected-access
      TEMPLATE.replace("{% if tools %}", "{% if false %}"))
  assert envs.declare_tools(no_tools, env) is None and no_tools.prompt_tools is None
  raw = tokenizer_lib.default_tokenizer()
  assert envs.declare_tools(raw, env) is None and raw.prompt_tools is None
