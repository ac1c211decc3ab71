"""The RL job's components, built in one function, and their checkpointed state.

`build_job` assembles (or restores) tokenizer, task, meshes, learner, weight channel, sampler
engine, rollout queue, rollout worker and trainer, where its `placement` says (`build_job`'s
Args); `Job.save(time_s)` checkpoints them. Every stateful component saves and restores through
one protocol, `state_dict()` / `load_state_dict(state)`:

  learner            TrainState (orbax checkpoint, `Learner.save` / `restore`)
  sampling PRNG      the engine's keys (`rng_state`), in every mode   } JSON beside the learner
  queue, admission   `RolloutQueue` (staleness admission inside)    } JSON beside the learner
  worker, task iter. `RolloutWorker` (prompt / group / sample ids)  } checkpoint ("extra")
  engine, scheduler, allocator   `SamplerEngine` (the other two inside)   } reproducible runs:
  clock              `driver.VirtualState` (virtual clocks, samples in transit) } run_dir/
  timeline           `Timeline` spans                                       } pipeline_state/

Threading contract: in reproducible mode everything runs on the calling thread. In threaded mode
the sampler loop (worker, engine, `WeightChannel.try_take`) runs on its own thread and the learner
loop (trainer, learner, `WeightChannel.push`, step hooks) on the calling thread; they share only
the rollout queue and the weight channel, both lock-protected. Exception, not addressed yet: a
checkpoint taken on the learner thread reads the worker's task-iterator counters without a lock
while the sampler thread may be advancing them. The policy version is owned by the learner
(`TrainState.version`); the engine owns the version of the weights it holds; the queue and the
channel only remember the newest version they were told about.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import time
from typing import Any, Callable, Protocol

from absl import logging
import jax
import numpy as np

from rlax_pipe import costs as costs_lib
from rlax_pipe import envs
from rlax_pipe import model_dir
from rlax_pipe import tasks
from rlax_pipe import timeline as timeline_lib
from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.config import LoraConfig
from rlax_pipe.config_dict import ConfigError, name_fields
from rlax_pipe.learner import Learner
from rlax_pipe.model import Model, ModelLike, Transformer, as_model, hf_io, lora_hf, moe
from rlax_pipe.model import lora as lora_lib
from rlax_pipe.pipeline import config_checks
from rlax_pipe.pipeline import devices as devices_lib
from rlax_pipe.pipeline import driver as driver_lib
from rlax_pipe.pipeline import record as record_lib
from rlax_pipe.pipeline.config import BUILTIN_INIT, BUILTIN_MOE_INIT, RunConfig
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.pipeline.rollout_worker import RolloutWorker
from rlax_pipe.pipeline.trainer import Trainer
from rlax_pipe.pipeline.lora_channel import LoraWeightChannel, sampler_target
from rlax_pipe.pipeline.weight_channel import WeightChannel
from rlax_pipe.run_dir import RunDir, load_state, save_state, to_jsonable
from rlax_pipe.sampler import SamplerEngine
from rlax_pipe.types import WeightUpdate

PIPELINE_STATE = "pipeline_state"


def builtin_warm_start_path() -> pathlib.Path:
  """The SFT warm start shipped with the package (written by experiments/sft.py)."""
  return pathlib.Path(__file__).resolve().parent.parent / "assets" / "sft_arithmetic"


def load_initial_params(init: str, param_dtype: str = "float32"):
  """(ModelConfig, host params) from "builtin", "builtin_moe" or an HF-format directory.

  Raises:
    ConfigError: naming RunConfig.init, the path and how to create it, or what the HF loader
      found wrong with the directory.
  """
  if init == BUILTIN_MOE_INIT:  # the dense warm start, upcycled (same function at step 0)
    return moe.upcycle(*load_initial_params(BUILTIN_INIT, param_dtype), n_experts=4,
                       n_experts_per_tok=2, rng=jax.random.key(0),
                       router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
  path = builtin_warm_start_path() if init == BUILTIN_INIT else pathlib.Path(init)
  if not (path / "config.json").exists():
    hint = ("run `python experiments/sft.py --config.out_dir=rlax_pipe/assets/sft_arithmetic`"
            if init == BUILTIN_INIT else
            "pass an HF model directory with config.json + *.safetensors")
    raise ConfigError(f"RunConfig.init={init!r}: no HF-format checkpoint at {path}: {hint}.")
  try:
    return hf_io.load_hf_checkpoint(path, param_dtype=param_dtype)
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f"RunConfig.init={init!r}: {e}") from None


@dataclasses.dataclass
class JobClock:
  """Run time of a job in seconds: virtual (reproducible mode) or wall-clock minus evaluation.

  Attributes:
    reproducible: the driver's clock is virtual (then `time_s(now) == now`).
    offset: run time already spent before this session (resume), seconds.
    wall0: `time.perf_counter()` at the start of this session.
    excluded: wall-clock seconds of this session spent in held-out evaluation.
  """

  reproducible: bool
  offset: float
  wall0: float = dataclasses.field(default_factory=time.perf_counter)
  excluded: float = 0.0

  def time_s(self, now: float) -> float:
    """Run time at driver time `now` (virtual seconds, or `time.perf_counter()`)."""
    return now if self.reproducible else self.offset + (now - self.wall0 - self.excluded)

  def wall_s(self) -> float:
    """Wall-clock seconds of this session, evaluation excluded."""
    return time.perf_counter() - self.wall0 - self.excluded


@dataclasses.dataclass
class Job:
  """The live components of one run (see the module docstring for who owns what).

  `cfg` is the resolved configuration (mesh shapes chosen for the devices present, the stop set
  from the tokenizer); `given_cfg` the one given (what config.json records and a resume checks).
  """

  cfg: RunConfig
  given_cfg: RunConfig
  plan: devices_lib.DevicePlan | None  # None in a multi-process job (its topology.json)
  run_dir: RunDir
  tok: tokenizer_lib.Tokenizer
  task: Any
  model: Model
  learner: Learner  # on the learner mesh (`learner.mesh`)
  channel: WeightChannel
  engine: SamplerEngine
  queue: RolloutQueue
  worker: RolloutWorker
  trainer: Trainer
  timeline: timeline_lib.Timeline
  sampler_clock: timeline_lib.VirtualClock | None
  vstate: driver_lib.VirtualState
  clock: JobClock
  start_step: int
  last_eval: float | None
  cost_recorder: costs_lib.CostRecorder | None = None  # threaded mode: timed operations
  # Held-out evaluation: the mesh of its engine (None = the learner mesh) and a function giving
  # (version, params) for it (None = the learner's own params). A multi-process job evaluates on
  # the lead's own devices with a copy of its staging params.
  eval_mesh: Any = None
  eval_params: Callable[[], tuple[int, Any]] | None = None

  @property
  def reproducible(self) -> bool:
    return self.cfg.pipeline.mode == "reproducible"

  def save(self, time_s: float) -> None:
    """Checkpoints the job at run time `time_s` (what, and where: the module docstring)."""
    queue_state = self.queue.state_dict()
    queued = {r["group_id"] for g in queue_state["ready"] for r in g["rollouts"]}
    live = [g for g, _ in queue_state["admission"]["live"]] if queue_state.get("admission") else []
    extra = {"worker": self.worker.state_dict(), "queue": queue_state,
             "in_flight_groups": [int(g) for g in live if g not in queued],
             "sampler_rng": to_jsonable(self.engine.rng_state()),
             "time_s": time_s, "last_eval": self.last_eval,
             "config": to_jsonable(self.given_cfg)}
    step = self.learner.save(to_jsonable(extra))
    if not self.reproducible:
      self.timeline.flush()  # appended, never rewritten
      return
    root = self.run_dir.path / PIPELINE_STATE
    save_state(root / str(step), {"engine": self.engine.state_dict(),
                                  "clock": self.vstate.state_dict(),
                                  "timeline": self.timeline.state_dict()})
    steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())
    for old in steps[:-self.cfg.learner.checkpoint.keep]:
      shutil.rmtree(root / str(old), ignore_errors=True)


def restore_learner(cfg: RunConfig, learner: Learner, rd: RunDir) -> dict | None:
  """Restores the newest checkpoint (resume) and makes the run dir a record of it (a fresh run:
  writes its config.json). A resume that fell back past corrupt checkpoints says so in
  metrics.jsonl (kind "checkpoint_fallback": the step restored, the steps skipped and why)
  besides the log.

  Returns:
    The checkpoint's extra state (`Job.save`), or None for a fresh run.
  """
  if not cfg.resume:
    rd.write_config(cfg)
    return None
  extra = learner.restore()
  record_lib.record_resume(rd, cfg, learner.step, extra.get("config"))
  logging.info("resumed at learner step %d (version %d).", learner.step, learner.version)
  info = learner.last_restore
  if info is not None and info.skipped:
    logging.error("resume fell back to checkpoint step %d: newer steps %s were unusable (%s).",
                  info.step, list(info.skipped), "; ".join(info.skip_reasons))
    rd.log({"kind": "checkpoint_fallback", "step": info.step, "restored_step": info.step,
            "skipped_steps": list(info.skipped), "reasons": list(info.skip_reasons)}, info.step)
  return extra


def tokenizer_for(cfg: RunConfig) -> tokenizer_lib.Tokenizer:
  """The tokenizer of `cfg.tokenizer_path`, else of the init directory, else the shipped one."""
  init = None if cfg.init in (BUILTIN_INIT, BUILTIN_MOE_INIT) else cfg.init
  field = "tokenizer_path" if cfg.tokenizer_path is not None else "init"
  try:
    return model_dir.tokenizer_for(init, cfg.tokenizer_path, cfg.prompt_format)[0]
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"RunConfig.{field}={getattr(cfg, field)!r} (tokenizer): {e}") from None


def task_for(cfg: RunConfig):
  try:
    return envs.add_tool(tasks.make_task(cfg.task, config_checks.task_config_of(cfg)), cfg.env)
  except ConfigError:
    raise
  except (FileNotFoundError, ValueError, ImportError) as e:
    raise ConfigError(f"RunConfig.task={cfg.task!r} (task_config): {e}") from None


def stop_ids_for(cfg: RunConfig, tok, model: Model) -> Any:
  """The sampler's stop set of a run: `cfg.sampler.eos_id`, or, when empty (None and () both
  normalise to ()), the tokenizer's stop ids with the model config's EOS ids
  (`model_dir.stop_set`).

  Args:
    cfg: the run's config.
    tok: the run's tokenizer (`Tokenizer`).
    model: the policy model; its `cfg.eos_token_ids` (when it has them) join the set.

  Returns:
    int or tuple of int token ids (what `SamplerConfig.eos_id` takes).
  """
  if cfg.sampler.eos_id:
    return cfg.sampler.eos_id
  model_cfg = getattr(model, "cfg", None)
  return model_dir.stop_set(tok, tuple(getattr(model_cfg, "eos_token_ids", ())))


def check_vocab(cfg: RunConfig, model: Model, tok, stops: Any) -> None:
  """The tokenizer's ids index the model's embedding; sequences fit the model's context; top-p
  leaves more than the argmax token (`config_checks` has the rules that need no model)."""
  context = getattr(model, "max_seq_len", None)
  if context is not None and cfg.sampler.max_seq_len > context:
    raise ConfigError(
        f"RunConfig.sampler.max_seq_len={cfg.sampler.max_seq_len} exceeds the context of the "
        f"model of RunConfig.init={cfg.init!r} ({context} positions): lower sampler.max_seq_len "
        f"(and pipeline.seq_len) to <= {context}.")
  vocab = getattr(model, "vocab_size", None)
  if vocab is None:
    return
  sampling, group_size = cfg.sampler.sampling, cfg.pipeline.group_size
  if group_size >= 2 and not sampling.greedy and sampling.top_p * vocab <= 1.0:
    # The most likely token has probability >= 1 / vocab >= top_p, so the nucleus is that one
    # token, barring exact ties with it (`logprobs.processed_logprobs`): every sample of a group
    # is the argmax completion.
    raise ConfigError(
        f"RunConfig.sampler.sampling.top_p={sampling.top_p:g} <= 1 / {vocab} (the model's "
        f"vocabulary) with RunConfig.pipeline.group_size={group_size} learns nothing: the nucleus "
        "holds only the most likely token (barring exact ties), so every sample of a group is "
        f"the same and every group-relative advantage ({cfg.pipeline.advantage}) is 0. Raise "
        f"top_p above {1.0 / vocab:.3g} (1.0 = off).")
  ids = [stops] if isinstance(stops, int) else list(stops)
  if tok.vocab_size > vocab or any(i >= vocab for i in ids):
    raise ConfigError(
        f"the tokenizer ({tok.source}, {tok.vocab_size} ids, stop ids {ids}) does not fit the "
        f"model of RunConfig.init={cfg.init!r} ({vocab} embeddings): use the model's own "
        "tokenizer (RunConfig.tokenizer_path, or leave it None to use the one in the init "
        "directory).")


def check_job_settings(cfg, model) -> None:
  """The rules of `cfg` that need the model or the file system (Raises; a warning when the LoRA
  adapters cannot also be exported in PEFT format), checked when the job is built, before any
  device work, with one line naming the `--config.` field and the fix (`config_checks` has the
  rules between fields, `check_vocab` those of the tokenizer).

  Args:
    cfg: the `RunConfig`.
    model: the learner's `rlax_pipe.model.Model`.

  Raises:
    ConfigError: a LoRA target that matches no weight matrix or a rank above a targeted
      matrix's width (naming `RunConfig.learner.lora.<field>`), or a KL reference that is not
      an HF model directory (`RunConfig.objective.kl_reference`).
  """
  lora = None
  if cfg.learner.lora.enabled:
    try:
      lora = lora_lib.LoraAdapters(model, cfg.learner.lora)
    except ValueError as e:
      raise ConfigError(name_fields(str(e), LoraConfig, "RunConfig.learner.lora.")) from None
  o = cfg.objective
  if o.kl != "off" and o.kl_reference is not None:
    path = pathlib.Path(o.kl_reference)
    if not (path / "config.json").is_file():
      what = "does not exist" if not path.exists() else "holds no config.json"
      raise ConfigError(
          f"RunConfig.objective.kl_reference={o.kl_reference!r}: the directory {what}; pass an "
          "HF model directory (config.json + *.safetensors) of the same architecture, or leave "
          "it unset to use the initial params as the KL reference.")
  if lora is not None and cfg.export_hf:
    # Decided: a warning, not an error. Training with such a target is fine and hf/ (the merged
    # policy) is still exported; only hf_lora/ (the PEFT adapter directory) is skipped.
    problem = lora_hf.peft_export_problem(lora)
    if problem is not None:
      logging.warning("RunConfig.learner.lora.target_modules=%s: run_dir/hf_lora/ will not be "
                      "written at the end (%s); run_dir/hf/ gets the merged policy.",
                      cfg.learner.lora.target_modules, problem)


def with_stops(cfg: RunConfig, stops: Any) -> RunConfig:
  """`cfg` with the sampler's stop set (`stop_ids_for`) filled in, single- or multi-process.

  Raises:
    ConfigError: when `SamplerConfig` refuses the stop set (naming it and the reason).
  """
  try:
    return dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, eos_id=stops))
  except (TypeError, ValueError) as e:
    raise ConfigError(
        f"the tokenizer's stop set {stops} does not fit RunConfig.sampler.eos_id ({e}); set "
        "RunConfig.sampler.eos_id to the id that ends a completion.") from None


def _resolve(cfg: RunConfig, plan: devices_lib.DevicePlan, stops: Any) -> RunConfig:
  """`cfg` with the chosen mesh shapes and stop set filled in."""
  cfg = with_stops(cfg, stops)
  try:
    learner = dataclasses.replace(cfg.learner, mesh_axes=plan.learner_mesh_axes)
  except ValueError as e:  # a rule between the learner's fields and the mesh chosen here
    raise ConfigError(
        f"{str(e).replace('LearnerConfig.', 'RunConfig.learner.')} (the learner mesh was chosen "
        f"for the devices present: {plan.describe()}; or set RunConfig.learner.mesh_axes)"
    ) from None
  return dataclasses.replace(cfg, learner=learner, sampler_mesh_axes=plan.sampler_mesh_axes)


def _load_sampler_state(rd: RunDir, step: int) -> dict | None:
  state = load_state(rd.path / PIPELINE_STATE / str(step))
  if state is None:
    logging.warning("no sampler state for checkpoint step %d in %s: resuming without the "
                    "in-flight samples (the continuation will differ from an uninterrupted "
                    "run).", step, rd.path / PIPELINE_STATE)
  else:
    logging.info("exact resume: sampler state of step %d restored.", step)
  return state


def models_for(cfg: RunConfig, model: ModelLike | None, params: Any) -> tuple[Model, Model, Any]:
  """(learner model, sampler model, initial params)."""
  if model is None:
    model_cfg, params = load_initial_params(cfg.init)
    model = Transformer(model_cfg)
  model = as_model(model)
  sampler_model = model
  if cfg.sampler_compute_dtype is not None:
    if not hasattr(model, "with_compute_dtype"):
      raise ValueError(f"RunConfig.sampler_compute_dtype={cfg.sampler_compute_dtype!r} needs a "
                       "model with with_compute_dtype() (the built-in Transformer); this "
                       f"{type(model).__name__} sets its own dtypes.")
    sampler_model = model.with_compute_dtype(cfg.sampler_compute_dtype)
    logging.info("sampler computes in %s, learner in %s (precision mismatch on purpose).",
                 cfg.sampler_compute_dtype, model.compute_dtype)
  return model, sampler_model, params


def _verifier(model: Model, learner: Learner, tok) -> Callable[[Any, int], None]:
  """Debug check of a push: sampler-side and learner-side logits of a probe sequence agree."""
  probe = np.asarray(tok.encode_prompt("Q: 1+2+3\n1+2=3\n3+3=6\nA: 6"), np.int32)[None]
  pos = np.arange(probe.shape[1], dtype=np.int32)[None]

  def verify(sampler_params, version: int) -> None:
    ls, _ = model.forward(sampler_params, probe, pos)
    ll, _ = model.forward(learner.merged_params(), probe, pos)
    diff = float(np.max(np.abs(np.asarray(ls) - np.asarray(ll))))
    if not diff < 1e-3:
      raise RuntimeError(f"weight push of version {version} did not apply: sampler and learner "
                         f"logits differ by {diff:.3g} on the probe sequence.")
  return verify


def make_learner(cfg: RunConfig, learner_mesh: Any, model: Model, params: Any,
                 checkpoint_dir: str) -> Learner:
  """The run's `Learner` on `learner_mesh` (every learner process of a multi-process job builds
  it identically: its init is a collective), checkpointing into `checkpoint_dir`, its objective's
  `max_lag` the staleness config's (the one source of the setting)."""
  learner_cfg = dataclasses.replace(cfg.learner, checkpoint=dataclasses.replace(
      cfg.learner.checkpoint, directory=checkpoint_dir))
  objective_cfg = dataclasses.replace(cfg.objective, max_lag=cfg.pipeline.staleness.max_lag)
  return Learner(model, learner_cfg, objective_cfg, cfg.sampler.sampling, mesh=learner_mesh,
                 params=params)


