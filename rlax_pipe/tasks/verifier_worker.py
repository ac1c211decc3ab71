"""The verifier worker process: the package's own entry point, never the user's script.

Started by `verifier_pool.VerifierPool` as `python -P -m rlax_pipe.tasks.verifier_worker`, so its
`__main__` is this module. (multiprocessing's "spawn" and "forkserver" start methods instead
re-import the calling script as the worker's main module, `multiprocessing.spawn.
_fixup_main_from_path`: a script that starts a run at top level would start it again in every
worker, at every restart.) The worker runs only what it is sent: the pickled task, then one
`task.reward(problem, completion)` per request.

Protocol (`verifier_pool.read_message` / `write_message`): each message is a pickle framed by its length as an
8-byte little-endian unsigned integer, on the worker's stdin (requests) and on a copy of its
original stdout (replies); the worker's file descriptor 1 is pointed at stderr, so whatever a
verifier prints cannot corrupt the replies.

  parent -> worker: ("init", sys_path, task_bytes), then ("call", problem, completion) or
    ("tool", problem, tool_call) ...;
  worker -> parent: ("ready", error or None), then (reward, outcome, detail) per "call" and
    (text, outcome, detail) per "tool" (`rlax_pipe.envs.tools.call_tool_safely`).

The worker exits when its stdin closes (the parent ended or died) or on SIGINT.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import BinaryIO

from rlax_pipe.tasks import safe_reward
from rlax_pipe.tasks.verifier_pool import read_message
from rlax_pipe.tasks.verifier_pool import write_message


def _load_task(sys_path: list[str], task_bytes: bytes):
  """(task, None) or (None, why it could not be loaded)."""
  for entry in sys_path:  # the parent's import path (as multiprocessing's spawn passes it)
    if entry not in sys.path:
      sys.path.append(entry)
  try:
    return pickle.loads(task_bytes), None
  except Exception as e:  # pylint: disable=broad-except
    return None, f"the task could not be loaded in the verifier process: {e!r}"[:500]


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
  """Runs the protocol until `requests` ends."""
  try:
    _, sys_path, task_bytes = read_message(requests)
  except EOFError:
    return
  task, error = _load_task(sys_path, task_bytes)
  write_message(replies, ("ready", error))
  while True:
    try:
      kind, problem, payload = read_message(requests)
    except EOFError:
      return
    if error is not None:
      write_message(replies, (float("nan"), "error", error))
      continue
    if kind == "tool":
      write_message(replies, safe_reward.call_tool(task, problem, payload))
      continue
    v = safe_reward.call_verifier(task, problem, payload)
    write_message(replies, (v.reward, v.outcome, v.detail))


def main() -> None:
  """Entry point: replies go to a private copy of stdout; fd 1 becomes stderr."""
  replies = os.fdopen(os.dup(1), "wb")
  os.dup2(2, 1)
  try:
    serve(sys.stdin.buffer, replies)
  except (KeyboardInterrupt, BrokenPipeError):
    pass


if __name__ == "__main__":
  main()
