"""The learner's lead process (process 0): queue, worker, learner loop, run directory.

Two threads, as in the single-process threaded driver:
- the sampler side (`LeadSamplerSide`): takes the replicas' messages off the links (rollouts are
  graded by the one `RolloutWorker` and put into the one `RolloutQueue`; spans and rows are kept
  for the run directory) and tops every replica up through `RemoteEngines` (how: `remote`);
- the learner loop (`driver.drive` with a `LeadClock`, the calling thread): takes a batch from
  the queue, sends it to the other learner processes, trains in lockstep with them, pushes the
  new version (every learner process re-lays it out; replicas get it by request), and runs the
  step hooks (metrics, evaluation on this process's devices, checkpoints of the learner
  processes together).

Timed operations (the job's `CostRecorder`, if any): the learner loop's as `driver.RealClock`
records them, the replicas' from `messages.Costs`; cost_records.jsonl / cost_fit.json hold both.
"""

from __future__ import annotations

import collections
import contextlib
import json
import queue as queue_lib
import threading
import time
from typing import Any

from absl import logging
import numpy as np

from rlax_pipe import costs as costs_lib
from rlax_pipe.cluster import FaultMonitor, Hub, ProcessFault
from rlax_pipe.cluster.topology import replica_of
from rlax_pipe.pipeline import driver as driver_lib
from rlax_pipe.pipeline.job import Job
from rlax_pipe.pipeline.multihost.remote import RemoteEngines
from rlax_pipe.pipeline.multihost.weights import LearnerSender
from rlax_pipe.pipeline.trainer import StepResult
from rlax_pipe.pipeline.multihost import messages


class LeadSamplerSide:
  """The lead's sampler thread (see the module docstring), started at construction.

  Args:
    job: the lead's job (worker, queue, timeline).
    hub: links to every other process.
    proxy: the replicas as the worker's engine.
    monitor: fault monitor (an error here is a fault of the job).
  """

  def __init__(self, job: Job, hub: Hub, proxy: RemoteEngines, monitor: FaultMonitor):
    self.job, self.hub, self.proxy, self.monitor = job, hub, proxy, monitor
    self.rows: collections.deque = collections.deque()  # rows for the run directory
    self.done: set[int] = set()  # processes that sent their last message
    self._others = frozenset(range(1, proxy.topology.num_processes))  # every process but this
    self._stopping = threading.Event()
    self._exit = threading.Event()
    self._delivery_limit_s = driver_lib.delivery_limit(job.cfg.pipeline, [])
    self._thread = threading.Thread(target=self._loop, name="rlax_pipe-lead-sampler",
                                    daemon=True)
    self._thread.start()

  def _handle(self, p: int, kind: str, payload: Any) -> None:
    msg = messages.received(kind, payload, messages.TO_LEAD)
    if isinstance(msg, messages.Rollouts):
      r = replica_of(p, self.proxy.topology.num_learner_processes)
      self.proxy.returned(r, list(msg.rollouts), msg.status)  # handed out by its next step
      for version, checksum in msg.status.get("checked", ()):  # each checked version once
        self.rows.append({"kind": "weights_check", "replica": r, "version": version,
                          "checksum": checksum})
    elif isinstance(msg, messages.Spans):
      for span in msg.spans:
        self.job.timeline.record(*span)
    elif isinstance(msg, messages.Rows):
      self.rows.extend(msg.rows)
    elif isinstance(msg, messages.Costs):
      if self.job.cost_recorder is not None:
        self.job.cost_recorder.extend([costs_lib.CostRecord.from_dict(r) for r in msg.records],
                                      msg.compiles)
    else:  # messages.Done
      self.done.add(p)

  def _loop(self) -> None:
    stop_sent = False
    try:
      while not self._exit.is_set() and self.monitor.error is None:
        with contextlib.suppress(queue_lib.Empty):  # (nothing came within 5 ms)
          self._handle(*self.hub.inbox.get(timeout=0.005))
          while not self.hub.inbox.empty():  # one reader: what is there stays there
            self._handle(*self.hub.inbox.get_nowait())
        finished = self.proxy.step()
        if finished:
          self.job.worker.returned(finished)  # no longer outstanding; in transit until queued
          for graded in self.job.worker.grade_batch(finished):
            self.job.queue.put(graded)
        if not self._stopping.is_set():
          # samples lost on a replica or on their way to the queue: named, and re-dispatched
          # to the replica that had them or their group given up (issue #27 item 2)
          self.job.worker.check_lost(time.monotonic(), self._delivery_limit_s)
          for r in sorted(self.proxy.replicas):  # the worker tops each replica up in turn
            with self.proxy.target(r):
              self.job.worker.top_up()
            self.proxy.flush(r)
        elif not stop_sent:  # from this thread: no request can follow the stop
          self.hub.broadcast(*messages.wire(messages.Stop()), role="sampler")
          stop_sent = True
        elif self.done >= self._others:
          return  # every process's last messages handled, their samples stepped and queued
    except BaseException as e:  # pylint: disable=broad-except
      logging.exception("the learner lead's sampler thread failed")
      self.monitor.report(f"learner lead (process 0): its sampler thread failed: "
                          f"{type(e).__name__}: {e}")
      self.job.queue.close()

  def stop(self, timeout_s: float) -> None:
    """Stops topping up, has the thread tell the replicas to stop (the other learner processes
    were told "end"), and waits up to `timeout_s` seconds for it to handle every process's last
    messages (spans, rows, the replicas' last samples), so that the run directory gets all of
    them.

    Raises:
      ProcessFault: when the job failed meanwhile.
    """
    self._stopping.set()
    self._thread.join(timeout=timeout_s)
    self.monitor.check()
    if self._thread.is_alive():
      missing = sorted(self._others - self.done)
      learners = self.proxy.topology.num_learner_processes
      logging.warning("replicas %s and learner processes %s did not send their final messages "
                      "within %.0f s.", [p - learners for p in missing if p >= learners],
                      [p for p in missing if p < learners], timeout_s)
      self._exit.set()
      self._thread.join(timeout=timeout_s)


