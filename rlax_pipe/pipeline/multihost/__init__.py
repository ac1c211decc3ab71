"""The RL job across processes: one `jax.distributed` job, learner and sampler replicas apart.

`run(cfg)` runs this process's role (DESIGN.md, "Multi-host"; the roles and their faults: `job`).
Weights move device to device by request / announce / acknowledge (`weights`); rollouts stream to
the lead over process links (`rlax_pipe.cluster`).
"""

from rlax_pipe.pipeline.multihost.job import check_supported, run
from rlax_pipe.pipeline.multihost.layout import LayoutMismatchError, TransferLayout

__all__ = ["LayoutMismatchError", "TransferLayout", "check_supported", "run"]
