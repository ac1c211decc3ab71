"""Verifiers that fail: raised, hung, returned garbage, or needing the main thread (signal.alarm).

A failed call has no reward (NaN), is counted and logged; a hung call's process is killed and
nothing is left behind; a verifier using signal.alarm works (it runs in a process's main thread).
"""

import json
import math
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import threading

from absl import logging
import numpy as np
import pytest

from rlax_pipe import tasks

PROBLEM = tasks.Problem(index=0, split="train", prompt="Q: 1+1\n", answer="2",
                        solution="1+1=2\nA: 2", difficulty=2.0)


# Verifiers are module-level classes: the worker processes import them by name.
class RaisingTask:
  name = "raising"

  def reward(self, problem, completion):
    raise KeyError("verifier bug")


class ValueTask:
  name = "value"

  def __init__(self, value):
    self.value = value

  def reward(self, problem, completion):
    return self.value


class AlarmTask:
  """Bounds its own run time with signal.alarm, like math-verify does."""

  name = "alarm"

  def reward(self, problem, completion):
    def on_alarm(signum, frame):
      raise TimeoutError("alarm")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(5)
    try:
      return 1.0 if completion.strip() == "A: 2" else 0.0
    finally:
      signal.alarm(0)
      signal.signal(signal.SIGALRM, previous)


