"""Multi-process jobs: roles, control messages, process links and faults (no JAX math).

One `jax.distributed` job with two roles (DESIGN.md, "Multi-host"): the first
`num_learner_processes` processes form the learner mesh, every other process runs a sampler
replica. This package holds what any role needs to take part: `initialize` / `Topology`
(joining the job, who is who), `KVStore` (small control messages through the coordination
service), `Hub` / `Link` (a socket between the learner's lead and every other process, with
heartbeats) and `FaultMonitor` (a dead or failed process ends the job within a bounded time).
The roles themselves are wired in `rlax_pipe.pipeline.multihost`.
"""

from rlax_pipe.cluster.config import DistributedConfig
from rlax_pipe.cluster.faults import FAULT_EXIT_CODE, FaultMonitor, ProcessFault
from rlax_pipe.cluster.kv import KVStore, KVTimeout, barrier
from rlax_pipe.cluster.links import Hub, Link
from rlax_pipe.cluster.topology import Topology, current, initialize, role_of

__all__ = [
    "DistributedConfig", "FAULT_EXIT_CODE", "FaultMonitor", "ProcessFault", "KVStore",
    "KVTimeout", "barrier", "Hub", "Link", "Topology", "current", "initialize", "role_of",
]
