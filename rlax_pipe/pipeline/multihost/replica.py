"""A sampler replica process: its engine on its own devices, fed by the lead, weights in flight.

The replica decodes what the lead submits and streams finished rollouts back (ungraded: the lead
grades, queues and applies the staleness policy). New weights arrive while it decodes
(`weights`, steps 3-4); a complete version is handed to the engine at a dispatch boundary when
the driver's rule allows (pipeline: at once; round-based drivers: between rounds), so per-token
version tags stay exact. Spans (timed on the lead's clock), weight installs and the engine's
statistics go to the lead's run directory.

An environment task (tools: `rlax_pipe.envs`) runs as episodes here: the engine is wrapped in an
`EpisodeEngine` whose tools run in this process's own verifier worker pool, on a background
thread while the engine decodes; the lead receives finished episodes (every turn's model tokens
with their versions, environment tokens with loss mask 0) and grades their last turn as it does
in one process. Tool time is a span of lane "env/<replica>"; the episode and tool-call counts
go into the replica's final row.

Every loop iteration that ran the engine is timed as a cost record ("engine_step" with the
engine's counters, as the single-process threaded driver's sampler loop records it), sent to the
lead at the end (`messages.Costs`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from rlax_pipe import envs
from rlax_pipe import costs as costs_lib
from rlax_pipe import timeline as timeline_lib
from rlax_pipe.cluster import FaultMonitor, KVStore, Link, Topology
from rlax_pipe.pipeline import rules
from rlax_pipe.pipeline.driver import CompileCounter, engine_features
from rlax_pipe.pipeline.config import RunConfig
from rlax_pipe.pipeline.multihost.layout import TransferLayout
from rlax_pipe.pipeline.multihost.weights import ReplicaReceiver
from rlax_pipe.sampler import SamplerEngine
from rlax_pipe.pipeline.multihost import messages

_FLUSH_S = 0.5   # spans, status and rng at least this often
_IDLE_S = 0.002  # poll period while there is nothing to decode


def replica_keys(initial: Any, seed: int, replica: int, num_keys: int) -> list[np.ndarray]:
  """Sampling keys of a replica: the checkpointed ones, keys derived from a checkpointed
  replica's keys (a resume with more replicas), or fresh ones from (seed, replica)."""
  if isinstance(initial, list):
    return [np.asarray(k, np.uint32) for k in initial]
  if isinstance(initial, dict):
    base = [jax.random.wrap_key_data(np.asarray(k, np.uint32)) for k in initial["derive_from"]]
    keys = [jax.random.fold_in(base[i % len(base)], 1000 + replica) for i in range(num_keys)]
  else:
    keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), 1 + replica), num_keys)
  return [np.asarray(jax.random.key_data(k)) for k in keys]


def episode_task(cfg: RunConfig) -> Any:
  """The run's task when its requests are episodes (an environment task, or a tool added by
  `cfg.env.tool`), else None: a plain task is not built on a replica (the lead grades).

  Raises:
    ConfigError: as `job.build_job` for a task that cannot be built.
  """
  from rlax_pipe import tasks  # pylint: disable=import-outside-toplevel
  from rlax_pipe.pipeline import job as job_lib  # pylint: disable=import-outside-toplevel
  task_cls = tasks.TASKS.get(cfg.task, (None,))[0]
  if not cfg.env.tool and not envs.is_environment(task_cls):
    return None
  return job_lib.task_for(cfg)