class MultiprocessRecords:
  """Step hook on the lead: rows from every process into metrics.jsonl (weight pushes with the
  learner's checksums, installs and checks on each replica, per-replica statistics), and with
  `DistributedConfig.record_samples` one line per trained sample in rollouts.jsonl."""

  def __init__(self, sampler_side: LeadSamplerSide, sender: LearnerSender,
               proxy: RemoteEngines, record_samples: bool):
    self._side, self._sender, self._proxy = sampler_side, sender, proxy
    self._record = record_samples

  def _drain(self, job: Job, step: int) -> None:
    while self._side.rows:
      row = self._side.rows.popleft()
      if "clock" in row:  # the lead's perf_counter -> run time
        row["time_s"] = job.clock.time_s(row.pop("clock"))
      job.run_dir.log({"step": step, **row}, step)

  def log_push(self, job: Job, version: int) -> None:
    """A "push" row: the version and the learner's checksums of it."""
    job.run_dir.log({"kind": "push", "step": job.learner.step, "version": version,
                     "checksum": self._sender.checksum(version)}, job.learner.step)

  def on_step(self, job: Job, result: StepResult, time_s: float) -> None:
    del time_s
    step = job.learner.step
    self.log_push(job, result.produced)
    self._drain(job, step)
    holders = self._proxy.forget(r.sample_id for r in result.rollouts)
    if not self._record:
      return
    with open(job.run_dir.path / "rollouts.jsonl", "a") as f:
      for r in result.rollouts:
        v = np.asarray(r.policy_versions)
        runs = [[int(x), int(n)] for x, n in zip(*np.unique(v, return_counts=True))]
        f.write(json.dumps({
            "step": step, "trained_at": result.trained_at, "sample_id": int(r.sample_id),
            "group_id": int(r.group_id), "replica": holders.get(int(r.sample_id), -1),
            "prompt_index": int(r.prompt_index), "finish_reason": r.finish_reason,
            "reward": None if np.isnan(r.reward) else float(r.reward),
            "tokens": int(v.size), "version_runs": runs}) + "\n")

  def on_end(self, job: Job, time_s: float) -> None:
    del time_s
    self._drain(job, job.learner.step)


class LeadClock(driver_lib.RealClock):
  """The lead's clock for `driver.drive` (the learner loop of the module docstring): a
  `driver.RealClock` whose steps first send their batch to the other learner processes and run
  under the job's wait limit.

  Args:
    hub: links to every other process.
    monitor: fault monitor: a fault elsewhere is raised at the next wait or step boundary.

  Raises (from `drive`):
    ProcessFault: when the job failed elsewhere (the queue is closed on a fault).
    QueueTimeout: no batch within `wait_timeout_s`.
  """

  def __init__(self, hub: Hub, monitor: FaultMonitor):
    super().__init__()
    self.hub, self.monitor = hub, monitor

  def wait_limit(self, job: Job) -> float | None:
    return job.cfg.pipeline.wait_timeout_s

  def raise_failure(self, job: Job) -> None:
    del job
    self.monitor.check()

  def step(self, job: Job, groups) -> StepResult:
    self.hub.broadcast(*messages.wire(messages.Train(tuple(groups))), role="learner")
    with self.monitor.deadline("a learner step", job.cfg.pipeline.wait_timeout_s):
      return job.trainer.train_on(groups)


def fault_on_error(monitor: FaultMonitor, whoami: str, error: BaseException) -> None:
  """Reports an exception of this process's main thread as the job's fault (the others are
  told; this process is ended if it does not exit in time)."""
  if not isinstance(error, ProcessFault):  # a fault of another process is reported already
    monitor.report(f"{whoami} failed: {type(error).__name__}: {error}")
