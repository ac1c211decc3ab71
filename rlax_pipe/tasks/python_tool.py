"""A sandboxed Python tool and the environment that adds it to any task (tool-integrated
reasoning: the model writes a Python snippet, sees what it prints, and goes on).

`run_python(code, limits)` runs one snippet in a fresh interpreter subprocess
(`python -I -S -u`: isolated mode, no site hooks, unbuffered; started from the verifier worker
process that serves the tool call; the site-packages directories are put on its path without
running their .pth files) and returns
(text the model sees, outcome):

  - "ok": the snippet's stdout and stderr, interleaved as a terminal shows them; when the last
    statement is an expression, its repr is printed as an interactive interpreter would
    (None is not);
  - "error": it raised (the traceback, cut to the snippet's own frames) or exited non-zero;
  - "timeout": it ran past `SandboxConfig.wall_s` (wall clock; its process group is killed) or
    past `cpu_s` of CPU time (RLIMIT_CPU: SIGXCPU, then SIGKILL one second later);
  - "too_long": it printed more than `max_output_bytes` (killed at once);
  - "resource": it ran out of memory (RLIMIT_AS: MemoryError). A file written past
    `max_file_mb` (RLIMIT_FSIZE) is an OSError "File too large" in the snippet: an "error".

What the sandbox does: resource limits (address space, CPU time, file size, no core files) set
in the child before the snippet runs; a wall-clock limit and an output cap enforced by the
parent, which kills the child's whole process group; a fresh empty working directory (deleted
afterwards) that is also HOME and TMPDIR; an empty environment (no inherited variables, so no
tokens or keys from the run's environment); stdin closed; the child dies with its parent
(PR_SET_PDEATHSIG on Linux), so a worker killed by `EnvConfig.tool_timeout_s` leaves nothing
behind. A Python audit hook (PEP 578), installed before the snippet runs and impossible to
remove from Python code, refuses: sockets (no network), new processes (subprocess, os.system,
fork, exec, spawn, posix_spawn), signals to other processes, ctypes (foreign calls and library
loading), raising resource limits, and files written, created, renamed or removed outside the
working directory. Each refusal is a PermissionError in the snippet (its traceback goes to the
model).

What it does NOT protect against (use a container, gVisor or nsjail for untrusted code):
audit hooks are not a security boundary (PEP 578 says so); native code in extension modules
(numpy, sympy's dependencies, anything importable) bypasses them, and a determined snippet can
find a way out through such code; files readable by the run's user can be read; CPU and memory
are limited per snippet, not across snippets running at once (`EnvConfig.tool_workers` of
them); threads share the CPU limit but can use several cores meanwhile; the interpreter and the
packages it can import are the run's own (a snippet can import anything installed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import site
import subprocess
import sys
import tempfile
import time
from typing import Any

from rlax_pipe.tasks import base as task_base
from rlax_pipe.tasks.tools import ToolCall, ToolError

# Exit codes of the child's bootstrap (below) besides 0 / the snippet's own sys.exit code.
_EXIT_RAISED, _EXIT_MEMORY = 97, 98
_READ_CHUNK = 1 << 14


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Limits of one Python snippet (see the module docstring).

  Attributes:
    wall_s: wall-clock limit, seconds (> 0), counted from the interpreter's start; keep it
      below `EnvConfig.tool_timeout_s` (the worker pool's hard limit, which kills the worker).
    cpu_s: CPU-time limit, whole seconds (>= 1; RLIMIT_CPU).
    memory_mb: address-space limit, MiB (>= 64; RLIMIT_AS; the interpreter itself takes
      ~30 MiB, numpy ~150 MiB more).
    max_output_bytes: bytes of stdout + stderr kept (>= 1); more is a "too_long" failure.
    max_file_mb: largest file the snippet may write, MiB (>= 0; RLIMIT_FSIZE).
    max_code_chars: longest snippet accepted, characters (>= 1).
  """

  wall_s: float = 4.0
  cpu_s: int = 2
  memory_mb: int = 512
  max_output_bytes: int = 4096
  max_file_mb: int = 1
  max_code_chars: int = 16384

  def __post_init__(self):
    if not self.wall_s > 0:
      raise ValueError(f"--config.env.python.wall_s={self.wall_s} must be > 0 seconds.")
    for name, low in (("cpu_s", 1), ("memory_mb", 64), ("max_output_bytes", 1),
                      ("max_file_mb", 0), ("max_code_chars", 1)):
      if getattr(self, name) < low:
        raise ValueError(f"--config.env.python.{name}={getattr(self, name)} must be >= {low}.")


