"""The launchers of launch/ that cannot run here (Cloud TPU VM script, GKE JobSet) start the main
job with flags it accepts and meshes that cover each process's devices; the SLURM script runs for
real in tests/pipeline/test_multihost_job.py. The multi-process flags are in `--helpfull`."""

import os
import pathlib
import shlex
import subprocess

from absl import flags
import pytest
import yaml

from lib import cluster_cli
from lib import config_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


def parse_entry_args(argv: list[str]):
  """The RunConfig and multi-process flags experiments/pipeline_rl.py builds from `argv`."""
  fv = flags.FlagValues()
  holder = config_cli.define_rl_flags(fv, ["pipeline_rl.py", *argv])
  holders = cluster_cli.define_flags(fv)
  fv(["pipeline_rl.py", *argv])
  cfg = cluster_cli.with_flags(config_cli.run_config(holder.value), holders)
  return cfg, {name: h.value for name, h in holders.items()}, fv


def _check_tpu_job(argv: list[str], num_learner_processes: int, chips_per_host: int):
  cfg, cluster_flags, _ = parse_entry_args(argv)
  assert cfg.distributed.num_learner_processes == num_learner_processes
  assert cfg.pipeline.mode == "threaded"
  assert cfg.num_learner_devices == num_learner_processes * chips_per_host
  assert cfg.num_sampler_devices == chips_per_host
  # The scheduler's environment gives these (JAX's TPU detection), never a flag.
  assert cluster_flags["coordinator_address"] is None and cluster_flags["process_id"] is None
  return cfg


def test_helpfull_documents_the_multiprocess_flags():
  _, _, fv = parse_entry_args([])
  text = fv.get_help()
  for name in ("num_learner_processes", "coordinator_address", "num_processes", "process_id",
               "local_device_ids", "transfer_host", "initialization_timeout_s",
               "config.distributed.num_learner_processes", "config.distributed.fault_timeout_s"):
    assert f"--{name}" in text or name in text, name


def test_num_learner_processes_flag_and_config_field_agree():
  cfg, _, _ = parse_entry_args(["--config.distributed.num_learner_processes=2"])
  assert cfg.distributed.num_learner_processes == 2
  cfg, _, _ = parse_entry_args(["--config.distributed.num_learner_processes=2",
                                "--num_learner_processes=3"])
  assert cfg.distributed.num_learner_processes == 3  # the flag wins


@pytest.mark.parametrize("k", [1, 2])
def test_tpu_vm_script_starts_the_job_on_every_worker(tmp_path, k):
  """tpu_vm.sh with gcloud replaced by a stand-in that records its arguments."""
  record = tmp_path / "gcloud_args"
  fake = tmp_path / "gcloud"
  fake.write_text(f"#!/usr/bin/env bash\nprintf '%s\\0' \"$@\" > {record}\n")
  fake.chmod(0o755)
  env = dict(os.environ, TPU_NAME="my-v4-32", ZONE="us-central2-b", GCLOUD=str(fake),
             NUM_LEARNER_PROCESSES=str(k), RUN_DIR="gs://bucket/runs/x")
  # A preset may come anywhere; the caller's overrides win over the script's.
  user = ["--config.pipeline.num_steps=7"] + (
      ["--config=experiments/configs/pipeline_rl.py:tiny", "--config.run_dir=gs://b/other"]
      if k == 2 else [])
  out = subprocess.run(["bash", str(ROOT / "launch" / "tpu_vm.sh"), "run", *user], env=env,
                       capture_output=True, text=True, timeout=60, check=True)
  assert f"workers 0..{k - 1} learner" in out.stdout
  args = record.read_text().split("\0")[:-1]
  assert args[:5] == ["compute", "tpus", "tpu-vm", "ssh", "my-v4-32"]
  assert "--worker=all" in args and "--zone=us-central2-b" in args
  command = next(a for a in args if a.startswith("--command=")).removeprefix("--command=")
  words = shlex.split(command.split("&&", 1)[1].split("2>&1")[0])
  assert words[:2] == ["python3", "experiments/pipeline_rl.py"]
  cfg = _check_tpu_job(words[2:], num_learner_processes=k, chips_per_host=4)
  assert cfg.pipeline.num_steps == 7
  assert cfg.run_dir == ("gs://b/other" if k == 2 else "gs://bucket/runs/x")
  assert cfg.pipeline.eval_problems == (4 if k == 2 else 128)  # the tiny preset was loaded


def test_tpu_vm_script_refuses_a_missing_slice_name(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in ("TPU_NAME", "ZONE")}
  out = subprocess.run(["bash", str(ROOT / "launch" / "tpu_vm.sh"), "run"], env=env,
                       capture_output=True, text=True, timeout=60, check=False)
  assert out.returncode != 0 and "TPU_NAME" in out.stderr


def test_gke_jobset_sizes_agree_and_the_command_parses():
  jobset = yaml.safe_load((ROOT / "launch" / "gke_jobset.yaml").read_text())
  assert jobset["kind"] == "JobSet" and jobset["apiVersion"].startswith("jobset.x-k8s.io/")
  [job] = jobset["spec"]["replicatedJobs"]
  spec = job["template"]["spec"]
  assert spec["parallelism"] == spec["completions"] and spec["completionMode"] == "Indexed"
  [container] = spec["template"]["spec"]["containers"]
  chips = int(container["resources"]["limits"]["google.com/tpu"])
  command = container["command"]
  assert command[:2] == ["python3", "experiments/pipeline_rl.py"]
  k = int(next(a for a in command if a.startswith("--num_learner_processes=")).split("=")[1])
  assert 1 <= k < spec["parallelism"]
  _check_tpu_job(command[2:], num_learner_processes=k, chips_per_host=chips)


def test_slurm_script_refuses_sizes_that_cannot_work(tmp_path):
  env = dict(os.environ, SLURM_JOB_ID="7", SLURM_NTASKS="2", SLURM_JOB_NUM_NODES="1",
             SLURM_SUBMIT_DIR=str(ROOT), GPUS_PER_NODE="0", NUM_LEARNER_PROCESSES="2")
  out = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch")], env=env,
                       capture_output=True, text=True, timeout=60, check=False)
  assert out.returncode == 2 and "NUM_LEARNER_PROCESSES=2 with 2 tasks" in out.stderr
  env.update(NUM_LEARNER_PROCESSES="1", GPUS_PER_NODE="4")  # 2 tasks, 4 GPUs: not 1 per GPU
  out = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch")], env=env,
                       capture_output=True, text=True, timeout=60, check=False)
  assert out.returncode == 2 and "--ntasks-per-node=4" in out.stderr
