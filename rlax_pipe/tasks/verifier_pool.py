"""Verifiers in worker processes with a hard time limit.

Why processes: a reward function may loop forever, hold the GIL, or use `signal.alarm` for its
own timeouts (math-verify does), which only works in the main thread of a process. In a worker
process the verifier runs in that process's main thread, and a hung call is ended by killing the
process, so nothing is left behind (a thread cannot be killed; an abandoned one keeps running).

How: `VerifierPool` keeps `num_workers` processes, each started with `subprocess` as
`python -P -m rlax_pipe.tasks.verifier_worker` (the package's own entry point, see that module):
a worker never imports the calling script, so a script that starts a run at top level is not
run again in the workers, at their start or at a restart after a timeout (multiprocessing's
"spawn" / "forkserver" workers re-import the script as their main module). The task is pickled
once and sent to each worker at its start, with the parent's `sys.path`. `grade` runs calls in
waves of at most `num_workers` (one call per idle worker) that share one deadline, `timeout_s`
after the wave starts. Calls that have not returned by then are timeouts; their workers are
killed and reaped, and fresh ones are started for the next wave. Worker start-up (imports,
unpickling the task) happens before any deadline starts.

The task must be picklable by reference to an importable module: a class defined in the script
being run (`__main__`) cannot be rebuilt without running that script, so `VerifierPool` refuses
it with a message naming the class. A task that fails to load in the worker makes every call an
"error" naming why.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
import os
import pathlib
import pickle
import pickletools
import select
import site
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO

from absl import logging

from rlax_pipe.tasks import base
from rlax_pipe.tasks import safe_reward

WORKER_MODULE = "rlax_pipe.tasks.verifier_worker"
_LOG_FIRST = 20    # failures logged one by one, then every _LOG_EVERY-th
_LOG_EVERY = 100
_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
_HEADER = struct.Struct("<Q")


def write_message(stream: BinaryIO, obj: Any) -> None:
  """Writes `obj` as one length-framed pickle (`verifier_worker`'s protocol) and flushes."""
  body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  stream.write(_HEADER.pack(len(body)) + body)
  stream.flush()


def read_message(stream: BinaryIO) -> Any:
  """Reads one length-framed pickle; raises EOFError when the stream ends first."""
  header = _read_exactly(stream, _HEADER.size)
  return pickle.loads(_read_exactly(stream, _HEADER.unpack(header)[0]))


def _read_exactly(stream: BinaryIO, n: int) -> bytes:
  chunks, left = [], n
  while left:
    chunk = stream.read(left)
    if not chunk:
      raise EOFError("stream closed")
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


def main_module_refs(data: bytes) -> list[str]:
  """Names a pickle looks up in `__main__` (e.g. ["__main__.MyTask"]); [] when none."""
  refs, strings = [], []
  for op, arg, _ in pickletools.genops(data):
    if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
      strings.append(arg)
    elif op.name == "STACK_GLOBAL" and len(strings) >= 2 and strings[-2] == "__main__":
      refs.append(f"__main__.{strings[-1]}")
    elif op.name in ("GLOBAL", "INST") and str(arg).startswith("__main__ "):
      refs.append("__main__." + str(arg).split(" ", 1)[1])
  return sorted(set(refs))


def _worker_env() -> dict[str, str]:
  """The environment of a worker: this one, with the directory holding this `rlax_pipe` first on
  PYTHONPATH unless it is a site-packages directory (an installed package is found there anyway;
  putting site-packages before the standard library could shadow it)."""
  env = dict(os.environ)
  site_dirs = {os.path.realpath(d) for d in site.getsitepackages() + [site.getusersitepackages()]}
  if os.path.realpath(_PACKAGE_ROOT) not in site_dirs:
    env["PYTHONPATH"] = os.pathsep.join(
        [_PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


class _Worker:
  """One worker process: its pipes and a buffer of reply bytes read so far."""

  def __init__(self):
    self.proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-P", "-m", WORKER_MODULE], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, env=_worker_env(), close_fds=True)
    self.fd = self.proc.stdout.fileno()
    os.set_blocking(self.fd, False)
    self._buffer = b""
    self.ready = False  # True once it answered "ready"

  def start(self, task_bytes: bytes) -> None:
    """Sends the task and the parent's import path (the worker answers "ready" once loaded)."""
    write_message(self.proc.stdin, ("init", list(sys.path), task_bytes))

  def send(self, problem: base.Problem, payload: Any, kind: str = "call") -> None:
    """Sends one call: kind "call" = `task.reward(problem, payload)`; "tool" =
    `task.call_tool(problem, payload)` (an environment's tool, `rlax_pipe.envs`)."""
    write_message(self.proc.stdin, (kind, problem, payload))

  def poll_reply(self):
    """Reads what the pipe holds; the reply once complete, else None. EOFError if it died."""
    while True:
      try:
        chunk = os.read(self.fd, 1 << 16)
      except BlockingIOError:
        break
      if not chunk:
        raise EOFError(f"the verifier process exited (code {self.proc.poll()})")
      self._buffer += chunk
    size = _HEADER.size
    if len(self._buffer) < size:
      return None
    (n,) = _HEADER.unpack(self._buffer[:size])
    if len(self._buffer) < size + n:
      return None
    body, self._buffer = self._buffer[size:size + n], self._buffer[size + n:]
    return pickle.loads(body)

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()
    for stream in (self.proc.stdin, self.proc.stdout):
      try:
        stream.close()
      except OSError:
        pass


def _wait_replies(workers: list[_Worker], deadline: float) -> dict[int, object]:
  """Replies of `workers` (index -> reply, or the EOFError of a dead worker) until `deadline`."""
  out: dict[int, object] = {}
  while len(out) < len(workers):
    pending = {w.fd: k for k, w in enumerate(workers) if k not in out}
    left = deadline - time.monotonic()
    if left <= 0:
      break
    readable, _, _ = select.select(list(pending), [], [], left)
    for fd in readable:
      k = pending[fd]
      try:
        reply = workers[k].poll_reply()
      except EOFError as e:
        reply = e
      if reply is not None:
        out[k] = reply
  return out


class VerifierPool:
  """Runs `task.reward` in worker processes with a hard per-call time limit.

  Example:
    >>> with VerifierPool(task, timeout_s=5.0) as pool:
    ...   verdicts = pool.grade([(problem, "A: 7")], sample_ids=[0])
    >>> verdicts[0].reward
    1.0
  """

  def __init__(self, task: base.Task, *, timeout_s: float = 5.0, num_workers: int = 1,
               startup_timeout_s: float = 120.0):
    """Checks the task can be sent to a worker; processes start at the first `grade`.

    Args:
      task: the task whose `reward` is called.
      timeout_s: time limit of one call (seconds, > 0).
      num_workers: worker processes (>= 1), i.e. calls run at once.
      startup_timeout_s: limit for the workers to start (imports + unpickling the task).

    Raises:
      ValueError: on a bad argument, a task that cannot be pickled, or one whose pickle refers
        to the script being run (`__main__`), naming why.
    """
    if not timeout_s > 0 or not startup_timeout_s > 0:
      raise ValueError(f"timeout_s={timeout_s} and startup_timeout_s={startup_timeout_s} must "
                       "be > 0.")
    if num_workers < 1:
      raise ValueError(f"num_workers={num_workers} must be >= 1.")
    name = getattr(task, "name", type(task).__name__)
    try:
      self._task_bytes = pickle.dumps(task)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"task {name!r} cannot be pickled for the verifier processes ({e!r}); "
                       "define it in an importable module.") from e
    refs = main_module_refs(self._task_bytes)
    if refs:
      raise ValueError(
          f"task {name!r} refers to {', '.join(refs)}, defined in the script being run; the "
          "verifier processes never run that script (it may start a run), so they cannot "
          "rebuild it. Move the definition into an importable module and import it.")
    self.task_name = name
    self.timeout_s, self.num_workers = float(timeout_s), int(num_workers)
    self.startup_timeout_s = float(startup_timeout_s)
    self._workers: list[_Worker] = []
    self._lock = threading.Lock()
    self.stats = safe_reward.RewardStats()
    self.restarts = 0  # workers killed because a call hung (or their process died)

  # ---- processes --------------------------------------------------------------------------------
  def _spawn_missing(self) -> None:
    """Starts processes up to `num_workers` without waiting for them (their imports overlap
    whatever the caller does next; `_ensure_workers` waits)."""
    fresh = [_Worker() for _ in range(self.num_workers - len(self._workers))]
    self._workers.extend(fresh)
    for worker in fresh:  # all import at once; each reads its task when it is ready to
      worker.start(self._task_bytes)

  def _ensure_workers(self) -> list[_Worker]:
    """Starts missing workers and waits for every one to be ready (before any call's deadline).

    Raises:
      RuntimeError: when a worker cannot be started, exits while starting, or is not ready
        within `startup_timeout_s`.
    """
    try:
      self._spawn_missing()
    except (OSError, ValueError) as e:
      self._kill()
      raise RuntimeError(f"verifier processes of task {self.task_name!r} could not be started: "
                         f"{e!r}") from e
    starting = [w for w in self._workers if not w.ready]
    if starting:
      replies = _wait_replies(starting, time.monotonic() + self.startup_timeout_s)
      if len(replies) < len(starting) or any(isinstance(r, EOFError) for r in replies.values()):
        self._kill()
        raise RuntimeError(f"verifier processes of task {self.task_name!r} did not start "
                           f"within {self.startup_timeout_s:.0f} s (or exited while starting; "
                           "their stderr says why).")
      for w in starting:
        w.ready = True
    return self._workers

  def _kill(self) -> None:
    workers, self._workers = self._workers, []
    for w in workers:
      w.kill()

  def close(self) -> None:
    """Ends the worker processes (idempotent). A later `grade` starts new ones."""
    with self._lock:
      self._kill()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ---- grading ---------------------------------------------------------------------------------
  def grade(self, items: Sequence[tuple[base.Problem, str]],
            sample_ids: Sequence[int] | None = None) -> list[safe_reward.Verdict]:
    """Verdicts of `task.reward(problem, completion)` for each (problem, completion) item.

    Args:
      items: (problem, decoded completion) pairs.
      sample_ids: ids written in the log lines of failures (default: positions).

    Returns:
      One `Verdict` per item, in order (reward NaN for failures).

    Raises:
      RuntimeError: when the worker processes cannot be started.
    """
    sample_ids = list(range(len(items))) if sample_ids is None else list(sample_ids)
    out = [safe_reward.Verdict(*reply) for reply in self.run_calls(items, "call")]
    for sid, v in zip(sample_ids, out):
      self.stats.record(v.outcome)
      if v.failed:
        self._log_failure(sid, v)
    return out

  def run_calls(self, items: Sequence[tuple[base.Problem, Any]], kind: str = "call"
                ) -> list[tuple[Any, str, str]]:
    """Runs calls of one kind in the workers, in waves with the hard time limit (see the module
    docstring). kind "call": `task.reward(problem, completion)`; "tool": `task.call_tool(
    problem, call)` of an environment (`rlax_pipe.envs`).

    Returns:
      One (value, outcome, detail) per item, in order; value is NaN when the call failed
      (outcome "error", "timeout" or "invalid").

    Raises:
      RuntimeError: when the worker processes cannot be started.
    """
    out: list[tuple[Any, str, str]] = []
    with self._lock:
      for start in range(0, len(items), self.num_workers):
        out.extend(self._wave(items[start:start + self.num_workers], kind))
    return out

  def _wave(self, wave, kind: str) -> list[tuple[Any, str, str]]:
    workers = self._ensure_workers()
    verdicts: dict[int, tuple[Any, str, str]] = {}
    busy, dead = [], set()
    for k, (problem, payload) in enumerate(wave):
      try:
        workers[k].send(problem, payload, kind)
        busy.append(k)
      except (pickle.PicklingError, TypeError, AttributeError) as e:  # e.g. unpicklable problem
        verdicts[k] = (math.nan, "error", repr(e)[:500])
      except OSError as e:  # the worker died between waves
        dead.add(k)
        verdicts[k] = (math.nan, "error", f"verifier process gone: {e!r}")
    replies = _wait_replies([workers[k] for k in busy], time.monotonic() + self.timeout_s)
    for j, k in enumerate(busy):
      reply = replies.get(j)
      if reply is None:
        dead.add(k)
        verdicts[k] = (math.nan, "timeout", f"no result within {self.timeout_s:.3g} s")
      elif isinstance(reply, EOFError):
        dead.add(k)
        verdicts[k] = (math.nan, "error", str(reply))
      else:
        verdicts[k] = tuple(reply)
    for k in sorted(dead, reverse=True):
      self.restarts += 1
      self._workers.pop(k).kill()
    if dead:  # replacements start now, so their start-up overlaps the caller's next work
      try:
        self._spawn_missing()
      except (OSError, ValueError):
        pass  # retried (and reported) by the next wave's _ensure_workers
    return [verdicts[k] for k in range(len(wave))]

  def _log_failure(self, sample_id: int, v: safe_reward.Verdict) -> None:
    failed = self.stats.snapshot().failed
    if failed <= _LOG_FIRST or failed % _LOG_EVERY == 0:
      logging.warning("Reward of task %s for sample %d failed (%s: %s); no reward, excluded from "
                      "its group's baseline and the loss (%d failures so far).", self.task_name,
                      sample_id, v.outcome, v.detail, failed)
