"""A learner process other than the lead: its share of every learner-mesh computation.

The learner mesh spans all learner processes, so each of them runs the same jitted programs in
the same order (multi-controller JAX): the state init or restore, every train step on the batch
the lead sends it, every weight push (the re-layout into the staging copies), every checkpoint.
This process holds no queue and no run directory; it sends its spans to the lead and its staging
copy to the replicas it serves (`weights.LearnerSender`).
"""

from __future__ import annotations

import time

from absl import logging

from rlax_pipe.cluster import FaultMonitor, Link, Topology
from rlax_pipe.learner import Learner
from rlax_pipe.pipeline.config import RunConfig
from rlax_pipe.pipeline.multihost.layout import TransferLayout
from rlax_pipe.pipeline.multihost.weights import LearnerSender
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.pipeline.trainer import Trainer
from rlax_pipe.types import WeightUpdate
from rlax_pipe.pipeline.multihost import messages


class FollowerProcess:
  """Learner process p > 0: trains on the lead's batches in lockstep with the other learner
  processes.

  Args:
    cfg: the run.
    topology: the job.
    monitor: fault monitor.
    link: this process's link to the lead (opened before any collective).
    learner: this process's `Learner` (on the shared learner mesh, already restored).
    layout: the shared transfer layout.
  """

  def __init__(self, cfg: RunConfig, topology: Topology, monitor: FaultMonitor, link: Link,
               learner: Learner, layout: TransferLayout):
    self.cfg, self.topology, self.monitor, self.learner = cfg, topology, monitor, learner
    self.link = link
    self.sender = LearnerSender(layout, monitor, cfg.distributed)
    pcfg = cfg.pipeline
    self.trainer = Trainer(learner, RolloutQueue(pcfg.staleness, pcfg.group_size), self.sender,
                           pcfg)
    self.lane = f"learner/p{topology.process_id}"

  def run(self) -> None:
    """Pushes the initial version, then one step per "train" message until "end"."""
    pcfg, off = self.cfg.pipeline, self.link.offset_s
    self.sender.push(WeightUpdate(self.learner.version, self.learner.params))
    steps, train_s = 0, 0.0
    while True:
      msg = messages.wait_for(lambda: messages.receive(self.link.inbox, messages.TO_LEARNER, 0.2),
                              pcfg.wait_timeout_s + self.cfg.distributed.fault_timeout_s,
                              self.monitor, period_s=0.0)
      if msg is None:
        raise TimeoutError(f"{self.topology.name()}: no batch from the learner lead for "
                           f"{pcfg.wait_timeout_s:.0f} s.")
      if isinstance(msg, messages.End):  # last messages first: the lead waits for them
        self.link.send(*messages.wire(messages.Rows(({
            "kind": "learner_process", "process": self.topology.process_id, "steps": steps,
            "train_s": train_s, "version": self.learner.version},))))
        self.link.send(*messages.wire(messages.Done()))
        break
      t0 = time.perf_counter()
      with self.monitor.deadline("a learner step", pcfg.wait_timeout_s):
        self.trainer.train_on(list(msg.groups))
      t1 = time.perf_counter()
      steps, train_s = steps + 1, train_s + (t1 - t0)
      self.link.send(*messages.wire(messages.Spans(
          ((self.lane, "train_step", t0 + off, t1 + off, None, None),))))
      if self.learner.step % pcfg.checkpoint_every == 0:
        self.learner.save({})
    self.learner.save({})  # the lead's final checkpoint (Checkpoint.on_end), in lockstep
    self.learner.close()
    self.sender.close(self.cfg.distributed.transfer_timeout_s)
    self.link.close()
    logging.info("%s: done at learner step %d.", self.topology.name(), self.learner.step)
