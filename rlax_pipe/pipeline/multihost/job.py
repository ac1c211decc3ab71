"""The RL job as one `jax.distributed` job with roles: `run(cfg)` in every process.

The first K = `cfg.distributed.num_learner_processes` processes form the learner mesh: process 0
is its lead (`lead`: it also holds the rollout queue, the task iterator and the run directory),
processes 1..K-1 the other learner processes (`follower`); every other process runs a sampler
replica on its own devices (`replica`). Every non-lead process opens its link to the lead before
any collective (the lead waits for every link first), so a process that never starts is named
within `connect_timeout_s`. An exception in any process is a fault of the job
(`rlax_pipe.cluster.faults`): the lead tells every process, each one logs the message naming the
failed process and its role and exits within `exit_grace_s`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any, Sequence

from absl import logging
import numpy as np

from rlax_pipe import cluster
from rlax_pipe import sharding as sharding_lib
from rlax_pipe import timeline as timeline_lib
from rlax_pipe.learner import CheckpointNotFoundError
from rlax_pipe.model import Model, ModelLike
from rlax_pipe.pipeline import devices as devices_lib
from rlax_pipe.pipeline import hooks as hooks_lib
from rlax_pipe.pipeline import job as job_lib
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.pipeline.config import RunConfig
from rlax_pipe.pipeline.multihost.follower import FollowerProcess
from rlax_pipe.pipeline.multihost.layout import TransferLayout, compare_manifests
from rlax_pipe.pipeline.multihost.lead import (
    LeadClock, LeadSamplerSide, MultiprocessRecords, fault_on_error)
from rlax_pipe.pipeline.multihost.remote import RemoteEngines
from rlax_pipe.pipeline.multihost.replica import episode_task, ReplicaProcess
from rlax_pipe.pipeline.multihost.weights import LearnerSender, WeightCoordinator
from rlax_pipe.config_dict import ConfigError
from rlax_pipe.run_dir import to_jsonable
from rlax_pipe.types import WeightUpdate
from rlax_pipe.pipeline.multihost import messages


def check_supported(cfg: RunConfig) -> None:
  """Settings a multi-process run cannot take, with the fix.

  Raises:
    ValueError: naming the field and what to set.
  """
  if cfg.pipeline.mode != "threaded":
    raise ValueError(
        f"PipelineConfig.mode={cfg.pipeline.mode!r}: a multi-process run is real concurrency on "
        "real clocks; the reproducible mode interleaves both roles on one process's virtual "
        "clocks. Set --config.pipeline.mode=threaded.")
  if cfg.pipeline.debug_verify_push:
    raise ValueError(
        "PipelineConfig.debug_verify_push compares learner and sampler params in one process; "
        "across processes every replica checks the learner's checksums of each version it "
        "installs (always on). Leave debug_verify_push False.")
  if cfg.learner.lora.enabled:
    raise ValueError(
        f"LearnerConfig.lora.rank={cfg.learner.lora.rank}: LoRA runs in one process only for now "
        "(the cross-process sender moves full params versions; the adapters-only channel with "
        "the sampler-side merge is the in-process `LoraWeightChannel`). Set "
        "--config.learner.lora.rank=0 or run on one process.")


def learner_mesh(cfg: RunConfig, topology: cluster.Topology):
  """The learner mesh over every learner process's devices (`with_meshes` has checked, in `run`,
  that `learner.mesh_axes` covers exactly those devices)."""
  return sharding_lib.make_mesh(topology.learner_devices(), dict(cfg.learner.mesh_axes),
                                sharding_lib.LEARNER_RULES)


def with_meshes(cfg: RunConfig, topology: cluster.Topology) -> RunConfig:
  """`cfg` with the mesh shapes left empty (`()`, the default) chosen for the job's topology, the
  same way in every process: the learner mesh over all learner processes' devices, each replica's
  sampler mesh over its own process's devices (`devices.learner_axes_for` / `sampler_axes_for`);
  then both checked against the topology (every process runs this on the same inputs, so all of
  them stop at once with the same message, before any process waits on another).

  Raises:
    ConfigError: naming the --config field and the device count it must multiply to.
  """
  per_process = topology.devices_per_process
  learners = topology.num_learner_processes * per_process
  cfg = dataclasses.replace(
      cfg, sampler_mesh_axes=cfg.sampler_mesh_axes or devices_lib.sampler_axes_for(per_process),
      learner=dataclasses.replace(cfg.learner, mesh_axes=cfg.learner.mesh_axes
                                  or devices_lib.learner_axes_for(learners)))
  sampler, learner = cfg.num_sampler_devices, cfg.num_learner_devices
  if sampler != per_process:
    raise ConfigError(
        f"--config.sampler_mesh_axes={cfg.sampler_mesh_axes} has {sampler} devices, but each "
        f"sampler replica is one process with {per_process}: set it to a product of "
        f"{per_process} (or leave it () to choose), or start the processes with {sampler} "
        "devices each (local launcher: --devices_per_process).")
  if learner != learners:
    raise ConfigError(
        f"--config.learner.mesh_axes={cfg.learner.mesh_axes} has {learner} devices, but the "
        f"{topology.num_learner_processes} learner processes hold {learners}: set it to a "
        f"product of {learners} (or leave it () to choose).")
  return cfg


def run(cfg: RunConfig, *, model: ModelLike | None = None, params: Any = None,
        hooks: Sequence[hooks_lib.StepHook] = ()) -> dict:
  """Runs this process's role of a multi-process RL job (call it in every process).

  Args:
    cfg: the run (the same on every process); `cfg.distributed.num_learner_processes` >= 1.
    model, params, hooks: as `rlax_pipe.pipeline.run.run` (hooks run on the lead).

  Returns:
    On the lead, the run summary (also in run_dir/summary.json); elsewhere
    {"process": id, "role": ..., "name": ...}.

  Raises:
    ValueError: on settings a multi-process run cannot take, or a job without enough processes.
    ProcessFault: when the job failed (the message names the process and its role).
  """
  topo = cluster.current(cfg.distributed.num_learner_processes)
  given, cfg = cfg, with_meshes(cfg, topo)
  monitor = cluster.FaultMonitor(topo.name(), cfg.distributed.exit_grace_s)
  check_supported(cfg)
  logging.info("multi-process job: %s", json.dumps(topo.describe()))
  try:
    if topo.is_lead:
      out = _run_lead(given, topo, monitor, model, params, hooks)
    else:
      run_role = _run_follower if topo.role == "learner" else _run_replica
      run_role(cfg, topo, monitor, model, params)
      out = {"process": topo.process_id, "role": topo.role, "name": topo.name()}
  except BaseException as e:
    fault_on_error(monitor, topo.name(), e)
    raise
  monitor.close()
  return out


def _run_follower(cfg, topo, monitor, model, params) -> None:
  model, _, params0 = job_lib.models_for(cfg, model, params)
  layout = TransferLayout(topo, model, dict(cfg.sampler_mesh_axes))
  link = cluster.Link(topo, cluster.KVStore(), monitor, cfg.distributed,
                      hello={"role": "learner"})  # first: the lead waits for every link
  learner = job_lib.make_learner(cfg, learner_mesh(cfg, topo), model, params0,
                                 str(pathlib.Path(cfg.run_dir) / "checkpoints"))
  if cfg.resume:  # the same checkpoint files give every learner process the same step
    try:
      learner.restore()
    except CheckpointNotFoundError as e:
      logging.warning("%s: resume requested but no checkpoint (%s); starting fresh.",
                      topo.name(), e)
  FollowerProcess(cfg, topo, monitor, link, learner, layout).run()


def _run_replica(cfg, topo, monitor, model, params) -> None:
  model, sampler_model, _ = job_lib.models_for(cfg, model, params)
  tok = job_lib.tokenizer_for(cfg)  # the stop set and the model/tokenizer checks as `build_job`
  stops = job_lib.stop_ids_for(cfg, tok, model)
  job_lib.check_vocab(cfg, model, tok, stops)
  cfg = job_lib.with_stops(cfg, stops)
  layout = TransferLayout(topo, model, dict(cfg.sampler_mesh_axes))
  replica = ReplicaProcess(cfg, topo, monitor, sampler_model, layout, task=episode_task(cfg),
                           tok=tok)
  replica.start()
  replica.run()
  replica.finish()


class LeadPlacement:
  """The lead's answers to `job.build_job` (`job.Placement`): the learner mesh over every learner
  process, the replicas of other processes as the sampler (`RemoteEngines`), the
  `LearnerSender` as the weight sink, held-out evaluation on the lead's own devices.

  `place` opens the lead's links (`hub`, waiting for every process) and checks that every
  replica expects the layout the learner sends (else `LayoutMismatchError`, naming the first
  difference with both sides); `sampler` starts the weight protocol (`sender`, `coordinator`)
  and pushes the learner's version.

  Args:
    topology: the job.
    monitor: the fault monitor (a fault is also appended to run_dir/faults.jsonl).
  """

  def __init__(self, topology: cluster.Topology, monitor: cluster.FaultMonitor):
    self.topology, self.monitor = topology, monitor
    self.plan, self.eval_mesh, self.eval_params = None, None, None
    self.hub: cluster.Hub | None = None
    self.sender: LearnerSender | None = None
    self.coordinator: WeightCoordinator | None = None
    self.proxy: RemoteEngines | None = None

  def place(self, cfg: RunConfig, model: Model, stops: Any, rd) -> tuple[RunConfig, Any]:
    topo = self.topology
    self.monitor.on_fault(lambda message: record_fault(rd.path, message))
    from jax._src import distributed  # pylint: disable=import-outside-toplevel
    host = cluster.topology.local_address_towards(distributed.global_state.coordinator_address)
    self.hub = cluster.Hub(topo, cluster.KVStore(), self.monitor, cfg.distributed, host)
    self._hellos = self.hub.accept_all()
    cfg = with_meshes(cfg, topo)
    self.layout = TransferLayout(topo, model, dict(cfg.sampler_mesh_axes))
    for p in topo.replica_processes:  # every replica expects the layout the learner sends
      compare_manifests(self.layout.manifest(), self._hellos[p]["manifest"],
                        "the learner (process 0)", topo.name(p))
    self.eval_mesh = self.layout.process_mesh(0)
    cfg = job_lib.with_stops(cfg, stops)
    self._mesh = learner_mesh(cfg, topo)
    return cfg, self._mesh

  def record(self, rd, cfg: RunConfig, learner, tok, stops: Any) -> None:
    del learner, tok, stops
    topo = self.topology
    (rd.path / "topology.json").write_text(json.dumps(
        {**topo.describe(), "learner_mesh": dict(self._mesh.shape),
         "replica_mesh": dict(cfg.sampler_mesh_axes),
         "weights_from": {r: r % topo.num_learner_processes for r in range(topo.num_replicas)}},
        indent=2))

  def sampler(self, cfg: RunConfig, model, sampler_model, learner, tok, task, state, extra,
              sampler_clock, timeline):
    del model, sampler_model, tok, task, state, sampler_clock, timeline
    topo, dcfg = self.topology, cfg.distributed
    self.sender = LearnerSender(self.layout, self.monitor, dcfg)
    self.coordinator = WeightCoordinator(self.sender, self.monitor)
    # the replicas' saved sampling keys; the samples in flight on them were lost with them
    # (`build_job` discards their groups: counted as wasted, never trained)
    self.proxy = RemoteEngines(self.hub, topo, cfg.sampler,
                               {r: self._hellos[topo.replica_process(r)]["slots"]
                                for r in range(topo.num_replicas)},
                               learner.version, (extra or {}).get("sampler_rng"))
    self.eval_params = self.sender.local_params
    self.sender.push(WeightUpdate(learner.version, learner.params))
    return self.sender, self.proxy


def _run_lead(given: RunConfig, topo, monitor, model, params, user_hooks) -> dict:
  """The lead's part: the job built by `job.build_job` with a `LeadPlacement` and run by
  `run.run_job` with a `LeadClock`; `given` is the config as given (what config.json records
  and a resume checks)."""
  place = LeadPlacement(topo, monitor)
  job = job_lib.build_job(given, model, params, placement=place)
  hub, proxy, sender, dcfg = place.hub, place.proxy, place.sender, job.cfg.distributed
  for r in range(topo.num_replicas):
    hub.send(topo.replica_process(r), *messages.wire(messages.Init(rng=proxy.initial_rng(r))))
  monitor.on_fault(lambda message: job.queue.close())
  side = LeadSamplerSide(job, hub, proxy, monitor)
  records = MultiprocessRecords(side, sender, proxy, dcfg.record_samples)
  records.log_push(job, job.learner.version)

  def stop_processes() -> None:
    hub.broadcast(*messages.wire(messages.End()), role="learner")
    side.stop(dcfg.transfer_timeout_s)

  summary = dict(run_lib.run_job(job, LeadClock(hub, monitor), [records, *user_hooks],
                                 checkpoint_on_error=False, before_end=stop_processes))
  place.coordinator.end()
  sender.close(dcfg.transfer_timeout_s)
  messages.wait_for(lambda: all(p.done for p in hub.peers.values()), dcfg.connect_timeout_s)
  spans = job.timeline.spans()
  occupancy = {f"sampler/{r}": timeline_lib.slot_occupancy(spans, component=f"sampler/{r}")
               for r in range(topo.num_replicas)}
  summary["slot_occupancy_per_replica"] = occupancy
  summary["slot_occupancy"] = float(np.mean(list(occupancy.values())))
  summary["topology"] = to_jsonable(topo.describe())
  summary["queue"] = to_jsonable(dataclasses.asdict(job.queue.stats()))
  (job.run_dir.path / "summary.json").write_text(json.dumps(summary, indent=2))
  monitor.close()
  hub.close()
  return summary


def record_fault(run_dir: pathlib.Path, message: str) -> None:
  """Appends the job's fault to run_dir/faults.jsonl (one line per failed attempt)."""
  with open(run_dir / "faults.jsonl", "a") as f:
    f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "message": message}) + "\n")