class HangTask:
  """Loops forever on "hang" after writing its process id to `pid_file`."""

  name = "hang"

  def __init__(self, pid_file):
    self.pid_file = str(pid_file)

  def reward(self, problem, completion):
    if completion == "hang":
      with open(self.pid_file, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")
      while True:
        pass
    return 1.0


class UnloadableTask:
  """Pickles, but cannot be rebuilt in the verifier process."""

  name = "unloadable"

  def __init__(self):
    self.data_file = "data.bin"

  def __setstate__(self, state):
    raise RuntimeError("missing data file")

  def reward(self, problem, completion):
    return 1.0


class PrintingTask:
  """Prints to stdout (the replies' channel in the worker, were it not redirected)."""

  name = "printing"

  def reward(self, problem, completion):
    print("reward called with", completion, flush=True)
    os.write(1, b"raw bytes on fd 1\n")
    return 1.0


class ExitingTask:
  """Ends its process on "exit"."""

  name = "exiting"

  def reward(self, problem, completion):
    if completion == "exit":
      os._exit(3)
    return 1.0


@pytest.fixture
def warnings(monkeypatch):
  messages = []
  monkeypatch.setattr(logging, "warning", lambda msg, *args: messages.append(msg % args))
  return messages


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_scores_and_inline_classification(warnings):
  with tasks.VerifierPool(tasks.ArithmeticTask(), timeout_s=5.0) as pool:
    verdicts = pool.grade([(PROBLEM, "A: 2"), (PROBLEM, "A: 3")], sample_ids=[1, 2])
  assert [(v.reward, v.outcome) for v in verdicts] == [(1.0, "ok"), (0.0, "ok")]
  assert pool.stats.snapshot() == tasks.RewardCounts(ok=2) and not warnings
  stats = tasks.RewardStats()
  assert tasks.grade_inline(RaisingTask(), PROBLEM, "", stats=stats).outcome == "error"
  assert stats.snapshot() == tasks.RewardCounts(error=1)


def test_raising_reward_has_no_reward_and_is_logged(warnings):
  with tasks.VerifierPool(RaisingTask(), timeout_s=5.0) as pool:
    (v,) = pool.grade([(PROBLEM, "A: 2")], sample_ids=[17])
  assert math.isnan(v.reward) and v.outcome == "error" and "verifier bug" in v.detail
  assert pool.stats.snapshot() == tasks.RewardCounts(error=1)
  assert len(warnings) == 1 and "sample 17" in warnings[0] and "verifier bug" in warnings[0]


@pytest.mark.parametrize("value", [None, "1.0", True, float("nan"), float("inf"), [1.0]])
def test_invalid_values_have_no_reward(value):
  verdict = tasks.grade_inline(ValueTask(value), PROBLEM, "")
  assert math.isnan(verdict.reward) and verdict.outcome == "invalid"


def test_numpy_values_accepted():
  for value in (np.float32(0.5), np.int64(1)):
    verdict = tasks.grade_inline(ValueTask(value), PROBLEM, "")
    assert isinstance(verdict.reward, float) and verdict.reward == float(value)


def test_signal_alarm_verifier_works_in_worker_processes():
  # Off the main thread (where the sampler loop grades in threaded mode) signal.alarm fails ...
  box = {}
  thread = threading.Thread(target=lambda: box.update(
      v=tasks.grade_inline(AlarmTask(), PROBLEM, "A: 2")))
  thread.start()
  thread.join()
  assert box["v"].outcome == "error" and "main thread" in box["v"].detail
  # ... in a verifier process it runs in that process's main thread, from any calling thread.
  with tasks.VerifierPool(AlarmTask(), timeout_s=5.0) as pool:
    thread = threading.Thread(target=lambda: box.update(
        vs=pool.grade([(PROBLEM, "A: 2"), (PROBLEM, "A: 9")])))
    thread.start()
    thread.join()
  assert [v.reward for v in box["vs"]] == [1.0, 0.0]


def test_hung_verifier_is_killed_and_leaves_nothing_behind(tmp_path, warnings):
  pid_file = tmp_path / "pids"
  threads_before = threading.active_count()
  pool = tasks.VerifierPool(HangTask(pid_file), timeout_s=0.3, num_workers=2)
  try:
    for _ in range(3):  # three hangs, as in the issue
      verdicts = pool.grade([(PROBLEM, "hang"), (PROBLEM, "fine")], sample_ids=[42, 43])
      assert verdicts[0].outcome == "timeout" and math.isnan(verdicts[0].reward)
      assert verdicts[1].reward == 1.0  # the other call of the wave still scored
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 3 and not any(_alive(p) for p in pids)
    assert pool.restarts == 3 and pool.stats.timeouts == 3
    assert "sample 42" in warnings[0] and "timeout" in warnings[0]
    # The run goes on: the next calls work.
    assert pool.grade([(PROBLEM, "fine")])[0].reward == 1.0
  finally:
    pool.close()
  assert not multiprocessing.active_children()
  assert threading.active_count() == threads_before


def test_tasks_that_cannot_run_in_a_process_are_reported():
  with pytest.raises(ValueError, match="cannot be pickled"):
    tasks.VerifierPool(ValueTask(lambda: 1.0))
  with tasks.VerifierPool(UnloadableTask(), timeout_s=5.0) as pool:
    (v,) = pool.grade([(PROBLEM, "A: 2")])
  assert v.outcome == "error" and "could not be loaded" in v.detail
  assert "missing data file" in v.detail
  for bad in ({"timeout_s": 0.0}, {"num_workers": 0}, {"startup_timeout_s": -1.0}):
    with pytest.raises(ValueError):
      tasks.VerifierPool(tasks.ArithmeticTask(), **bad)


def test_stats_thread_safe_and_validated():
  stats = tasks.RewardStats()
  threads = [threading.Thread(target=lambda: [stats.record("ok") for _ in range(1000)])
             for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert stats.snapshot().ok == 4000 and stats.snapshot().total == 4000
  with pytest.raises(ValueError):
    stats.record("weird")


_USER_TASKS = '''
class SlowOrOk:
  name = "slow_or_ok"

  def reward(self, problem, completion):
    while completion == "hang":
      pass
    return 1.0
'''

# A user's script that starts its "run" at top level (no `if __name__ == "__main__":` guard), as
# the issue saw: every time it is executed it appends its pid to MARKER. A worker that imported
# it as its main module would run it again (at start and at every restart after a timeout).
_USER_SCRIPT = '''
import json, os, pathlib
from rlax_pipe import tasks
from user_tasks import SlowOrOk  # an importable module beside the script

with open({marker!r}, "a") as f:
  f.write(f"{{os.getpid()}}\\n")

class DefinedHere:
  name = "defined_here"
  def reward(self, problem, completion):
    return 1.0

P = tasks.Problem(index=0, split="train", prompt="Q\\n", answer="1", solution="A: 1")
out = {{"pid": os.getpid()}}
with tasks.VerifierPool(SlowOrOk(), timeout_s=0.5, num_workers=2) as pool:
  first = pool.grade([(P, "hang"), (P, "ok")])
  second = pool.grade([(P, "hang"), (P, "ok")])  # after a restart of the hung worker
  out["outcomes"] = [v.outcome for v in first + second]
  out["restarts"] = pool.restarts
try:
  tasks.VerifierPool(DefinedHere())
except ValueError as e:
  out["main_error"] = str(e)
print(json.dumps(out))
'''


def test_workers_never_run_the_calling_script(tmp_path):
  """Issue #27 item 9: worker starts and restarts do not execute the user's script."""
  marker = tmp_path / "ran"
  (tmp_path / "user_tasks.py").write_text(_USER_TASKS)
  script = tmp_path / "train.py"
  script.write_text(_USER_SCRIPT.format(marker=str(marker)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(pathlib.Path(tasks.__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                        env=env, cwd=tmp_path, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["outcomes"] == ["timeout", "ok", "timeout", "ok"] and out["restarts"] == 2
  assert marker.read_text().split() == [str(out["pid"])]  # only the script's own run
  assert "__main__.DefinedHere" in out["main_error"]
  assert "importable module" in out["main_error"]


def test_worker_stdout_prints_do_not_corrupt_replies():
  with tasks.VerifierPool(PrintingTask(), timeout_s=5.0) as pool:
    verdicts = pool.grade([(PROBLEM, "A: 2"), (PROBLEM, "A: 3")])
  assert [v.reward for v in verdicts] == [1.0, 1.0]


def test_worker_that_dies_is_an_error_and_is_replaced():
  with tasks.VerifierPool(ExitingTask(), timeout_s=5.0) as pool:
    verdicts = pool.grade([(PROBLEM, "exit"), (PROBLEM, "A: 2")])
    assert verdicts[0].outcome == "error" and "exited" in verdicts[0].detail
    assert pool.grade([(PROBLEM, "A: 2")])[0].reward == 1.0
    assert pool.restarts == 1


def test_workers_import_the_callers_rlax_pipe(tmp_path, monkeypatch):
  """Even when the caller found this rlax_pipe only through its own sys.path (no PYTHONPATH, run
  from another directory), the worker imports the same package."""
  from rlax_pipe.tasks import verifier_pool  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("PYTHONPATH", raising=False)
  proc = subprocess.run([sys.executable, "-P", "-c", "import rlax_pipe; print(rlax_pipe.__file__)"],
                        env=verifier_pool._worker_env(), cwd=tmp_path, capture_output=True,
                        text=True, timeout=60, check=True)
  assert pathlib.Path(proc.stdout.strip()).resolve() == pathlib.Path(
      tasks.__file__).resolve().parents[1] / "__init__.py"
