"""`DistributedConfig`: the multi-process mode of an RL run (roles, liveness, time limits)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """One `jax.distributed` job with two roles, or a single process.

  With `num_learner_processes = K >= 1` the job's first K processes (by `jax.process_index()`)
  form the learner mesh over all their devices and every other process runs one sampler replica
  on its own devices (`rlax_pipe.cluster.topology`); K = 0 is the single-process mode, where one
  process splits its devices between both roles. The processes themselves are started by a
  launcher (`launch/`: local, SLURM, Cloud TPU VM, GKE) and joined by `jax.distributed`.

  Attributes:
    num_learner_processes: K, 0 (single process, the default) or 1 <= K < number of processes.
    heartbeat_s: seconds between liveness messages on every process link (> 0).
    fault_timeout_s: a process whose link stays silent this long is declared dead (seconds,
      > 2 * heartbeat_s). A process that exits is detected at once (its link closes).
    connect_timeout_s: limit for every process to join the job and open its link (seconds, > 0).
    transfer_timeout_s: limit for one weight version to reach a replica once announced, and for
      the replica's acknowledgement to reach the learner (seconds, > 0).
    exit_grace_s: after a fault, seconds a process gets to log and exit by itself before it is
      ended with `os._exit` (a thread blocked in a collective with a dead peer never returns).
    record_samples: the learner's lead process writes `rollouts.jsonl` in the run directory: one
      line per trained sample (ids, replica, per-token version runs, the version it was trained
      at), an audit of versions, lags, losses and duplicates.
  """

  num_learner_processes: int = 0
  heartbeat_s: float = 1.0
  fault_timeout_s: float = 60.0
  connect_timeout_s: float = 300.0
  transfer_timeout_s: float = 300.0
  exit_grace_s: float = 10.0
  record_samples: bool = False

  def __post_init__(self):
    if self.num_learner_processes < 0:
      raise ValueError(f"DistributedConfig.num_learner_processes={self.num_learner_processes} "
                       "must be >= 0 (0 = single process).")
    for name in ("heartbeat_s", "fault_timeout_s", "connect_timeout_s", "transfer_timeout_s",
                 "exit_grace_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"DistributedConfig.{name}={getattr(self, name)} must be > 0.")
    if self.fault_timeout_s <= 2 * self.heartbeat_s:
      raise ValueError(
          f"DistributedConfig.fault_timeout_s={self.fault_timeout_s} must exceed twice "
          f"heartbeat_s={self.heartbeat_s}, or a live process could be declared dead.")

  @property
  def multiprocess(self) -> bool:
    """Whether the run is a multi-process job."""
    return self.num_learner_processes > 0