# The child's bootstrap: limits, the audit hook, then the snippet (read from stdin) as __main__.
_BOOT = r'''
import ast, builtins, json, os, resource, sys, traceback
lim = json.loads(sys.argv[1])
sys.path.extend(lim["site"])  # installed packages, without running their .pth files (-S)
code = sys.stdin.read()
sys.stdin.close()
sys.stdin = open(os.devnull)
try:  # die with the parent (Linux): a killed worker leaves no snippet behind
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except Exception:
    pass
mb = 1 << 20
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (lim["max_file_mb"] * mb, lim["max_file_mb"] * mb))
resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * mb, lim["memory_mb"] * mb))
sys.dont_write_bytecode = True
ROOT = os.path.realpath(os.getcwd())
DENY = ("socket.", "subprocess.", "os.system", "os.exec", "os.fork", "os.forkpty",
        "os.posix_spawn", "os.spawn", "os.kill", "os.killpg", "os.startfile", "pty.",
        "ctypes.", "resource.setrlimit", "resource.prlimit", "os.chroot", "os.setuid")
PATHS = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1,
         "os.chown": 1, "os.symlink": 2, "os.link": 2, "os.truncate": 1, "os.utime": 1,
         "shutil.rmtree": 1, "shutil.move": 2, "shutil.copyfile": 2, "os.chdir": 1}
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def inside(path):
    if isinstance(path, int):
        return True
    try:
        path = os.fsdecode(os.fspath(path))
    except TypeError:
        return False
    real = os.path.realpath(os.path.join(ROOT, path))
    return real == ROOT or real.startswith(ROOT + os.sep)

def hook(event, args):
    if event.startswith(DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, 0))[:3]
        writing = (any(c in (mode or "") for c in "wax+") or bool((flags or 0) & WRITE))
        if writing and not inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
    elif event in PATHS:
        for path in args[:PATHS[event]]:
            if not inside(path):
                raise PermissionError(f"sandbox: {event} on {path!r} outside the working "
                                      "directory")

import linecache
linecache.cache["<snippet>"] = (len(code), None, code.splitlines(True), "<snippet>")
sys.addaudithook(hook)
ns = {"__name__": "__main__", "__builtins__": builtins}
try:
    tree = ast.parse(code, "<snippet>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<snippet>", "exec"), ns)
    if last is not None:
        value = eval(compile(last, "<snippet>", "eval"), ns)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except MemoryError:
    sys.stdout.flush()
    print(f"MemoryError: over {lim['memory_mb']} MiB", flush=True)
    os._exit(98)
except BaseException as e:  # the snippet's own frames and the exception
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "<snippet>"]
    lines = (["Traceback (most recent call last):\n"] + traceback.format_list(frames)
             if frames else []) + traceback.format_exception_only(type(e), e)
    sys.stdout.flush()
    print("".join(lines).rstrip(), flush=True)
    os._exit(97)
'''


def _site_dirs() -> list[str]:
  """This interpreter's site-packages directories (the snippet may import what is installed)."""
  return [d for d in site.getsitepackages() if os.path.isdir(d)]


def _child_env(root: str) -> dict[str, str]:
  return {"PATH": os.defpath, "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8",
          "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _read_capped(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, str]:
  """The child's output until it closes its end, the deadline, or more than `cap` bytes:
  (bytes read, "" | "timeout" | "too_long")."""
  fd, chunks, size = proc.stdout.fileno(), [], 0
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      return b"".join(chunks), "timeout"
    readable, _, _ = select.select([fd], [], [], left)
    if not readable:
      continue
    chunk = os.read(fd, _READ_CHUNK)
    if not chunk:
      return b"".join(chunks), ""
    chunks.append(chunk)
    size += len(chunk)
    if size > cap:
      return b"".join(chunks), "too_long"


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def run_python(code: str, limits: SandboxConfig = SandboxConfig()) -> tuple[str, str]:
  """Runs one Python snippet in a fresh sandboxed interpreter (see the module docstring).

  Args:
    code: the snippet's source.
    limits: the sandbox's limits.

  Returns:
    (text, outcome): what the model sees and one of "ok", "error", "timeout", "too_long",
    "resource". Never raises for anything the snippet does.

  Raises:
    TypeError: when `code` is not a str.
    OSError: when no interpreter process can be started at all.

  Example:
    >>> run_python("x = 6 * 7\\nx")
    ('42\\n', 'ok')
  """
  if not isinstance(code, str):
    raise TypeError(f"code must be a str, got {type(code).__name__}.")
  if len(code) > limits.max_code_chars:
    return (f"the snippet has {len(code)} characters; at most {limits.max_code_chars} are "
            "run", "error")
  lim = {k: getattr(limits, k) for k in ("cpu_s", "memory_mb", "max_file_mb")}
  lim["site"] = _site_dirs()
  with tempfile.TemporaryDirectory(prefix="rlax_python_") as root:
    t0 = time.monotonic()
    proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-I", "-S", "-u", "-c", _BOOT, json.dumps(lim)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=root, env=_child_env(root),
        start_new_session=True, close_fds=True)
    try:
      try:
        proc.stdin.write(code.encode("utf-8", "surrogatepass"))
        proc.stdin.close()
      except BrokenPipeError:
        pass
      out, cut = _read_capped(proc, t0 + limits.wall_s, limits.max_output_bytes)
    finally:
      _kill_group(proc)  # the snippet's leftovers, if any, go with it
      rc = proc.wait()
      proc.stdout.close()
  text = out[:limits.max_output_bytes].decode("utf-8", "replace")
  if cut == "timeout":
    return text + f"TimeoutError: over {limits.wall_s:g} s (wall clock)", "timeout"
  if cut == "too_long":
    return f"output over {limits.max_output_bytes} bytes; print less", "too_long"
  if rc == 0:
    return text, "ok"
  if rc == _EXIT_RAISED:
    return text, "error"
  if rc == _EXIT_MEMORY:
    return text, "resource"
  if rc in (-signal.SIGXCPU, -signal.SIGKILL):
    return text + f"TimeoutError: over {limits.cpu_s} s of CPU time", "timeout"
  if rc < 0:
    return text + f"the snippet's process ended by signal {signal.Signals(-rc).name}", "error"
  return text + f"SystemExit: exit code {rc}", "error"


