"""The sandboxed Python tool: each way a snippet can fail (raise, hang, spin, exhaust memory,
flood the output, reach for the network, other processes or files outside its directory) is a
text for the model with its outcome, never an exception in the caller; the environment wrapper
delegates to its task and raises `ToolError` for failures."""

import pickle

import pytest

from rlax_pipe.tasks import ArithmeticTask
from rlax_pipe.tasks.calculator import CalculatorArithmeticTask
from rlax_pipe.tasks.python_tool import PythonToolTask, run_python, SandboxConfig
from rlax_pipe.tasks.tools import ToolCall, ToolError

FAST = SandboxConfig(wall_s=8.0, cpu_s=1, memory_mb=256, max_output_bytes=300)


def test_output_and_last_expression_value():
  assert run_python("x = 6 * 7\nprint('x is', x)\nx + 1", FAST) == ("x is 42\n43\n", "ok")
  assert run_python("None", FAST) == ("", "ok")  # None is not echoed
  assert run_python("import sys\nsys.exit(0)", FAST) == ("", "ok")


@pytest.mark.parametrize("code, outcome, says", [
    ("def f(n):\n  return 1 // n\nf(0)", "error", "ZeroDivisionError"),
    ("1 +", "error", "SyntaxError"),
    ("import sys\nsys.exit(3)", "error", "exit code 3"),
    ("x = bytearray(1 << 30)", "resource", "MemoryError: over 256 MiB"),
    ("print('9' * 10000)", "too_long", "output over 300 bytes"),
    ("import socket\nsocket.socket()", "error", "socket.__new__ is not allowed"),
    ("import subprocess\nsubprocess.run(['true'])", "error", "subprocess.Popen is not allowed"),
    ("import os\nos.fork()", "error", "os.fork is not allowed"),
    ("import ctypes\nctypes.CDLL(None)", "error", "ctypes.dlopen is not allowed"),
    ("open('/tmp/rlax_sandbox_escape', 'w')", "error", "outside the working directory"),
    ("import os\nos.remove('/tmp/x')", "error", "outside the working directory"),
    ("open('big', 'wb').write(b'x' * (2 << 20))", "error", "File too large"),
])
def test_failures_become_messages(code, outcome, says):
  text, got = run_python(code, SandboxConfig(wall_s=8.0, cpu_s=1, memory_mb=256,
                                             max_output_bytes=300, max_file_mb=1))
  assert got == outcome and says in text, (got, text)


def test_traceback_shows_the_snippets_own_lines():
  text, outcome = run_python("def f():\n  return 1 / 0\nf()", FAST)
  assert outcome == "error"
  assert 'File "<snippet>", line 2, in f' in text and "return 1 / 0" in text
  assert "hook" not in text and "<string>" not in text  # no sandbox frames


def test_hanging_and_spinning_snippets_are_stopped():
  text, outcome = run_python("import time\ntime.sleep(60)", SandboxConfig(wall_s=1.0))
  assert outcome == "timeout" and "over 1 s (wall clock)" in text
  text, outcome = run_python("print('started')\nwhile True: pass",
                             SandboxConfig(wall_s=30.0, cpu_s=1))
  assert outcome == "timeout" and text.startswith("started\n") and "CPU time" in text


def test_the_snippet_sees_an_empty_environment_and_its_own_directory():
  text, outcome = run_python(
      "import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read())\n"
      "sorted(os.environ)", FAST)
  assert outcome == "ok"
  assert text.startswith("hi\n") and "HOME" in text and "TOKEN" not in text


def test_environment_wraps_a_task():
  task = ArithmeticTask()
  env = PythonToolTask(task, FAST)
  p = env.problem(3)
  assert p == task.problem(3) and env.name == "arithmetic+python"
  assert env.reward(p, p.solution) == task.reward(p, p.solution) == 1.0
  assert env.tool_names() == ("python",)
  assert env.tool_schemas()[0]["function"]["parameters"]["required"] == ["code"]
  assert env.config == task.config  # other attributes are the task's
  assert env.call_tool(p, ToolCall("python", {"code": "2 ** 10"})) == "1024\n"
  assert env.call_tool(p, ToolCall("python", "print(5)")) == "5\n"  # plain-text arguments
  with pytest.raises(ToolError) as e:
    env.call_tool(p, ToolCall("python", {"code": "1 / 0"}))
  assert e.value.outcome == "error" and "ZeroDivisionError" in e.value.message
  with pytest.raises(ToolError, match="arguments"):
    env.call_tool(p, ToolCall("python", {"source": "1"}))
  back = pickle.loads(pickle.dumps(env))  # it travels to the worker processes
  assert back.problem(3) == p and back.sandbox == FAST


def test_refuses_a_task_with_tools_and_bad_limits():
  with pytest.raises(ValueError, match="already has tools"):
    PythonToolTask(CalculatorArithmeticTask())
  with pytest.raises(ValueError, match="memory_mb"):
    SandboxConfig(memory_mb=8)
  with pytest.raises(ValueError, match="outcome"):
    ToolError("x", "weird")
