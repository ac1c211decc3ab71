"""Roles of the processes of one `jax.distributed` job, and how the job is joined.

Roles (DESIGN.md, "Multi-host"): the first K = `num_learner_processes` processes (by
`jax.process_index()`) form the learner mesh over all their devices; every other process runs
one independent sampler replica on its local devices (replica r = process K + r). Process 0 is
the learner's lead: it hosts the coordination service (started by `jax.distributed`), the rollout
queue and the run directory.

`initialize` joins the job in the order jax 0.10 needs (reference/multihost-notes.md):
`jax.distributed.initialize` (explicit arguments, or the scheduler's environment: SLURM, Cloud
TPU VMs, GKE, Open MPI), then the socket address of the cross-host transfer server (the CPU
backend moves device arrays between processes through it; accelerator backends that move them
natively ignore it), then the backend at once (`jax.devices()`), which is a rendezvous of all
processes.
"""

from __future__ import annotations

import collections
import dataclasses
import socket
from typing import Any, Sequence

from absl import logging
import jax

ROLES = ("learner", "sampler")


@dataclasses.dataclass(frozen=True)
class Topology:
  """Who is who in a multi-process job.

  Attributes:
    process_id: this process (`jax.process_index()`).
    num_processes: processes in the job (`jax.process_count()`).
    num_learner_processes: K; processes 0..K-1 are the learner, K.. the sampler replicas.
    devices_per_process: local devices of every process (all processes have the same count).
    platform: the devices' platform ("cpu", "gpu", "tpu").
  """

  process_id: int
  num_processes: int
  num_learner_processes: int
  devices_per_process: int
  platform: str = "cpu"

  def __post_init__(self):
    k, n = self.num_learner_processes, self.num_processes
    if not 1 <= k < n:
      raise ValueError(
          f"num_learner_processes={k} with {n} processes: need 1 <= K < {n} so that at least one "
          "process is left for a sampler replica (set --num_learner_processes, or start more "
          "processes).")
    if not 0 <= self.process_id < n:
      raise ValueError(f"process_id={self.process_id} is not in [0, {n}).")

  @property
  def role(self) -> str:
    """"learner" or "sampler"."""
    return role_of(self.process_id, self.num_learner_processes)

  @property
  def is_lead(self) -> bool:
    """Process 0: the learner's lead (queue, run directory, coordination service)."""
    return self.process_id == 0

  @property
  def num_replicas(self) -> int:
    """Sampler replicas in the job."""
    return self.num_processes - self.num_learner_processes

  @property
  def replica(self) -> int | None:
    """This process's replica index, or None on a learner process."""
    return replica_of(self.process_id, self.num_learner_processes)

  def replica_process(self, replica: int) -> int:
    """Process id of sampler replica `replica`."""
    return self.num_learner_processes + replica

  @property
  def learner_processes(self) -> tuple[int, ...]:
    return tuple(range(self.num_learner_processes))

  @property
  def replica_processes(self) -> tuple[int, ...]:
    return tuple(range(self.num_learner_processes, self.num_processes))

  def name(self, process_id: int | None = None) -> str:
    """Human name of a process and its role, e.g. "sampler replica 1 (process 3)"."""
    p = self.process_id if process_id is None else process_id
    if p == 0:
      return "learner lead (process 0)"
    if p < self.num_learner_processes:
      return f"learner process {p}"
    return f"sampler replica {p - self.num_learner_processes} (process {p})"

  def process_devices(self, process_id: int, devices: Sequence[Any] | None = None
                      ) -> tuple[Any, ...]:
    """The devices of one process, by device id."""
    devices = jax.devices() if devices is None else devices
    return tuple(sorted((d for d in devices if d.process_index == process_id),
                        key=lambda d: d.id))

  def learner_devices(self, devices: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """Devices of the learner processes, process-major, by id within a process."""
    return tuple(d for p in self.learner_processes for d in self.process_devices(p, devices))

  def describe(self, devices: Sequence[Any] | None = None) -> dict:
    """JSON-able record: every process with its role and device ids."""
    return {
        "num_processes": self.num_processes,
        "num_learner_processes": self.num_learner_processes,
        "num_replicas": self.num_replicas,
        "devices_per_process": self.devices_per_process,
        "platform": self.platform,
        "processes": [{"process": p, "role": role_of(p, self.num_learner_processes),
                       "name": self.name(p),
                       "devices": [d.id for d in self.process_devices(p, devices)]}
                      for p in range(self.num_processes)],
    }


def role_of(process_id: int, num_learner_processes: int) -> str:
  """Role of a process id: "learner" for the first K, else "sampler"."""
  return "learner" if process_id < num_learner_processes else "sampler"


def replica_of(process_id: int, num_learner_processes: int) -> int | None:
  """Replica index of a sampler process (None for a learner process)."""
  return None if process_id < num_learner_processes else process_id - num_learner_processes


def current(num_learner_processes: int) -> Topology:
  """The topology of the running job (after `jax.distributed.initialize`).

  Raises:
    ValueError: if the job is a single process, K is out of range, or processes have different
      numbers of devices (the message lists them).
  """
  n = jax.process_count()
  if n < 2:
    raise ValueError(
        f"num_learner_processes={num_learner_processes} needs a multi-process jax.distributed "
        "job, but this is a single process: start the processes with a launcher (launch/"
        "local_multiprocess.py, launch/slurm.sbatch, launch/tpu_vm.sh, launch/gke_jobset.yaml) "
        "or leave num_learner_processes=0.")
  devices = jax.devices()
  counts = collections.Counter(d.process_index for d in devices)
  if len(set(counts.values())) != 1:
    raise ValueError(
        "every process needs the same number of devices (the learner sends each replica its "
        f"weights from one learner process's devices); found {dict(sorted(counts.items()))} "
        "devices per process. Pass the same local device count to every process (CPU: "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N; SLURM: one task per node with "
        "--local_device_ids, or one task per GPU).")
  return Topology(jax.process_index(), n, num_learner_processes, counts[jax.process_index()],
                  devices[0].platform)


def _free_port(host: str) -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def local_address_towards(address: str) -> str:
  """The local IP this host uses to reach `address` ("host:port"); no packet is sent."""
  host = address.rsplit(":", 1)[0].strip("[]")
  if host in ("localhost", "127.0.0.1", "::1"):
    return "127.0.0.1"
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      s.connect((host, 9))
      return s.getsockname()[0]
  except OSError:
    return socket.gethostbyname(socket.gethostname())


def initialize(num_learner_processes: int, *, coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               local_device_ids: Sequence[int] | None = None, transfer_host: str | None = None,
               initialization_timeout_s: int = 300, heartbeat_timeout_s: int = 100,
               shutdown_timeout_s: int = 300) -> Topology:
  """Joins the `jax.distributed` job and returns this process's `Topology`.

  Call it first thing in every process, before any other JAX call (the CPU device count must be
  set before, e.g. with `XLA_FLAGS=--xla_force_host_platform_device_count=N`).

  Args:
    num_learner_processes: K (>= 1).
    coordinator_address: "host:port" of process 0's coordination service; None = detected
      from the scheduler (SLURM, Cloud TPU VM, GKE, Open MPI) or JAX_COORDINATOR_ADDRESS.
    num_processes: processes in the job; None = detected.
    process_id: this process's id; None = detected.
    local_device_ids: accelerator ids this process uses (SLURM with one task per node needs
      them: JAX's SLURM detection otherwise keeps one GPU per task); None = JAX's default.
    transfer_host: address other processes reach this host's cross-host transfer server at;
      None = the local address of the interface that reaches the coordinator.
    initialization_timeout_s, heartbeat_timeout_s, shutdown_timeout_s: passed to
      `jax.distributed.initialize` (seconds).

  Returns:
    The job's topology (also logged).

  Raises:
    ValueError: see `current`; or JAX's error when the job cannot be joined in time.
  """
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes,
      process_id=process_id, local_device_ids=local_device_ids,
      initialization_timeout=initialization_timeout_s,
      heartbeat_timeout_seconds=heartbeat_timeout_s,
      shutdown_timeout_seconds=shutdown_timeout_s)
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  host = transfer_host or local_address_towards(distributed.global_state.coordinator_address)
  transfer_address = f"{host}:{_free_port(host)}"
  jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
  jax.devices()  # the backend start is a rendezvous of every process: do it at once
  topo = current(num_learner_processes)
  logging.info("jax.distributed: %s of %d processes (%d %s devices each); coordinator %s; "
               "cross-host transfers via %s.", topo.name(), topo.num_processes,
               topo.devices_per_process, topo.platform,
               distributed.global_state.coordinator_address, transfer_address)
  return topo