class Placement(Protocol):
  """Where a job's parts run: what `build_job` asks of a single-process job (`LocalPlacement`)
  or of a multi-process job's lead (`multihost.job.LeadPlacement`).

  Attributes:
    plan, eval_mesh, eval_params: as `Job.plan`, `Job.eval_mesh`, `Job.eval_params`.
  """

  plan: devices_lib.DevicePlan | None
  eval_mesh: Any
  eval_params: Callable[[], tuple[int, Any]] | None

  def place(self, cfg: RunConfig, model: Model, stops: Any,
            rd: RunDir) -> tuple[RunConfig, Any]:
    """(`cfg` with the mesh shapes and the stop set resolved, the learner mesh)."""

  def record(self, rd: RunDir, cfg: RunConfig, learner: Learner, tok, stops: Any) -> None:
    """Writes where the job runs into the run directory."""

  def sampler(self, cfg: RunConfig, model: Model, sampler_model: Model, learner: Learner, tok,
              task, state: dict | None, extra: dict | None, sampler_clock, timeline):
    """(weight sink, sampler engine), the learner's version pushed; restored from `state` (an
    exact resume) or `extra` (the checkpoint's sampling keys)."""


class LocalPlacement:
  """One process: sampler and learner meshes from the devices present (`devices.plan_devices`),
  an in-process weight channel and a local `SamplerEngine` (an `envs.EpisodeEngine` around it
  for a multi-turn environment)."""

  def __init__(self):
    self.plan: devices_lib.DevicePlan | None = None
    self.eval_mesh, self.eval_params = None, None
    self._sampler_mesh = None

  def place(self, cfg: RunConfig, model: Model, stops: Any,
            rd: RunDir) -> tuple[RunConfig, Any]:
    del model, rd
    self.plan = devices_lib.plan_devices(cfg.sampler_mesh_axes, cfg.learner.mesh_axes,
                                         jax.devices())
    logging.info("devices: %s", self.plan.describe())
    cfg = _resolve(cfg, self.plan, stops)
    learner_mesh, self._sampler_mesh = devices_lib.make_meshes(self.plan)
    return cfg, learner_mesh

  def record(self, rd: RunDir, cfg: RunConfig, learner: Learner, tok, stops: Any) -> None:
    rd.write_json("run_info.json", {
        "devices": self.plan.describe(), "sampler_mesh_axes": self.plan.sampler_mesh_axes,
        "learner_mesh_axes": self.plan.learner_mesh_axes, "stop_ids": stops,
        "tokenizer": str(tok.source), "prompt_format": cfg.prompt_format,
        "start_step": learner.step})

  def sampler(self, cfg: RunConfig, model: Model, sampler_model: Model, learner: Learner, tok,
              task, state: dict | None, extra: dict | None, sampler_clock, timeline):
    pcfg, reproducible, mesh = cfg.pipeline, cfg.pipeline.mode == "reproducible", self._sampler_mesh
    target = sampler_target(model.param_axes(), model.abstract_params(), mesh)
    verify = _verifier(model, learner, tok) if pcfg.debug_verify_push else None
    if learner.lora is None:
      channel = WeightChannel(target, verify=verify, debug=pcfg.debug_verify_push)
    else:  # adapters only over the wire; the sampler merges them into its copy of the base
      channel = LoraWeightChannel(learner.lora, learner.base_params, mesh, verify=verify,
                                  debug=pcfg.debug_verify_push)
      logging.info("LoRA: the base (%d bytes) went to the sampler once; each version pushes its "
                   "adapters only (%d bytes) and the sampler merges them.", channel.base_bytes,
                   channel.stats().bytes_per_version)
    engine_kw = dict(mesh=mesh, clock=sampler_clock or time.perf_counter,
                     on_span=None if reproducible else timeline.record)
    if state is None:  # the engine holds the learner's weights
      channel.push(WeightUpdate(learner.version, learner.params))
      engine = SamplerEngine(sampler_model, cfg.sampler,
                             channel.take(timeout=pcfg.wait_timeout_s), **engine_kw)
    else:  # exact resume: the weights and requests it held, the learner's version pending
      leaves, treedef = jax.tree.flatten(target)
      initial = jax.tree.unflatten(treedef, [jax.device_put(a, t.sharding) for a, t in
                                             zip(state["engine"]["params"], leaves)])
      engine = SamplerEngine(sampler_model, cfg.sampler,
                             WeightUpdate(int(state["engine"]["version"]), initial, donated=True),
                             **engine_kw)
      engine.load_state_dict(state["engine"])
      channel.push(WeightUpdate(learner.version, learner.params))  # pending, as it was
      timeline.load_state_dict(state["timeline"])
    if envs.is_environment(task):  # multi-turn episodes with tools (`rlax_pipe.envs`)
      engine = envs.EpisodeEngine(engine, task, tok, None, cfg.env,
                                  chat=cfg.prompt_format.kind == "chat", synchronous=reproducible,
                                  on_span=None if reproducible else timeline.record,
                                  clock=engine.clock)
      if state is not None:
        engine.load_episode_state(state["engine"])
    if state is None and extra and extra.get("sampler_rng") is not None:
      # Threaded resume: the sampler's random stream continues where the checkpoint left it (it
      # would otherwise replay the first run's stream from key(seed)). A multi-process job's
      # checkpoint holds {"replicas": [...]}: this engine continues its first replica's keys.
      keys = extra["sampler_rng"]
      if isinstance(keys, dict):
        keys = next((k for k in keys.get("replicas", []) if k is not None), [])
      engine.load_rng_state(keys)
    return channel, engine


