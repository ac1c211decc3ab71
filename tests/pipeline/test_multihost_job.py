"""The real main job as a multi-process `jax.distributed` job on this machine (issue #12): four CPU
processes (two learner processes forming one learner mesh, two sampler replicas; two virtual
devices each) with in-flight weight updates; a killed replica ends the job with a message naming
it and `--config.resume` with one replica finishes the run; SLURM's environment is detected."""

import collections
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rlax_pipe.tokenizer import default_tokenizer
from rlax_pipe import costs as costs_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("local_multiprocess",
                                               ROOT / "launch" / "local_multiprocess.py")
launcher = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launcher)

MAX_LAG = 1
TIMEOUT_S = 420.0
# The tiny preset fixes a 1 + 1 device split for one process; two learner processes of two
# devices each form a 4-device learner mesh, each replica a 2-device one.
FOUR_PROCESS_MESHES = ("--config.learner.mesh_axes=(('fsdp', 2), ('tp', 2))",
                       "--config.sampler_mesh_axes=(('tp', 2),)")


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
  """One persistent compilation cache for every process of these tests: processes of the same
  role compile the same programs, and a resumed job reuses the first one's."""
  return str(tmp_path_factory.mktemp("jax_cache"))


def _env(cache: str) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
  env["JAX_COMPILATION_CACHE_DIR"] = cache
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  return env


def _args(run_dir, init, steps, policy="learner-wait", extra=()):
  return ["--config=experiments/configs/pipeline_rl.py:tiny", f"--config.init={init}",
          f"--config.run_dir={run_dir}", "--config.pipeline.mode=threaded",
          f"--config.pipeline.num_steps={steps}", "--config.pipeline.eval_problems=2",
          f"--config.pipeline.staleness.policy={policy}",
          f"--config.pipeline.staleness.max_lag={MAX_LAG}",
          "--config.pipeline.wait_timeout_s=180", "--config.sampler.kv_policy=recompute",
          "--config.distributed.record_samples=True", "--config.distributed.exit_grace_s=5",
          "--config.distributed.fault_timeout_s=60", *extra]


