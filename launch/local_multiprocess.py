#!/usr/bin/env python3
"""Starts one multi-process RL job on this machine: N processes of experiments/pipeline_rl.py
joined by `jax.distributed` (for tests, laptops and single multi-GPU hosts).

  python3 launch/local_multiprocess.py --num_processes=4 --num_learner_processes=2 \
      --devices_per_process=2 -- --config.pipeline.mode=threaded --config.run_dir=runs/mp

Processes 0..K-1 form the learner mesh, K..N-1 are sampler replicas. On a CPU-only machine each
process gets `--devices_per_process` virtual CPU devices; on a GPU host set
`--gpus_per_process` instead (process i sees GPUs i*g .. i*g+g-1). Every process writes its
log to <log_dir>/process_<i>.log; this script waits for all of them and exits with the first
non-zero status (0 if all succeeded). If a process fails, the job's own fault handling ends the
others within `exit_grace_s`; this script kills any left after `--kill_after_s`.
Everything after `--` goes to experiments/pipeline_rl.py unchanged (the same on every process).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENTRY = ROOT / "experiments" / "pipeline_rl.py"


def free_port() -> int:
  """A TCP port free on this host now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(num_processes: int, num_learner_processes: int, args: list[str], *,
           devices_per_process: int = 2, gpus_per_process: int = 0,
           log_dir: str | pathlib.Path = "runs/local_multiprocess_logs",
           entry: str | pathlib.Path = ENTRY, env: dict | None = None,
           port: int | None = None) -> list[subprocess.Popen]:
  """Starts the processes (returns at once); see the module docstring.

  Returns:
    The processes, in process-id order.
  """
  log_dir = pathlib.Path(log_dir)
  log_dir.mkdir(parents=True, exist_ok=True)
  address = f"127.0.0.1:{port or free_port()}"
  procs = []
  for i in range(num_processes):
    penv = dict(os.environ if env is None else env)
    if gpus_per_process:
      penv["CUDA_VISIBLE_DEVICES"] = ",".join(
          str(i * gpus_per_process + j) for j in range(gpus_per_process))
    else:
      flags = " ".join(f for f in penv.get("XLA_FLAGS", "").split()
                       if "xla_force_host_platform_device_count" not in f)
      penv["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count="
                           f"{devices_per_process}").strip()
      penv.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, str(entry), f"--num_learner_processes={num_learner_processes}",
           f"--coordinator_address={address}", f"--num_processes={num_processes}",
           f"--process_id={i}", *args]
    log = open(log_dir / f"process_{i}.log", "w")  # pylint: disable=consider-using-with
    procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=penv,
                                  cwd=str(ROOT)))
  return procs


def wait(procs: list[subprocess.Popen], timeout_s: float, kill_after_s: float = 60.0
         ) -> list[int]:
  """Waits for every process; once one fails (or at `timeout_s`), the rest get `kill_after_s`
  more before they are killed. Returns the exit codes (-9: killed here)."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and any(p.poll() is None for p in procs):
    if any(p.poll() not in (None, 0) for p in procs):
      deadline = min(deadline, time.monotonic() + kill_after_s)
    time.sleep(0.1)
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
  return [p.returncode for p in procs]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--num_processes", type=int, required=True,
                      help="processes of the job (learner processes + sampler replicas)")
  parser.add_argument("--num_learner_processes", type=int, required=True,
                      help="the first K processes form the learner mesh; the others are replicas")
  parser.add_argument("--devices_per_process", type=int, default=2,
                      help="virtual CPU devices per process (CPU-only machines); the meshes must "
                      "fit: the tiny preset's 1-device meshes need 1")
  parser.add_argument("--gpus_per_process", type=int, default=0,
                      help="GPUs per process on a GPU host (0 = CPU)")
  parser.add_argument("--log_dir", default="runs/local_multiprocess_logs",
                      help="process_<i>.log of every process")
  parser.add_argument("--timeout_s", type=float, default=24 * 3600.0,
                      help="wall-clock limit of the whole job (seconds)")
  parser.add_argument("--kill_after_s", type=float, default=60.0,
                      help="once a process failed, seconds the others get before they are killed")
  parser.add_argument("args", nargs="*", help="arguments of experiments/pipeline_rl.py")
  a = parser.parse_args()
  procs = launch(a.num_processes, a.num_learner_processes, a.args,
                 devices_per_process=a.devices_per_process, gpus_per_process=a.gpus_per_process,
                 log_dir=a.log_dir)
  print(f"started {len(procs)} processes; logs in {a.log_dir}/process_<i>.log", flush=True)
  codes = wait(procs, a.timeout_s, a.kill_after_s)
  for i, code in enumerate(codes):
    print(f"process {i}: exit status {code}", flush=True)
  for i, code in enumerate(codes):  # a failed process's own last lines say why
    if code not in (0, -9):
      tail = (pathlib.Path(a.log_dir) / f"process_{i}.log").read_text().splitlines()[-3:]
      print(f"process {i} failed; its last lines:\n  " + "\n  ".join(tail), flush=True)
  last = (pathlib.Path(a.log_dir) / "process_0.log").read_text().splitlines()[-1:]
  if last:  # process 0's summary (one JSON object) stays the last line
    print(last[0], flush=True)
  return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
  sys.exit(main())