def build_job(cfg: RunConfig, model: ModelLike | None = None, params: Any = None, *,
              placement: Placement | None = None) -> Job:
  """Builds (and with `cfg.resume`, restores) every component of a run.

  Args:
    cfg: the run (as given: config.json records it and a resume checks it).
    model, params: as `run.run`.
    placement: where the parts run (`Placement`); None = `LocalPlacement()` (one process).

  Raises:
    ConfigError: for a user's mistake, naming the config field and the fix: a run dir that
      holds checkpoints without resume, a resume without a checkpoint or with unnamed changes
      (`record`), meshes that do not fit the devices (`devices`), an init directory, tokenizer
      or task file that cannot be read, a tokenizer that does not fit the model.
    ValueError / FileNotFoundError: from the components' own checks.
  """
  given = cfg
  pcfg = cfg.pipeline
  placement = placement or LocalPlacement()
  rd = record_lib.prepare_run_dir(cfg)
  tok = tokenizer_for(cfg)
  task = task_for(cfg)
  if envs.is_environment(task):  # chat prompts declare the environment's tool schemas
    envs.declare_tools(tok, task)
  model, sampler_model, params0 = models_for(cfg, model, params)
  stops = stop_ids_for(cfg, tok, model)
  check_vocab(cfg, model, tok, stops)
  check_job_settings(cfg, model)
  cfg, learner_mesh = placement.place(cfg, model, stops, rd)
  learner = make_learner(cfg, learner_mesh, model, params0, rd.checkpoint_dir)
  extra = restore_learner(cfg=given, learner=learner, rd=rd)
  placement.record(rd, cfg, learner, tok, stops)
  offset = float(extra.get("time_s", 0.0)) if extra else 0.0
  reproducible = pcfg.mode == "reproducible"
  state = _load_sampler_state(rd, learner.step) if (extra and reproducible) else None
  vstate = driver_lib.VirtualState(t_s=offset, t_l=offset)
  if state is not None:
    vstate.load_state_dict(state["clock"])
  sampler_clock = timeline_lib.VirtualClock(vstate.t_s) if reproducible else None
  timeline = timeline_lib.Timeline(clock=sampler_clock if reproducible else time.perf_counter,
                                   path=rd.path / "timeline.jsonl", truncate=state is None)
  channel, engine = placement.sampler(cfg, model, sampler_model, learner, tok, task, state,
                                      extra, sampler_clock, timeline)
  queue = (RolloutQueue.from_state_dict(extra["queue"], pcfg.staleness, pcfg.group_filter)
           if extra else RolloutQueue(pcfg.staleness, pcfg.group_size, pcfg.group_filter))
  worker = RolloutWorker(engine, task, tok, queue, pcfg)  # one worker: it owns verifier processes
  if extra:
    worker_state = dict(extra["worker"])
    if state is None:  # the in-flight samples are lost with the sampler: never trained
      for gid in extra["in_flight_groups"]:
        queue.discard_group(int(gid))
      # and their round with them (a new round starts), and every record of a sample in flight
      worker_state.update(round_open=0, truncated=[], outstanding=[], detached=[], in_transit=[])
    worker.load_state_dict(worker_state)
  trainer = Trainer(learner, queue, channel, pcfg)
  return Job(cfg=cfg, given_cfg=given, plan=placement.plan, run_dir=rd, tok=tok, task=task,
             model=model, learner=learner, channel=channel, engine=engine, queue=queue,
             worker=worker, trainer=trainer, timeline=timeline, sampler_clock=sampler_clock,
             vstate=vstate, clock=JobClock(reproducible, offset), start_step=learner.step,
             last_eval=extra.get("last_eval") if extra else None,
             cost_recorder=None if reproducible else costs_lib.CostRecorder(),
             eval_mesh=placement.eval_mesh, eval_params=placement.eval_params)
