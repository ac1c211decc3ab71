"""The Python tool as an environment: calls parsed from a turn's ```python block, run in the
verifier worker processes, where a raising, a hanging, an over-long-output and a memory-
exhausting snippet each come back as an error message for the model, counted, with the worker
alive (no restart); the preset adds the tool to the run's task."""

import pytest

from rlax_pipe import envs, tasks
from rlax_pipe.config_dict import from_config_dict
from rlax_pipe.pipeline import job as job_lib
from rlax_pipe.pipeline.config import RunConfig
from rlax_pipe.pipeline.multihost.replica import episode_task
from rlax_pipe.tokenizer import default_tokenizer

TOK = default_tokenizer()


def test_code_block_protocol_parses_a_final_block_and_renders_output():
  proto = envs.CodeBlockProtocol()
  call = proto.parse("Let me add.\n```python\nprint(3 + 5)\n```\n")
  assert call == [envs.ToolCall("python", {"code": "print(3 + 5)"})]
  assert proto.parse("```python\nx = 1\nx") == [envs.ToolCall("python", {"code": "x = 1\nx"})]
  assert proto.parse("```python\n1\n```\nA: 1") == []  # a block followed by text: final turn
  assert proto.parse("A: 8") == [] and proto.parse("```python3\n1\n```") == []
  ok = envs.ToolResult(call[0], "8\n", "ok")
  assert TOK.decode(proto.render(TOK, [ok])) == "```output\n8\n```\n"
  env = envs.PythonToolTask(tasks.ArithmeticTask())
  assert envs.protocol_for(env) == proto
  chat = envs.protocol_for(env, chat=True)
  assert isinstance(chat, envs.ChatToolProtocol)
  assert chat.tools[0]["function"]["name"] == "python"


def test_failing_snippets_are_messages_counted_in_the_worker():
  sandbox = envs.SandboxConfig(wall_s=2.0, cpu_s=1, memory_mb=256, max_output_bytes=200)
  cfg = envs.EnvConfig(tool="python", python=sandbox, tool_timeout_s=20.0, tool_workers=2,
                       max_tool_output_tokens=48)
  env = envs.add_tool(tasks.ArithmeticTask(), cfg)
  pool = envs.ToolPool(env, cfg, TOK)
  problem = env.problem(0)
  snippets = {"ok": "sum([3, 5, 2])", "error": "def f():\n  raise ValueError('bad')\nf()",
              "timeout": "import time\ntime.sleep(60)", "too_long": "print('9' * 5000)",
              "resource": "x = bytearray(1 << 30)"}
  try:
    results = pool.run([(problem, envs.ToolCall("python", {"code": c}))
                        for c in snippets.values()])
  finally:
    pool.close()
  got = dict(zip(snippets, results))
  assert [r.outcome for r in results] == list(snippets)
  assert got["ok"].content == "10\n" and not got["ok"].failed
  assert "ValueError: bad" in got["error"].content
  assert "over 2 s (wall clock)" in got["timeout"].content
  assert "output over 200 bytes" in got["too_long"].content
  assert "MemoryError" in got["resource"].content
  for r in results:
    assert len(TOK.encode(r.content)) <= cfg.max_tool_output_tokens
  assert pool.restarts == 0  # the sandbox stopped the snippets; no worker was killed
  shown = TOK.decode(envs.protocol_for(env).render(TOK, results))  # what the model reads next
  assert shown.count("```output\n") == len(snippets)
  assert all(r.content.rstrip("\n") in shown for r in results)
  assert {k: v for k, v in pool.counts.items() if v} == {k: 1 for k in snippets}


def test_a_long_traceback_keeps_its_tail_within_the_token_limit():
  cfg = envs.EnvConfig(tool="python", tool_timeout_s=20.0, max_tool_output_tokens=24)
  pool = envs.ToolPool(envs.add_tool(tasks.ArithmeticTask(), cfg), cfg, TOK)
  try:
    [r] = pool.run([(tasks.ArithmeticTask().problem(0), envs.ToolCall(
        "python", {"code": "def f(n):\n  return f(n + 1)\nf(0)"}))])
  finally:
    pool.close()
  assert r.outcome == "error" and r.content.startswith("...")
  assert r.content.rstrip().endswith("depth exceeded")
  assert len(TOK.encode(r.content)) <= 24


def test_preset_adds_the_tool_to_the_task():
  from experiments.configs import pipeline_rl  # pylint: disable=import-outside-toplevel
  cfg = from_config_dict(RunConfig, pipeline_rl.get_config("tiny,python"))
  assert cfg.task == "arithmetic" and cfg.env.tool == "python"
  assert cfg.env.python.wall_s < cfg.env.tool_timeout_s
  task = job_lib.task_for(cfg)
  assert isinstance(task, envs.PythonToolTask) and envs.is_environment(task)
  assert task.task.config.max_terms == 4
  # a multi-process replica builds the task only when its requests are episodes
  assert isinstance(episode_task(cfg), envs.PythonToolTask)
  assert episode_task(from_config_dict(RunConfig, pipeline_rl.get_config("tiny"))) is None
  with pytest.raises(ValueError, match="both add a tool"):
    pipeline_rl.get_config("tiny,calculator,python")
  with pytest.raises(ValueError, match="wall_s=9 must be below"):
    envs.EnvConfig(tool="python", python=envs.SandboxConfig(wall_s=9.0), tool_timeout_s=5.0)
  with pytest.raises(ValueError, match="env.tool='ruby'"):
    envs.EnvConfig(tool="ruby")
