"""Command-line flags of the multi-process mode and the call that joins the job.

`--num_learner_processes` is the config field `distributed.num_learner_processes` (either
spelling works; the flag wins); the other flags say how this process finds the others and are
per process, so they are flags, not config fields. Under SLURM, on Cloud TPU VMs and on GKE
JobSets leave them unset: `jax.distributed` reads the scheduler's environment
(launch/README.md says which flags each launcher sets). They are listed by `--helpfull`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import flags

from rlax_pipe import cluster


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, Any]:
  """Defines the multi-process flags on `flag_values`; returns their holders by name."""
  return {
      "num_learner_processes": flags.DEFINE_integer(
          "num_learner_processes", None,
          "Multi-process mode: the first K processes of the jax.distributed job form the learner "
          "mesh, every other process runs a sampler replica on its own devices. Same as "
          "--config.distributed.num_learner_processes (this flag wins). 0 = single process.",
          flag_values=flag_values),
      "coordinator_address": flags.DEFINE_string(
          "coordinator_address", None,
          "host:port of process 0's coordination service (multi-process mode). Unset = detected "
          "from SLURM, a Cloud TPU VM, GKE or Open MPI, or the JAX_COORDINATOR_ADDRESS variable.",
          flag_values=flag_values),
      "num_processes": flags.DEFINE_integer(
          "num_processes", None, "Processes in the job (multi-process mode); unset = detected.",
          flag_values=flag_values),
      "process_id": flags.DEFINE_integer(
          "process_id", None, "This process's id, 0..num_processes-1 (multi-process mode); "
          "unset = detected.", flag_values=flag_values),
      "local_device_ids": flags.DEFINE_list(
          "local_device_ids", None,
          "Accelerator ids this process uses, e.g. 0,1,2,3 (SLURM with one task per node: JAX's "
          "SLURM detection otherwise keeps one GPU per task). Unset = JAX's default.",
          flag_values=flag_values),
      "transfer_host": flags.DEFINE_string(
          "transfer_host", None,
          "Address other processes reach this host's cross-host weight transfers at (CPU "
          "backend); unset = the address of the interface that reaches the coordinator.",
          flag_values=flag_values),
      "initialization_timeout_s": flags.DEFINE_integer(
          "initialization_timeout_s", 300,
          "Seconds every process may take to join the jax.distributed job (multi-process mode).",
          flag_values=flag_values),
  }


_FLAGS = define_flags()


def with_flags(cfg, holders: dict[str, Any] | None = None):
  """`cfg` with `--num_learner_processes` applied (a `RunConfig`); `holders` default to the
  flags defined on `flags.FLAGS` at import."""
  k = (holders or _FLAGS)["num_learner_processes"].value
  if k is None:
    return cfg
  return dataclasses.replace(cfg, distributed=dataclasses.replace(
      cfg.distributed, num_learner_processes=k))


def join_if_multiprocess(cfg) -> cluster.Topology | None:
  """Joins the `jax.distributed` job when `cfg` asks for the multi-process mode (call it before
  any other JAX work); returns this process's topology, or None for a single-process run."""
  if not cfg.distributed.multiprocess:
    return None
  ids = _FLAGS["local_device_ids"].value
  ids = None if ids is None else [int(i) for i in ids]
  return cluster.initialize(
      cfg.distributed.num_learner_processes,
      coordinator_address=_FLAGS["coordinator_address"].value,
      num_processes=_FLAGS["num_processes"].value, process_id=_FLAGS["process_id"].value,
      local_device_ids=ids, transfer_host=_FLAGS["transfer_host"].value,
      initialization_timeout_s=_FLAGS["initialization_timeout_s"].value)
