"""Ending a multi-process job when one of its processes fails, within a bounded time.

A dead process is found by its link (`links`: the socket closes at once when a process exits;
a process that stops sending heartbeats for `fault_timeout_s` is declared dead) or reports its
own error. The first fault wins: it is logged with the process and its role, every callback runs
(the lead tells the other processes; queues and waits wake up with `ProcessFault`), and a timer
ends this process with `os._exit` after `exit_grace_s` if it has not exited by itself (a thread
blocked in a collective or a transfer with a dead peer never returns, and `jax.distributed`'s
shutdown barrier would wait for the dead process).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, Iterator

from absl import logging

# Exit status of a process ended by a fault of the job (its own or another process's).
FAULT_EXIT_CODE = 3


class ProcessFault(RuntimeError):
  """The job cannot continue: a process died, hung, or failed (the message names it)."""


class FaultMonitor:
  """The first fault of this process's view of the job, its callbacks and the exit timer.

  Args:
    whoami: this process's name, e.g. "sampler replica 1 (process 3)" (prefixes log lines).
    exit_grace_s: seconds between a fault and `os._exit(FAULT_EXIT_CODE)` of this process;
      None = never force the exit (tests of single components).
  """

  def __init__(self, whoami: str, exit_grace_s: float | None):
    self.whoami, self._grace = whoami, exit_grace_s
    self._lock = threading.Lock()
    self._error: str | None = None
    self._callbacks: list[Callable[[str], None]] = []
    self._closed = False

  @property
  def error(self) -> str | None:
    """The first fault's message, or None."""
    with self._lock:
      return self._error

  def on_fault(self, callback: Callable[[str], None]) -> None:
    """Registers `callback(message)`, run once at the first fault (at once if there was one)."""
    with self._lock:
      self._callbacks.append(callback)
      error = self._error
    if error is not None:
      callback(error)

  def report(self, message: str) -> bool:
    """Records a fault; the first one logs, runs the callbacks and arms the exit timer.

    Returns:
      True if this was the first fault.
    """
    with self._lock:
      if self._error is not None or self._closed:
        return False
      self._error = message
      callbacks = list(self._callbacks)
    logging.error("[%s] job fault: %s", self.whoami, message)
    print(f"[{self.whoami}] job fault: {message}", file=sys.stderr, flush=True)
    for cb in callbacks:
      try:
        cb(message)
      except Exception as e:  # pylint: disable=broad-except  (a callback must not mask the fault)
        logging.error("[%s] fault callback failed: %s", self.whoami, e)
    if self._grace is not None:
      timer = threading.Timer(self._grace, self._force_exit, args=(message,))
      timer.daemon = True
      timer.start()
    return True

  def _force_exit(self, message: str) -> None:
    print(f"[{self.whoami}] ending this process {self._grace:.0f} s after the job fault: "
          f"{message}", file=sys.stderr, flush=True)
    logging.flush()
    os._exit(FAULT_EXIT_CODE)  # pylint: disable=protected-access

  def check(self) -> None:
    """Raises `ProcessFault` if a fault was reported."""
    error = self.error
    if error is not None:
      raise ProcessFault(error)

  def close(self) -> None:
    """The job ended normally: later reports (links closing at shutdown) are ignored."""
    with self._lock:
      self._closed = True

  @contextlib.contextmanager
  def deadline(self, what: str, seconds: float) -> Iterator[None]:
    """Reports a fault if the body runs longer than `seconds` (e.g. a collective whose peer
    hangs: the body itself cannot be interrupted, the exit timer then ends the process)."""
    timer = threading.Timer(seconds, lambda: self.report(
        f"{self.whoami}: {what} did not finish within {seconds:.0f} s"))
    timer.daemon = True
    timer.start()
    try:
      yield
    finally:
      timer.cancel()