def _tool_schema() -> dict:
  return {"type": "function", "function": {
      "name": "python",
      "description": ("Runs a Python 3 snippet in a fresh interpreter and returns what it "
                      "prints (the value of a last expression is printed too). No network, "
                      "no files outside its directory, limited time and memory."),
      "parameters": {"type": "object", "properties": {
          "code": {"type": "string", "description": "the Python source to run"}},
                     "required": ["code"]}}}


class PythonToolTask:
  """A task with a sandboxed Python tool "python": an environment (`rlax_pipe.envs`) whose
  problems, prompts and rewards are the wrapped task's (the reward grades the last turn).

  Calls: the plain-text protocol (`rlax_pipe.envs.CodeBlockProtocol`) reads a turn that ends
  with a ```python fenced block; chat prompts use the chat template's tool calls
  (`tool_schemas`, arguments {"code": ...}). Each call runs `run_python` in the verifier worker
  process serving it; a failure is raised as a `ToolError`, so the model sees the traceback (or
  the limit it hit) and the call is counted under its outcome, without killing the worker.

  Args:
    task: the wrapped task (no tools of its own).
    sandbox: the snippet limits.

  Raises:
    ValueError: when `task` already has tools.

  Example:
    >>> env = PythonToolTask(ArithmeticTask())
    >>> env.call_tool(env.problem(0), ToolCall("python", {"code": "3 + 4"}))
    '7\\n'
  """

  code_fence = "python"  # the plain-text protocol's fence language

  def __init__(self, task: task_base.Task, sandbox: SandboxConfig = SandboxConfig()):
    if callable(getattr(task, "call_tool", None)):
      raise ValueError(f"task {getattr(task, 'name', task)!r} already has tools "
                       f"{tuple(task.tool_names())}; the Python tool is added to a task "
                       "without tools (e.g. 'arithmetic', 'dataset_file', 'reasoning_gym').")
    self.task, self.sandbox = task, sandbox
    self.name = f"{getattr(task, 'name', type(task).__name__)}+python"

  def __getattr__(self, name: str) -> Any:  # the wrapped task's other attributes
    if name.startswith("__") or name in ("task", "sandbox"):
      raise AttributeError(name)
    return getattr(self.task, name)

  def problem(self, index: int, split: str = "train") -> task_base.Problem:
    """The wrapped task's problem."""
    return self.task.problem(index, split)

  def num_problems(self, split: str = "train") -> int | None:
    """The wrapped task's count."""
    return self.task.num_problems(split)

  def sample_prompts(self, rng, n: int, split: str = "train") -> list[task_base.Problem]:
    """The wrapped task's draw."""
    return self.task.sample_prompts(rng, n, split)

  def reward(self, problem: task_base.Problem, completion: str) -> float:
    """The wrapped task's reward of the completion (the episode's last turn)."""
    return self.task.reward(problem, completion)

  def tool_names(self) -> tuple[str, ...]:
    """("python",)."""
    return ("python",)

  def tool_schemas(self) -> list[dict]:
    """The tool's JSON schema for chat templates (`tools=`)."""
    return [_tool_schema()]

  def call_tool(self, problem: task_base.Problem, call: ToolCall) -> str:
    """What the snippet printed (runs in a worker process).

    Raises:
      ToolError: with the text for the model, when the call is malformed or the snippet
        failed (outcome "error", "timeout", "too_long" or "resource").
    """
    del problem
    args = call.arguments
    code = args.get("code") if isinstance(args, dict) else args
    if call.name != "python" or not isinstance(code, str):
      raise ToolError(f"call the tool 'python' with arguments {{\"code\": \"<source>\"}}; got "
                      f"{call.name!r} with {args!r:.100}")
    text, outcome = run_python(code, self.sandbox)
    if outcome != "ok":
      raise ToolError(text, outcome)
    return text
