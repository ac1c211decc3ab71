"""The RL job across processes: one `jax.distributed` job, learner and sampler replicas apart.

`run(cfg)` runs this process's role (DESIGN.md, "Multi-host"): the first
`cfg.distributed.num_learner_processes` processes form the learner mesh (process 0 also holds the
rollout queue, the task iterator and the run directory), every other process runs a sampler
replica on its own devices. Weights move device to device by request / announce / acknowledge
(`weights`), rollouts stream to the lead over process links (`rlax_pipe.cluster`), and a
process that fails ends the job with a message naming it.
"""

from rlax_pipe.pipeline.multihost.job import check_supported, run
from rlax_pipe.pipeline.multihost.layout import LayoutMismatchError, TransferLayout

__all__ = ["LayoutMismatchError", "TransferLayout", "check_supported", "run"]
