"""Verifiers in worker processes with a hard time limit (stdlib `multiprocessing.Pool`).

Why processes: a reward function may loop forever, hold the GIL, or use `signal.alarm` for its
own timeouts (math-verify does), which only works in the main thread of a process. In a worker
process the verifier runs in that process's main thread, and a hung call is ended by killing the
process, so nothing is left behind (a thread cannot be killed; an abandoned one keeps running).

How: `VerifierPool` keeps `num_workers` processes (start method "forkserver" by default: they are
forked from a clean server process, never from the JAX process). The task is pickled once per
worker start. `grade` runs calls in waves of at most `num_workers` (one call per idle worker) that
share one deadline, `timeout_s` after the wave starts. Calls that have not returned by then are
timeouts; the pool is then terminated (every worker process killed and reaped) and a fresh one is
started for the next wave. Worker start-up (imports, unpickling the task) happens before any
deadline starts.

The task must be picklable and importable by a fresh interpreter (a class defined in an importable
module; for a script, under `if __name__ == "__main__":`). A task that fails to load in the worker
makes every call an "error" naming why.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
import multiprocessing
import pickle
import threading
import time

from absl import logging

from rlax_pipe.tasks import base
from rlax_pipe.tasks import safe_reward

START_METHODS: tuple[str, ...] = ("forkserver", "spawn", "fork")
_LOG_FIRST = 20    # failures logged one by one, then every _LOG_EVERY-th
_LOG_EVERY = 100

_worker_task = None
_worker_error: str | None = None


def _init_worker(task_bytes: bytes, ready) -> None:
  """Worker start-up: unpickle the task (never raise: a failure is reported per call)."""
  global _worker_task, _worker_error  # pylint: disable=global-statement
  try:
    _worker_task = pickle.loads(task_bytes)
  except Exception as e:  # pylint: disable=broad-except
    _worker_error = f"the task could not be loaded in the verifier process: {e!r}"[:500]
  ready.release()


def _worker_call(problem: base.Problem, completion: str) -> tuple[float, str, str]:
  if _worker_error is not None:
    return math.nan, "error", _worker_error
  v = safe_reward.call_verifier(_worker_task, problem, completion)
  return v.reward, v.outcome, v.detail


class VerifierPool:
  """Runs `task.reward` in worker processes with a hard per-call time limit.

  Example:
    >>> with VerifierPool(task, timeout_s=5.0) as pool:
    ...   verdicts = pool.grade([(problem, "A: 7")], sample_ids=[0])
    >>> verdicts[0].reward
    1.0
  """

  def __init__(self, task: base.Task, *, timeout_s: float = 5.0, num_workers: int = 1,
               start_method: str = "forkserver", startup_timeout_s: float = 120.0):
    """Checks the task can be pickled; processes start at the first `grade`.

    Args:
      task: the task whose `reward` is called.
      timeout_s: time limit of one call (seconds, > 0).
      num_workers: worker processes (>= 1), i.e. calls run at once.
      start_method: "forkserver" (default), "spawn" or "fork" (unsafe once JAX threads run).
      startup_timeout_s: limit for the workers to start (imports + unpickling the task).

    Raises:
      ValueError: on a bad argument, or a task that cannot be pickled (naming why).
    """
    if not timeout_s > 0 or not startup_timeout_s > 0:
      raise ValueError(f"timeout_s={timeout_s} and startup_timeout_s={startup_timeout_s} must "
                       "be > 0.")
    if num_workers < 1:
      raise ValueError(f"num_workers={num_workers} must be >= 1.")
    if start_method not in START_METHODS:
      raise ValueError(f"start_method={start_method!r}; choose one of {START_METHODS}.")
    try:
      self._task_bytes = pickle.dumps(task)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"task {getattr(task, 'name', task)!r} cannot be pickled for the verifier "
                       f"processes ({e!r}); define it in an importable module.") from e
    self.task_name = getattr(task, "name", type(task).__name__)
    self.timeout_s, self.num_workers = float(timeout_s), int(num_workers)
    self.startup_timeout_s = float(startup_timeout_s)
    self._ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":  # workers fork with the task modules already imported
      self._ctx.set_forkserver_preload(["rlax_pipe.tasks"])
    self._pool = None
    self._lock = threading.Lock()
    self.stats = safe_reward.RewardStats()
    self.restarts = 0  # pools killed because a call hung

  # ---- processes --------------------------------------------------------------------------------
  def _ensure_pool(self):
    if self._pool is None:
      ready = self._ctx.Semaphore(0)
      pool = self._ctx.Pool(self.num_workers, initializer=_init_worker,
                            initargs=(self._task_bytes, ready))
      deadline = time.monotonic() + self.startup_timeout_s
      for _ in range(self.num_workers):
        if not ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
          pool.terminate()
          pool.join()
          raise RuntimeError(f"verifier processes of task {self.task_name!r} did not start "
                             f"within {self.startup_timeout_s:.0f} s.")
      self._pool = pool
    return self._pool

  def _kill(self) -> None:
    pool, self._pool = self._pool, None
    if pool is not None:
      pool.terminate()
      pool.join()

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
    out: list[safe_reward.Verdict] = []
    with self._lock:
      for start in range(0, len(items), self.num_workers):
        out.extend(self._wave(items[start:start + self.num_workers]))
    for sid, v in zip(sample_ids, out):
      self.stats.record(v.outcome)
      if v.failed:
        self._log_failure(sid, v)
    return out

  def _wave(self, wave) -> list[safe_reward.Verdict]:
    pool = self._ensure_pool()
    deadline = time.monotonic() + self.timeout_s
    handles = [pool.apply_async(_worker_call, item) for item in wave]
    verdicts, hung = [], False
    for h in handles:
      try:
        verdicts.append(safe_reward.Verdict(*h.get(max(0.0, deadline - time.monotonic()))))
      except multiprocessing.TimeoutError:
        hung = True
        verdicts.append(safe_reward.Verdict(math.nan, "timeout",
                                            f"no result within {self.timeout_s:.3g} s"))
      except Exception as e:  # pylint: disable=broad-except  (e.g. an unpicklable problem)
        verdicts.append(safe_reward.Verdict(math.nan, "error", repr(e)[:500]))
    if hung:
      self.restarts += 1
      self._kill()
    return verdicts

  def _log_failure(self, sample_id: int, v: safe_reward.Verdict) -> None:
    failed = self.stats.snapshot().failed
    if failed <= _LOG_FIRST or failed % _LOG_EVERY == 0:
      logging.warning("Reward of task %s for sample %d failed (%s: %s); no reward, excluded from "
                      "its group's baseline and the loss (%d failures so far).", self.task_name,
                      sample_id, v.outcome, v.detail, failed)
