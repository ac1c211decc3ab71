"""Command-line flags of the multi-process mode and the call that joins the job.

`--num_learner_processes` is the config field `distributed.num_learner_processes` (either
spelling works; the flag wins); the other flags say how this process finds the others and are
per process, so they are flags, not config fields. Under SLURM, on Cloud TPU VMs and on GKE
JobSets leave them unset: `jax.distributed` reads the scheduler's environment
(launch/README.md says which flags each launcher sets).
"""

from __future__ import annotations

import dataclasses

from absl import flags

from rlax_pipe import cluster

_NUM_LEARNER_PROCESSES = flags.DEFINE_integer(
    "num_learner_processes", None,
    "Multi-process mode: the first K processes of the jax.distributed job form the learner mesh, "
    "every other process runs a sampler replica on its own devices. Same as "
    "--config.distributed.num_learner_processes (this flag wins). 0 = single process.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of process 0's coordination service (multi-process mode). Unset = detected from "
    "SLURM, a Cloud TPU VM, GKE or Open MPI, or the JAX_COORDINATOR_ADDRESS variable.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Processes in the job (multi-process mode); unset = detected.")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's id, 0..num_processes-1 (multi-process mode); unset = "
    "detected.")
_LOCAL_DEVICE_IDS = flags.DEFINE_list(
    "local_device_ids", None,
    "Accelerator ids this process uses, e.g. 0,1,2,3 (SLURM with one task per node: JAX's SLURM "
    "detection otherwise keeps one GPU per task). Unset = JAX's default.")
_TRANSFER_HOST = flags.DEFINE_string(
    "transfer_host", None,
    "Address other processes reach this host's cross-host weight transfers at; unset = the "
    "address of the interface that reaches the coordinator.")
_INIT_TIMEOUT = flags.DEFINE_integer(
    "initialization_timeout_s", 300,
    "Seconds every process may take to join the jax.distributed job (multi-process mode).")


def with_flags(cfg):
  """`cfg` with `--num_learner_processes` applied (a `RunConfig`)."""
  if _NUM_LEARNER_PROCESSES.value is None:
    return cfg
  return dataclasses.replace(cfg, distributed=dataclasses.replace(
      cfg.distributed, num_learner_processes=_NUM_LEARNER_PROCESSES.value))


def join_if_multiprocess(cfg) -> cluster.Topology | None:
  """Joins the `jax.distributed` job when `cfg` asks for the multi-process mode (call it before
  any other JAX work); returns this process's topology, or None for a single-process run."""
  if not cfg.distributed.multiprocess:
    return None
  ids = None if _LOCAL_DEVICE_IDS.value is None else [int(i) for i in _LOCAL_DEVICE_IDS.value]
  return cluster.initialize(
      cfg.distributed.num_learner_processes, coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value, local_device_ids=ids,
      transfer_host=_TRANSFER_HOST.value, initialization_timeout_s=_INIT_TIMEOUT.value)