class ReplicaProcess:
  """One replica's main loop (this process's main thread).

  Args:
    cfg: the run.
    topology: the job (this process is a sampler replica).
    monitor: fault monitor.
    sampler_model: the model the sampler runs (its compute dtype may differ from the learner's).
    layout: the shared transfer layout.
    task: the run's task; an environment (`envs.is_environment`) makes every request an
      episode (`envs.EpisodeEngine`). None = plain sampling.
    tok: the run's tokenizer (required with an environment task: it parses and renders turns).

  Raises:
    ValueError: for an environment task without a tokenizer.
  """

  def __init__(self, cfg: RunConfig, topology: Topology, monitor: FaultMonitor,
               sampler_model: Any, layout: TransferLayout, task: Any = None, tok: Any = None):
    if envs.is_environment(task) and tok is None:
      raise ValueError("ReplicaProcess: an environment task needs the run's tokenizer (tok).")
    self.task = task if envs.is_environment(task) else None
    self.tok = tok
    self.cfg, self.topology, self.monitor = cfg, topology, monitor
    self.replica = topology.replica
    self.layout, self.model = layout, sampler_model
    self.mesh = layout.process_mesh(topology.process_id)
    data = dict(cfg.sampler_mesh_axes).get("data", 1)
    self.link = Link(topology, KVStore(), monitor, cfg.distributed, hello={
        "role": "sampler", "replica": self.replica, "slots": cfg.sampler.num_slots * data,
        "manifest": layout.manifest()})
    self.receiver = ReplicaReceiver(layout, monitor, cfg.distributed)
    self._spans: list[tuple] = []
    self._rows: list[dict] = []
    self._checks_reported = 0  # weight checks sent to the lead (`_status`)
    self.engine: SamplerEngine | envs.EpisodeEngine | None = None
    self.costs = costs_lib.CostRecorder()  # replica perf_counter; shifted when sent
    self._compiles = CompileCounter(self.costs.add_compile)

  def _record(self, component: str, kind: str, start: float, end: float,
              active: int | None = None, total: int | None = None) -> None:
    lane = f"{'env' if component == 'env' else 'sampler'}/{self.replica}"
    off = self.link.offset_s
    self._spans.append((lane, kind, start + off, end + off, active, total))

  def start(self) -> None:
    """Receives the first weights and the sampling keys, builds the engine.

    Raises:
      ProcessFault: on a fault of the job; TimeoutError: no Init or no weights in time.
    """
    self._compiles.__enter__()  # every compile of this process, from the engine's first
    init = messages.wait_for(lambda: messages.receive(self.link.inbox, (messages.Init,), 0.1),
                             self.cfg.distributed.connect_timeout_s, self.monitor, period_s=0.0)
    if init is None:
      raise TimeoutError("no 'init' message from the learner lead.")
    self.receiver.request(-1)
    limit_s = self.cfg.distributed.transfer_timeout_s
    first = messages.wait_for(self.receiver.poll, limit_s, self.monitor)
    if first is None:
      raise TimeoutError(f"{self.topology.name()}: no weights within {limit_s:.0f} s.")
    self.engine = SamplerEngine(self.model, self.cfg.sampler, first, mesh=self.mesh,
                                on_span=self._record)
    self.engine.load_rng_state(replica_keys(init.rng, self.cfg.sampler.seed, self.replica,
                                            len(self.engine.replicas)))
    if self.task is not None:  # episodes; tools in this process's worker pool
      self.engine = envs.EpisodeEngine(
          self.engine, self.task, self.tok, None, self.cfg.env,
          chat=self.cfg.prompt_format.kind == "chat", synchronous=False, on_span=self._record)
    self._installed(first.version)
    logging.info("%s: engine on devices %s, %d slots, weights version %d.",
                 self.topology.name(), [d.id for d in self.mesh.devices.flat],
                 self.engine.num_slots, first.version)

  def _installed(self, version: int) -> None:
    got = self.receiver.received[-1]
    self._rows.append({"kind": "weights", "replica": self.replica, "version": version,
                       "transfer": got["transfer"], "sender": got["sender"],
                       "transfer_s": got["seconds"], "clock": self.link.lead_clock()})
    self.receiver.request(version)

  def _status(self, with_rng: bool) -> dict:
    e = self.engine
    out = {"version": e.latest_version}
    checked = e.weight_checks_since(self._checks_reported)
    if checked:  # every version checked since the last report, not only the last one
      out["checked"] = [[int(v), [int(c) for c in sums]] for v, sums in checked]
      self._checks_reported += len(checked)
    if with_rng:
      out["rng"] = [k.tolist() for k in e.rng_state()]
    return out

  def run(self) -> None:
    """Decodes until the lead says stop; returns after the goodbye."""
    e, driver = self.engine, self.cfg.pipeline.driver
    finished, last_flush, stopping, pending = [], time.monotonic(), False, None
    while not stopping:
      t0 = time.perf_counter()
      self.monitor.check()
      while (msg := messages.receive(self.link.inbox, messages.TO_REPLICA)) is not None:
        if isinstance(msg, messages.Submit):
          for request in msg.requests:
            e.submit(request)
        elif isinstance(msg, messages.Abort):
          finished += [r for r in (e.abort(s) for s in msg.sample_ids) if r is not None]
        elif isinstance(msg, messages.Stop):
          stopping = True
        else:
          raise messages.ProtocolError("a second Init message from the lead.")
      if pending is None:  # a complete version, kept until the driver's rule lets it in
        pending = self.receiver.poll()
      installs = int(pending is not None and rules.may_update_weights(driver, e.has_work))
      if installs:
        e.update_weights(pending)
        self._installed(pending.version)
        pending = None
      if e.has_work:
        before = e.stats()
        finished += e.step()
        self.costs.record("engine_step", time.perf_counter() - t0, start_s=t0,
                          **dataclasses.asdict(engine_features(before, e.stats(), installs)))
      else:
        t0 = time.perf_counter()
        time.sleep(_IDLE_S)
        self._record("", timeline_lib.WAIT_ADMISSION, t0, time.perf_counter())
      now = time.monotonic()
      flush = now - last_flush > _FLUSH_S
      if finished or flush or e.weight_checks != self._checks_reported:
        self.link.send(*messages.wire(messages.Rollouts(tuple(finished), self._status(flush))))
        finished = []
      if flush or stopping:
        self._flush_records()
        last_flush = now

  def _flush_records(self) -> None:
    if self._spans:
      spans, self._spans = self._spans, []
      self.link.send(*messages.wire(messages.Spans(tuple(spans))))
    if self._rows:
      rows, self._rows = self._rows, []
      self.link.send(*messages.wire(messages.Rows(tuple(rows))))

  def cost_message(self, offset_s: float) -> messages.Costs:
    """The replica's timed operations and compile intervals, moved to the lead's clock by
    `offset_s` (seconds added to this process's perf_counter)."""
    records, compiles = self.costs.unflagged()  # the lead flags them against every compile
    return messages.Costs(records=tuple(
        dataclasses.replace(r, start_s=None if r.start_s is None else r.start_s + offset_s
                            ).to_dict() for r in records), compiles=tuple(
        (float(a + offset_s), float(b + offset_s)) for a, b in compiles))

  def finish(self) -> None:
    """Final statistics to the lead, drain the transfer log, close the link."""
    e = self.engine
    e.check_weights()  # the last version handed over may not have run a dispatch yet
    stats = dataclasses.asdict(e.stats())
    row = {"kind": "replica", "replica": self.replica, "process": self.topology.process_id,
           "weight_checks": e.weight_checks,
           **{k: stats[k] for k in ("weight_updates", "generated_tokens", "slot_occupancy")},
           "transfers": len(self.receiver.received),
           "transfer_s_mean": float(np.mean([r["seconds"] for r in self.receiver.received]))}
    if isinstance(e, envs.EpisodeEngine):  # episode and tool counts, as in one process
      row.update(e.episode_metrics(), continued_tokens=stats["continued_tokens"])
    self._rows.append(row)
    self.link.send(*messages.wire(messages.Rollouts(tuple(e.abort_all()), self._status(True))))
    if isinstance(e, envs.EpisodeEngine):
      e.close()  # the tool worker processes
    self._flush_records()
    self._compiles.__exit__()
    self.link.send(*messages.wire(self.cost_message(self.link.offset_s)))
    self.link.send(*messages.wire(messages.Done()))
    self.receiver.drain(self.cfg.distributed.transfer_timeout_s)
    self.link.close()
