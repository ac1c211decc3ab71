"""The RL job as one `jax.distributed` job with roles: `run(cfg)` in every process.

Process 0 is the learner's lead (`lead`), processes 1..K-1 the other learner processes
(`follower`), processes K.. the sampler replicas (`replica`). Every non-lead process opens its
link to the lead before any collective (the lead waits for every link first), so a process that
never starts is named within `connect_timeout_s`. An exception in any process is a fault of the
job (`rlax_pipe.cluster.faults`): the lead tells every process, each one logs the message naming
the failed process and its role and exits within `exit_grace_s`.
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
from rlax_pipe import costs as costs_lib
from rlax_pipe import sharding as sharding_lib
from rlax_pipe import timeline as timeline_lib
from rlax_pipe.model import Model, ModelLike
from rlax_pipe.pipeline import devices as devices_lib
from rlax_pipe.pipeline import driver as driver_lib
from rlax_pipe.pipeline import hooks as hooks_lib
from rlax_pipe.pipeline import job as job_lib
from rlax_pipe.pipeline import record as record_lib
from rlax_pipe.pipeline.config import RunConfig
from rlax_pipe.pipeline.multihost.follower import (
    FollowerProcess, make_learner, open_link, restore_or_start)
from rlax_pipe.pipeline.multihost.layout import TransferLayout
from rlax_pipe.pipeline.multihost.lead import (
    LeadSamplerSide, MultiprocessRecords, check_replica_manifests, drive, fault_on_error)
from rlax_pipe.pipeline.multihost.remote import RemoteEngines
from rlax_pipe.pipeline.multihost.replica import ReplicaProcess
from rlax_pipe.pipeline.multihost.weights import LearnerSender, WeightCoordinator, weights_kv
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.pipeline.rollout_worker import RolloutWorker
from rlax_pipe.pipeline.trainer import Trainer
from rlax_pipe.config_dict import ConfigError
from rlax_pipe.run_dir import to_jsonable
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
  """The learner mesh over every learner process's devices (`check_meshes` has checked, in
  `run`, that `learner.mesh_axes` covers exactly those devices)."""
  return sharding_lib.make_mesh(topology.learner_devices(), dict(cfg.learner.mesh_axes),
                                sharding_lib.LEARNER_RULES)


def with_meshes(cfg: RunConfig, topology: cluster.Topology) -> RunConfig:
  """`cfg` with the mesh shapes left empty (`()`, the default) chosen for the job's topology, the
  same way in every process: the learner mesh over all learner processes' devices, each replica's
  sampler mesh over its own process's devices (`devices.learner_axes_for` / `sampler_axes_for`).
  """
  learner_axes = cfg.learner.mesh_axes or devices_lib.learner_axes_for(
      topology.num_learner_processes * topology.devices_per_process)
  sampler_axes = cfg.sampler_mesh_axes or devices_lib.sampler_axes_for(
      topology.devices_per_process)
  return dataclasses.replace(cfg, sampler_mesh_axes=sampler_axes, learner=dataclasses.replace(
      cfg.learner, mesh_axes=learner_axes))


def check_meshes(cfg: RunConfig, topology: cluster.Topology) -> None:
  """The mesh shapes fit the topology (every process runs this check on the same inputs, so all
  of them stop at once with the same message, before any process waits on another).

  Raises:
    ConfigError: naming the --config field and the device count it must multiply to.
  """
  per_process = topology.devices_per_process
  learners = topology.num_learner_processes * per_process
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


def with_stop_set(cfg: RunConfig, model: Model) -> tuple[RunConfig, Any]:
  """(`cfg` with the sampler's stop set resolved as a single-process job does
  (`job.stop_ids_for`), the run's tokenizer); the model/tokenizer checks of `job` run here too.

  Raises:
    ConfigError: as `job.build_job` for a tokenizer or task file that cannot be read or a
      tokenizer that does not fit the model.
  """
  tok = job_lib._tokenizer(cfg)  # pylint: disable=protected-access
  stops = job_lib.stop_ids_for(cfg, tok, model)
  job_lib._check_vocab(cfg, model, tok, stops)  # pylint: disable=protected-access
  return dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, eos_id=stops)), tok


def _checkpoint_dir(cfg: RunConfig) -> str:
  return str(pathlib.Path(cfg.run_dir) / "checkpoints")


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
  check_meshes(cfg, topo)
  monitor = cluster.FaultMonitor(topo.name(), cfg.distributed.exit_grace_s)
  check_supported(cfg)
  logging.info("multi-process job: %s", json.dumps(topo.describe()))
  try:
    if topo.is_lead:
      out = _run_lead(given, cfg, topo, monitor, model, params, hooks)
    elif topo.role == "learner":
      _run_follower(cfg, topo, monitor, model, params)
      out = {"process": topo.process_id, "role": topo.role, "name": topo.name()}
    else:
      _run_replica(cfg, topo, monitor, model, params)
      out = {"process": topo.process_id, "role": topo.role, "name": topo.name()}
  except BaseException as e:
    fault_on_error(monitor, topo.name(), e)
    raise
  monitor.close()
  return out


def _run_follower(cfg, topo, monitor, model, params) -> None:
  model, _, params0 = job_lib._models(cfg, model, params)  # pylint: disable=protected-access
  layout = TransferLayout(topo, model, dict(cfg.sampler_mesh_axes))
  link = open_link(cfg, topo, monitor)  # first: the lead waits for every link
  learner = make_learner(cfg, learner_mesh(cfg, topo), model, params0, _checkpoint_dir(cfg))
  restore_or_start(learner, cfg.resume, topo.name())
  FollowerProcess(cfg, topo, monitor, link, learner, layout).run()


def _run_replica(cfg, topo, monitor, model, params) -> None:
  model, sampler_model, _ = job_lib._models(cfg, model, params)  # pylint: disable=protected-access
  cfg, _ = with_stop_set(cfg, model)
  layout = TransferLayout(topo, model, dict(cfg.sampler_mesh_axes))
  replica = ReplicaProcess(cfg, topo, monitor, sampler_model, layout)
  replica.start()
  replica.run()
  replica.finish()


def _restore_pipeline(extra: dict, queue: RolloutQueue, worker: RolloutWorker,
                      proxy: RemoteEngines) -> None:
  """The lead's part of a resume: queue, task iterator and the replicas' sampling keys; samples
  that were in flight on the replicas are lost with them (counted as wasted, never trained)."""
  for gid in extra["in_flight_groups"]:
    queue.discard_group(int(gid))
  worker_state = dict(extra["worker"])
  worker_state["round_open"] = 0
  worker_state["truncated"] = []
  # the requests and rollouts in flight went with the replicas (their groups were discarded
  # above): nothing of them is outstanding or in transit in this session
  worker_state["outstanding"], worker_state["detached"], worker_state["in_transit"] = [], [], []
  worker.load_state_dict(worker_state)
  if extra.get("sampler_rng") is not None:
    proxy.load_rng_state(extra["sampler_rng"])


def _run_lead(given: RunConfig, cfg: RunConfig, topo, monitor, model, params,
              user_hooks) -> dict:
  """The lead's part; `given` is the config as given (what config.json records and a resume
  checks), `cfg` the one resolved for this topology."""
  pcfg, dcfg = cfg.pipeline, cfg.distributed
  rd = record_lib.prepare_run_dir(given)
  monitor.on_fault(lambda message: record_fault(rd.path, message))
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  host = cluster.topology.local_address_towards(distributed.global_state.coordinator_address)
  hub = cluster.Hub(topo, cluster.KVStore(), monitor, dcfg, host)
  hellos = hub.accept_all()
  model, _, params0 = job_lib._models(cfg, model, params)  # pylint: disable=protected-access
  layout = TransferLayout(topo, model, dict(cfg.sampler_mesh_axes))
  check_replica_manifests(topo, hellos, layout.manifest())
  cfg, tok = with_stop_set(cfg, model)
  task = job_lib._task(cfg)  # pylint: disable=protected-access
  mesh = learner_mesh(cfg, topo)
  learner = make_learner(cfg, mesh, model, params0, rd.checkpoint_dir)
  extra = job_lib._restore_learner(given, learner, rd)  # pylint: disable=protected-access
  if extra is None:
    rd.write_config(given)
  sender = LearnerSender(layout, weights_kv(), monitor, dcfg)
  coordinator = WeightCoordinator(topo, weights_kv(), monitor, sender, layout.digest())
  proxy = RemoteEngines(hub, topo, cfg.sampler,
                        {r: hellos[topo.replica_process(r)]["slots"]
                         for r in range(topo.num_replicas)})
  for state in proxy.replicas.values():  # a lower bound: a replica's first version is newer
    state.version = learner.version
  queue = (RolloutQueue.from_state_dict(extra["queue"], pcfg.staleness, pcfg.group_filter)
           if extra else RolloutQueue(pcfg.staleness, pcfg.group_size, pcfg.group_filter))
  worker = RolloutWorker(proxy, task, tok, queue, pcfg)
  if extra:
    _restore_pipeline(extra, queue, worker, proxy)
  offset = float(extra.get("time_s", 0.0)) if extra else 0.0
  job = job_lib.Job(
      cfg=cfg, given_cfg=given, plan=None, run_dir=rd, tok=tok, task=task, model=model, learner_mesh=mesh, learner=learner,
      channel=sender, engine=proxy, queue=queue, worker=worker,
      trainer=Trainer(learner, queue, sender, pcfg), timeline=timeline_lib.Timeline(path=rd.path / "timeline.jsonl"),
      sampler_clock=None, vstate=driver_lib.VirtualState(),
      clock=job_lib.JobClock(False, offset), start_step=learner.step,
      last_eval=extra.get("last_eval") if extra else None,
      eval_mesh=layout.process_mesh(0), eval_params=sender.local_params,
      cost_recorder=costs_lib.CostRecorder())  # both roles' timed operations (lead.py)
  (rd.path / "topology.json").write_text(json.dumps(
      {**topo.describe(), "learner_mesh": dict(mesh.shape),
       "replica_mesh": dict(cfg.sampler_mesh_axes),
       "weights_from": {r: r % topo.num_learner_processes for r in range(topo.num_replicas)}},
      indent=2))
  for r in range(topo.num_replicas):
    hub.send(topo.replica_process(r), *messages.wire(messages.Init(rng=proxy.initial_rng(r))))
  sender.push(learner.params, learner.version)
  side = LeadSamplerSide(job, hub, proxy, monitor)
  monitor.on_fault(lambda message: queue.close())
  eta = hooks_lib.Eta()
  evaluation = hooks_lib.Evaluation(job, eta)
  report = hooks_lib.Report(evaluation)
  records = MultiprocessRecords(side, sender, proxy, dcfg.record_samples)
  all_hooks = [hooks_lib.TrainLog(eta), evaluation, hooks_lib.Checkpoint(), hooks_lib.Export(),
               records, *user_hooks, report]
  records.log_push(job, learner.version)
  compiles = driver_lib.CompileCounter(job.cost_recorder.add_compile).__enter__()
  side.start()
  job.clock.wall0 = time.perf_counter()
  if job.last_eval is None:
    evaluation.evaluate(job, job.start_step, job.clock.offset)
  todo = pcfg.num_steps - job.start_step
  end = drive(job, hub, monitor, all_hooks, todo) if todo > 0 else time.perf_counter()
  hub.broadcast(*messages.wire(messages.End()), role="learner")
  side.stop(dcfg.transfer_timeout_s)
  compiles.__exit__()
  time_s = job.clock.time_s(end)
  for hook in all_hooks:
    hook.on_end(job, time_s)
  coordinator.end()
  sender.close(dcfg.transfer_timeout_s)
  _wait_for_goodbyes(hub, dcfg.connect_timeout_s)
  summary = dict(report.summary)
  spans = job.timeline.spans()
  occupancy = {f"sampler/{r}": timeline_lib.slot_occupancy(spans, component=f"sampler/{r}")
               for r in range(topo.num_replicas)}
  summary["slot_occupancy_per_replica"] = occupancy
  summary["slot_occupancy"] = float(np.mean(list(occupancy.values())))
  summary["topology"] = to_jsonable(topo.describe())
  summary["queue"] = to_jsonable(dataclasses.asdict(queue.stats()))
  (rd.path / "summary.json").write_text(json.dumps(summary, indent=2))
  monitor.close()
  hub.close()
  return summary


def record_fault(run_dir: pathlib.Path, message: str) -> None:
  """Appends the job's fault to run_dir/faults.jsonl (one line per failed attempt)."""
  with open(run_dir / "faults.jsonl", "a") as f:
    f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "message": message}) + "\n")


def _wait_for_goodbyes(hub: cluster.Hub, timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and not all(p.done for p in hub.peers.values()):
    time.sleep(0.02)
