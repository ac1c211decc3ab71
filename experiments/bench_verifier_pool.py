"""Measures what a hung verifier costs the host, and what verifier processes cost per call.

  PYTHONPATH=. python experiments/bench_verifier_pool.py

Prints one JSON object (wall-clock seconds, measured with time.perf_counter on this machine):
- `workload_s`: a fixed pure-Python workload (median of 5) before any hang, after three hangs of
  a verifier run in abandoned daemon threads (the former `safe_reward`), and after three hangs
  in a `VerifierPool` (processes killed at the timeout);
- `pool_start_s`: first `grade` of a fresh pool (a worker process `python -m
  rlax_pipe.tasks.verifier_worker` started, the task loaded, one call);
- `call_s`: mean time per call of 200 calls on a warm one-worker pool;
- `hang_grade_s`: a `grade` whose call hangs (timeout + kill, the replacement process started
  without waiting); `restart_s`: the next `grade` at once (waits for the replacement + one call);
- the live thread count after each kind of hang.
"""

import json
import statistics
import threading
import time

from lib.verifier_tasks import SpinTask
from rlax_pipe import tasks

PROBLEM = tasks.Problem(index=0, split="train", prompt="Q: 1+1\n", answer="2", solution="A: 2")
TIMEOUT_S = 0.2


def _workload() -> float:
  t0 = time.perf_counter()
  total = 0
  for i in range(2_000_000):
    total += i % 7
  return time.perf_counter() - t0


def _median_workload() -> float:
  return statistics.median(_workload() for _ in range(5))


def main():
  out = {"workload_s": {"before": _median_workload()}}
  # Verifier processes first (the abandoned threads below keep spinning until the process exits).
  t0 = time.perf_counter()
  pool = tasks.VerifierPool(SpinTask(), timeout_s=TIMEOUT_S)
  pool.grade([(PROBLEM, "A: 2")])
  out["pool_start_s"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  pool.grade([(PROBLEM, "A: 2")] * 200)
  out["call_s"] = (time.perf_counter() - t0) / 200
  t0 = time.perf_counter()
  for _ in range(3):
    assert pool.grade([(PROBLEM, "hang")])[0].outcome == "timeout"
  out["hang_grade_s"] = (time.perf_counter() - t0) / 3
  t0 = time.perf_counter()
  pool.grade([(PROBLEM, "A: 2")])
  out["restart_s"] = time.perf_counter() - t0
  out["workload_s"]["after_3_pool_hangs"] = _median_workload()
  pool.close()
  out["threads_after_pool_hangs"] = threading.active_count()  # after close: the main thread
  # The former safe_reward: each hung call left in a daemon thread abandoned at the timeout.
  for k in range(3):
    thread = threading.Thread(target=SpinTask().reward, args=(PROBLEM, "hang"), daemon=True,
                              name=f"reward-{k}")
    thread.start()
    thread.join(TIMEOUT_S)
  out["workload_s"]["after_3_abandoned_threads"] = _median_workload()
  out["threads_after_abandoned_hangs"] = threading.active_count()  # main + 3 spinning
  out["timeout_s"] = TIMEOUT_S
  print(json.dumps(out))


if __name__ == "__main__":
  main()