def _rows(run_dir, kind):
  rows = [json.loads(l) for l in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
  return [r for r in rows if r["kind"] == kind]


def _tail(log_dir, n=30):
  out = []
  for p in sorted(pathlib.Path(log_dir).glob("process_*.log")):
    lines = [l for l in p.read_text().splitlines() if not l.startswith(("I1", "W1"))]
    out.append(f"--- {p.name}\n" + "\n".join(lines[-n:]))
  return "\n".join(out)


def _check_weights_and_samples(run_dir, num_replicas, group_size=2):
  """The checks of issue #12 on a finished run's records."""
  pushes = {r["version"]: r["checksum"] for r in _rows(run_dir, "push")}
  installs = collections.defaultdict(set)
  for r in _rows(run_dir, "weights"):
    installs[r["replica"]].add(r["version"])
  checks = {(r["replica"], r["version"]): r["checksum"] for r in _rows(run_dir, "weights_check")}
  assert sorted(installs) == list(range(num_replicas))
  for replica, versions in installs.items():
    for v in versions:  # every installed version: the replica's checksums == the learner's
      assert checks[(replica, v)] == pushes[v], (replica, v)
  for r in _rows(run_dir, "replica"):
    assert r["weight_checks"] == len(installs[r["replica"]])

  train = _rows(run_dir, "train")
  samples = [json.loads(l) for l in
             (pathlib.Path(run_dir) / "rollouts.jsonl").read_text().splitlines()]
  ids = [s["sample_id"] for s in samples]
  assert len(ids) == len(set(ids)), "a sample was trained twice"
  by_group = collections.Counter(s["group_id"] for s in samples)
  assert set(by_group.values()) == {group_size}, "a trained group lost a sample"
  mixed = 0
  hist = collections.defaultdict(lambda: np.zeros(MAX_LAG + 2, np.int64))
  equal_weight = set()  # steps with a sample generated entirely by the weights trained
  for s in samples:
    versions = [v for v, _ in s["version_runs"]]
    assert all(v in installs[s["replica"]] for v in versions), s  # tags = installed versions
    assert s["trained_at"] - min(versions) <= MAX_LAG, s
    mixed += len(versions) > 1
    if versions == [s["trained_at"]]:
      equal_weight.add(s["step"])
    for v, n in s["version_runs"]:
      hist[s["step"]][s["trained_at"] - v] += n
  for row in train:  # the learner's per-token lags are exactly those of the tags
    want = hist[row["step"]]
    got = np.zeros_like(want)
    got[:len(row["lag_hist"])] = row["lag_hist"][:len(want)]
    np.testing.assert_array_equal(got, want)
    assert row["token_lag_max"] <= MAX_LAG
    # Samples of lag 0 only were decoded with exactly the weights being trained (fp32,
    # recomputed KV); a step without any has no mismatch to report (absent, not 0).
    assert ("logp_mismatch_max" in row) == (row["step"] in equal_weight), row
    assert row.get("logp_mismatch_max", 0.0) < 1e-3, row
  assert any("logp_mismatch_max" in row for row in train)
  return train, samples, mixed


# The staleness policies the 4-process test runs: learner-wait by default (block is the killed-
# replica test's, queue-drop the SLURM test's); RLAX_PIPE_MP_POLICIES=learner-wait,drop,queue-drop,
# block runs them all (about 45 s each on 2 cores).
POLICIES = os.environ.get("RLAX_PIPE_MP_POLICIES", "learner-wait").split(",")


@pytest.mark.parametrize("policy", POLICIES)
def test_four_processes_train_with_in_flight_updates(tmp_path, tiny_init, jax_cache, policy):
  run_dir = tmp_path / "run"
  t0 = time.monotonic()
  extra = [*FOUR_PROCESS_MESHES] + (
      ["--config.pipeline.staleness.queue_capacity_groups=2"] if policy == "queue-drop" else [])
  procs = launcher.launch(4, 2, _args(run_dir, tiny_init, 6, policy=policy, extra=extra),
                          log_dir=tmp_path / "logs", env=_env(jax_cache))
  codes = launcher.wait(procs, TIMEOUT_S, kill_after_s=30)
  assert codes == [0, 0, 0, 0], _tail(tmp_path / "logs")
  print(f"4-process job: {time.monotonic() - t0:.1f} s wall")
  train, samples, mixed = _check_weights_and_samples(run_dir, num_replicas=2)
  assert [r["step"] for r in train] == list(range(1, 7))
  assert {s["replica"] for s in samples} == {0, 1}  # both replicas fed the learner
  assert mixed > 0 or any(r["token_lag_max"] > 0 for r in train), "no in-flight update was used"
  summary = json.loads((run_dir / "summary.json").read_text())
  q = summary["queue"]  # every admitted group is trained, dropped or ready; none is missing
  assert q["partial_groups"] == q["in_flight_groups"] == 0
  assert q["admitted_groups"] == q["trained_groups"] + q["ready_groups"] + (
      q["waste"]["aborted_groups"] + q["waste"]["stale_groups"]
      + q["waste"]["overflow_groups"] + q["waste"]["unscored_groups"])
  assert q["trained_groups"] == len({s["group_id"] for s in samples})
  topo = json.loads((run_dir / "topology.json").read_text())
  assert [p["role"] for p in topo["processes"]] == ["learner", "learner", "sampler", "sampler"]
  assert topo["learner_mesh"] == {"fsdp": 2, "tp": 2}
  # Every process's records reach the run directory: one timeline with a lane per process
  # (drawn in gantt.png), the follower's and each replica's rows in metrics.jsonl.
  spans = [json.loads(l) for l in (run_dir / "timeline.jsonl").read_text().splitlines()]
  lanes = collections.Counter(s["component"] for s in spans if s["kind"] == "train_step")
  assert lanes["learner"] == lanes["learner/p1"] == 6
  assert {"sampler/0", "sampler/1"} <= {s["component"] for s in spans}
  assert (run_dir / "gantt.png").stat().st_size > 0
  [follower] = _rows(run_dir, "learner_process")
  assert follower["process"] == 1 and follower["steps"] == 6 and follower["version"] == 6
  assert sorted(r["replica"] for r in _rows(run_dir, "replica")) == [0, 1]
  # Both roles' timed operations (issue 26 item 3): the lead's train steps and pushes, the
  # replicas' engine steps, and the cost model fitted to them.
  records = costs_lib.read_records(run_dir / "cost_records.jsonl")
  ops = collections.Counter(r.op for r in records)
  assert ops["train_step"] == ops["push"] == ops["learner_host"] == 6
  engine = [r for r in records if r.op == "engine_step"]
  assert engine and sum(r.features.get("slot_steps", 0) for r in engine) > 0
  assert "engine_step" in json.loads((run_dir / "cost_fit.json").read_text())["ops"]


def _wait_for_step(run_dir, step, procs, timeout_s):
  deadline = time.monotonic() + timeout_s
  metrics = pathlib.Path(run_dir) / "metrics.jsonl"
  while time.monotonic() < deadline:
    if metrics.exists() and any(f'"step": {step},' in l and '"kind": "train"' in l
                                for l in metrics.read_text().splitlines()):
      return
    assert all(p.poll() is None for p in procs), "a process ended before the kill"
    time.sleep(0.1)
  raise TimeoutError(f"no train step {step} within {timeout_s} s")


def test_a_killed_replica_ends_the_job_and_resume_with_one_replica_finishes(
    tmp_path, tiny_init, jax_cache):
  run_dir = tmp_path / "run"
  args = _args(run_dir, tiny_init, 6, policy="block", extra=FOUR_PROCESS_MESHES)
  procs = launcher.launch(4, 2, args, log_dir=tmp_path / "logs", env=_env(jax_cache))
  _wait_for_step(run_dir, 2, procs, TIMEOUT_S)
  procs[3].send_signal(signal.SIGKILL)
  t_kill = time.monotonic()
  codes = launcher.wait(procs, 60.0, kill_after_s=30)
  ended_s = time.monotonic() - t_kill
  assert codes[3] == -signal.SIGKILL and all(c not in (0, -signal.SIGKILL) for c in codes[:3]), (
      codes, _tail(tmp_path / "logs"))
  assert ended_s < 30, f"the job took {ended_s:.0f} s to end after the kill"
  for i in range(3):
    log = (tmp_path / "logs" / f"process_{i}.log").read_text()
    assert "sampler replica 1 (process 3) died" in log, _tail(tmp_path / "logs")
  faults = (run_dir / "faults.jsonl").read_text()
  assert "sampler replica 1 (process 3) died" in faults

  procs = launcher.launch(3, 2, [*args, "--config.resume"], log_dir=tmp_path / "logs2",
                          env=_env(jax_cache))
  codes = launcher.wait(procs, TIMEOUT_S, kill_after_s=30)
  assert codes == [0, 0, 0], _tail(tmp_path / "logs2")
  train = _rows(run_dir, "train")
  assert [r["step"] for r in train] == list(range(1, 7))
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["steps"] == 6 and summary["topology"]["num_replicas"] == 1
  assert all(r["token_lag_max"] <= MAX_LAG for r in train)


FAKE_SRUN = """#!/usr/bin/env bash
# Stand-in for srun on one node: SLURM_NTASKS local tasks with the variables srun gives each.
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_NODELIST=localhost SLURM_STEP_NUM_NODES=1 \\
    SLURM_STEP_NUM_TASKS=$SLURM_NTASKS "$@" > "$FAKE_SRUN_LOGS/process_$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def test_slurm_batch_script_starts_the_job_through_jax_detection(tmp_path, jax_cache):
  """launch/slurm.sbatch as sbatch runs it for 2 tasks on one node (srun replaced by a stand-in
  that sets the per-task variables srun sets): JAX's SLURM detection finds coordinator, process
  count and ids; the script passes no --coordinator_address, --num_processes or --process_id.

  The same job runs multi-turn episodes on its replica (one case, no extra processes): the
  calculator task from the shipped SFT warm start (init "builtin") with "=" as a stop id, so the
  warm start's own trace "9+4=" ends a turn, the replica's tool pool answers "13\n" and the
  episode goes on (`envs.EpisodeEngine` in `multihost.replica`)."""
  run_dir = tmp_path / "run"
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "srun").write_text(FAKE_SRUN)
  (bin_dir / "srun").chmod(0o755)
  env = _env(jax_cache)
  env.update(SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_JOB_NUM_NODES="1",
             SLURM_SUBMIT_DIR=str(ROOT), JAX_COORDINATOR_PORT=str(launcher.free_port()),
             XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
             GPUS_PER_NODE="0", DEVICES_PER_TASK="2", NUM_LEARNER_PROCESSES="1",
             PYTHON=sys.executable, FAKE_SRUN_LOGS=str(tmp_path),
             PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
  tok = default_tokenizer()
  stops = (tok.eos_id, *tok.encode("="))  # a turn also ends at "=": the calculator's call
  args = _args(run_dir, "builtin", 2, policy="queue-drop",
               extra=["--config.pipeline.staleness.queue_capacity_groups=2",
                      "--config.task=arithmetic_calculator", f"--config.sampler.eos_id={stops}"])
  proc = subprocess.Popen(["bash", str(ROOT / "launch" / "slurm.sbatch"), *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
  assert proc.returncode == 0, out + _tail(tmp_path)
  assert "1 sampler replicas" in out
  log0 = (tmp_path / "process_0.log").read_text()
  assert "localhost:" in log0 and "of 2 processes" in log0  # found through SLURM's variables
  topo = json.loads((run_dir / "topology.json").read_text())
  assert [p["role"] for p in topo["processes"]] == ["learner", "sampler"]
  assert topo["learner_mesh"] == {"fsdp": 2}  # the script's default: fsdp over K x devices
  assert [r["step"] for r in _rows(run_dir, "train")] == [1, 2]
  [replica] = _rows(run_dir, "replica")  # episodes ran on the replica, tools in its workers
  assert replica["env_episodes"] > 0 and replica["env_turns"] > replica["env_episodes"], replica
  assert replica["tool_ok"] > 0 and replica["tool_restarts"] == 0, replica
  assert replica["continued_tokens"] > 0, replica  # results appended onto the kept pages
  spans = [json.loads(l) for l in (run_dir / "timeline.jsonl").read_text().splitlines()]
  assert any(s["component"] == "env/0" and s["kind"] == "tool" for s in spans)
