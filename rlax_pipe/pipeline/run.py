"""The RL job: assembles task, tokenizer, meshes, learner, sampler, weight channel, queue and driver.

`run(RunConfig)` is the single library entry point of `experiments/pipeline_rl.py`. It writes a run
directory (`rlax_pipe.run_dir`), logs progress lines, evaluates held-out accuracy, checkpoints the
learner together with the pipeline state (task iterator, queue, staleness counters), and resumes
from the newest usable checkpoint with `resume=True`. Samples that were being generated when a run
died are counted as wasted on resume and never trained; queued samples are restored and trained
once.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from rlax_pipe import config as model_config
from rlax_pipe import evaluation
from rlax_pipe import objectives
from rlax_pipe import plots
from rlax_pipe import sharding as sharding_lib
from rlax_pipe import tasks
from rlax_pipe import timeline as timeline_lib
from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.learner import Learner, LearnerConfig
from rlax_pipe.learner.checkpoint import CheckpointError
from rlax_pipe.model import Model, ModelLike, Transformer, as_model, hf_io
from rlax_pipe.pipeline import driver as driver_lib
from rlax_pipe.pipeline.config import PipelineConfig
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.pipeline.rollout_worker import RolloutWorker, WorkerCounters
from rlax_pipe.pipeline.trainer import StepResult, Trainer
from rlax_pipe.pipeline.weight_channel import WeightChannel
from rlax_pipe.pipeline.rollout_queue import rollout_from_dict, rollout_to_dict
from rlax_pipe.run_dir import RunDir, to_jsonable
from rlax_pipe.sampler import SamplerConfig, SamplerEngine
from rlax_pipe.sampler import snapshot as engine_snapshot
from rlax_pipe import logprobs as logprobs_lib

BUILTIN_INIT = "builtin"


def builtin_warm_start_path() -> pathlib.Path:
  """The SFT warm start shipped with the package (written by experiments/sft.py)."""
  return pathlib.Path(__file__).resolve().parent.parent / "assets" / "sft_arithmetic"


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One RL run.

  Attributes:
    run_dir: output directory (created; reused with resume=True).
    init: initial policy: "builtin" (the shipped SFT warm start for the arithmetic task), or a
      directory with an HF-format checkpoint (config.json + *.safetensors).
    task: task name (see rlax_pipe.tasks.TASKS); jsonl_path for task "jsonl".
    jsonl_path: problems file of the JSONL task.
    task_config: the task's own config (e.g. `tasks.ArithmeticConfig`) or None for defaults.
    tokenizer_path: tokenizer file or HF directory (see `tokenizer.load_tokenizer`); None = the
      shipped tokenizer.
    num_sampler_devices: devices of the sampler mesh (>= 1).
    num_learner_devices: devices of the learner mesh (>= 1). With a single device in total both
      roles share it (set both to 1).
    sampler_mesh_axes: (axis, size) pairs of the sampler mesh ("data", "tp"); product =
      num_sampler_devices.
    learner: learner config; its mesh_axes' product must equal num_learner_devices;
      checkpoint_dir is set to run_dir/checkpoints.
    objective: objective config; its max_lag is set to the pipeline's staleness bound (the
      objective's hard lag mask is a second guard behind the queue).
    sampler: sampler config (slots, pages, sampling); its eos_id should be the tokenizer's.
    pipeline: driver, batch shape, staleness, evaluation and checkpoint cadence.
    eval_slots: decode slots of the held-out evaluation sampler.
    sampler_compute_dtype: activation/matmul dtype of the rollout sampler's forward pass
      ("float32", "bfloat16", "float16"), or None for the model's own `compute_dtype`. The learner
      and the held-out evaluation keep the model's dtype, so "bfloat16" reproduces the precision
      mismatch of a bf16 inference engine feeding an fp32 learner (Yao et al. 2025; ablation A9);
      weights still travel in the learner's param dtype. Set `sampler.cache_dtype` to match.
    resume: continue from the newest usable checkpoint in run_dir/checkpoints.
  """

  run_dir: str = "runs/pipeline_rl"
  init: str = BUILTIN_INIT
  task: str = "arithmetic"
  jsonl_path: str | None = None
  task_config: Any = None
  tokenizer_path: str | None = None
  num_sampler_devices: int = 4
  num_learner_devices: int = 4
  sampler_mesh_axes: tuple[tuple[str, int], ...] = (("tp", 4),)
  learner: LearnerConfig = LearnerConfig(mesh_axes=(("fsdp", 2), ("tp", 2)))
  objective: objectives.ObjectiveConfig = objectives.ObjectiveConfig()
  sampler: SamplerConfig = SamplerConfig()
  pipeline: PipelineConfig = PipelineConfig()
  eval_slots: int = 32
  sampler_compute_dtype: str | None = None
  resume: bool = False

  def __post_init__(self):
    if self.sampler_compute_dtype not in (None,) + model_config.DTYPES:
      raise ValueError(f"RunConfig.sampler_compute_dtype={self.sampler_compute_dtype!r}; use "
                       f"None or one of {model_config.DTYPES}.")
    if self.task == "jsonl" and self.task_config is None and not self.jsonl_path:
      raise ValueError("RunConfig: task 'jsonl' needs jsonl_path (--jsonl_path=problems.jsonl, "
                       'one {"prompt": ..., "answer": ...} object per line).')


def load_initial_params(init: str, param_dtype: str = "float32"):
  """(ModelConfig, host params) from "builtin" or an HF-format directory.

  Raises:
    FileNotFoundError: naming the path and how to create it.
  """
  path = builtin_warm_start_path() if init == BUILTIN_INIT else pathlib.Path(init)
  if not (path / "config.json").exists():
    hint = ("run `python experiments/sft.py --out_dir=rlax_pipe/assets/sft_arithmetic`"
            if init == BUILTIN_INIT else "pass a directory with config.json + *.safetensors")
    raise FileNotFoundError(f"no HF-format checkpoint at {path}: {hint}.")
  return hf_io.load_hf_checkpoint(path, param_dtype=param_dtype)


def _sampler_target(model: Model, mesh) -> Any:
  abstract = model.abstract_params()
  shardings = sharding_lib.logical_to_sharding(model.param_axes(), mesh,
                                               sharding_lib.SAMPLER_RULES, shapes=abstract)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      abstract, shardings)


def _lag_stats(lag_hist: np.ndarray) -> tuple[float, int]:
  counts = np.asarray(lag_hist, np.float64)
  total = counts.sum()
  if total == 0:
    return 0.0, 0
  lags = np.arange(counts.shape[0])
  return float((counts * lags).sum() / total), int(lags[counts > 0].max())


class _Job:
  """Holds the live components of one run and the per-step bookkeeping."""

  def __init__(self, cfg: RunConfig, model: ModelLike | None = None, params: Any = None):
    self.cfg = cfg
    pcfg = cfg.pipeline
    ckpts = pathlib.Path(cfg.run_dir) / "checkpoints"
    if not cfg.resume and ckpts.exists() and any(ckpts.iterdir()):
      raise FileExistsError(
          f"run dir {cfg.run_dir} already holds checkpoints of an earlier run: pass resume=True "
          "(--resume) to continue it, or choose a new run_dir (--run_dir).")
    self.rd = RunDir(cfg.run_dir)
    self.tok = tokenizer_lib.load_tokenizer(cfg.tokenizer_path)
    task_cfg = cfg.task_config
    if task_cfg is None and cfg.task == "jsonl":
      task_cfg = tasks.JsonlConfig(path=cfg.jsonl_path)
    self.task = tasks.make_task(cfg.task, task_cfg)
    split = sharding_lib.split_devices(jax.devices(), cfg.num_sampler_devices,
                                       cfg.num_learner_devices)
    learner_mesh = sharding_lib.make_mesh(split.learner, dict(cfg.learner.mesh_axes),
                                          sharding_lib.LEARNER_RULES)
    sampler_mesh = sharding_lib.make_mesh(split.sampler, dict(cfg.sampler_mesh_axes),
                                          sharding_lib.SAMPLER_RULES)
    if model is None:
      model_cfg, params0 = load_initial_params(cfg.init)
      self.model = Transformer(model_cfg)
    else:
      self.model, params0 = as_model(model), params
    learner_cfg = dataclasses.replace(cfg.learner, checkpoint_dir=self.rd.checkpoint_dir)
    objective_cfg = dataclasses.replace(cfg.objective, max_lag=pcfg.staleness.max_lag)
    self.sampler_model = self.model
    if cfg.sampler_compute_dtype is not None:
      if not hasattr(self.model, "with_compute_dtype"):
        raise ValueError(f"RunConfig.sampler_compute_dtype={cfg.sampler_compute_dtype!r} needs a "
                         "model with with_compute_dtype() (the built-in Transformer); this "
                         f"{type(self.model).__name__} sets its own dtypes.")
      self.sampler_model = self.model.with_compute_dtype(cfg.sampler_compute_dtype)
    if self.sampler_model != self.model:
      logging.info("sampler computes in %s, learner in %s (precision mismatch on purpose).",
                   cfg.sampler_compute_dtype, self.model.compute_dtype)
    self.learner = Learner(self.model, learner_cfg, objective_cfg, cfg.sampler.sampling,
                           mesh=learner_mesh, params=params0)
    extra = self._maybe_restore()
    self.start_step = self.learner.step
    self.time_offset = float(extra.get("time_s", 0.0)) if extra else 0.0

    self.reproducible = pcfg.mode == "reproducible"
    snap = self._load_sampler_state() if (extra and self.reproducible) else None
    self.vstate = driver_lib.VirtualState(t_s=self.time_offset, t_l=self.time_offset)
    if snap is not None:
      self.vstate = snap["vstate"]
    self.sampler_clock = (timeline_lib.VirtualClock(self.vstate.t_s) if self.reproducible
                          else None)
    self.timeline = timeline_lib.Timeline(
        clock=self.sampler_clock if self.reproducible else time.perf_counter)
    verify = self._verify_push if pcfg.debug_verify_push else None
    target = _sampler_target(self.model, sampler_mesh)
    self.channel = WeightChannel(target, verify=verify, debug=pcfg.debug_verify_push)
    on_span = None if self.reproducible else self.timeline.record
    clock = self.sampler_clock or time.perf_counter
    if snap is None:
      self.channel.push(self.learner.params, self.learner.version)
      w = self.channel.take(timeout=pcfg.wait_timeout_s)
      self.engine = SamplerEngine(self.sampler_model, cfg.sampler, w.params, version=w.version,
                                  mesh=sampler_mesh, clock=clock, on_span=on_span)
    else:  # exact resume: the sampler exactly as it was at the checkpoint
      leaves, treedef = jax.tree.flatten(target)
      params = jax.tree.unflatten(treedef, [
          jax.device_put(snap["arrays"][f"params{i}"], t.sharding) for i, t in enumerate(leaves)])
      self.engine = SamplerEngine(self.sampler_model, cfg.sampler, params,
                                  version=snap["state"]["version"], mesh=sampler_mesh,
                                  clock=clock, on_span=on_span)
      engine_snapshot.restore(self.engine, snap["state"], snap["arrays"])
      self.channel.push(self.learner.params, self.learner.version)  # pending, as it was
      for sp in snap["spans"]:
        self.timeline.record(sp.component, sp.kind, sp.start, sp.end, sp.slots_active,
                             sp.slots_total)
    if extra:
      self.queue = RolloutQueue.from_state_dict(extra["queue"], pcfg.staleness)
      if snap is None:
        for gid in extra["in_flight_groups"]:
          self.queue.discard_group(int(gid))  # lost with the sampler; never trained
      counters = WorkerCounters(**extra["worker"])
    else:
      self.queue, counters = RolloutQueue(pcfg.staleness, pcfg.group_size), None
    self.worker = RolloutWorker(self.engine, self.task, self.tok, self.queue, pcfg, counters)
    if snap is not None:
      self.worker.weights_version = snap["state"]["worker_weights_version"]
      self.worker._round_open = snap["state"]["worker_round_open"]  # pylint: disable=protected-access
    self.trainer = Trainer(self.learner, self.queue, self.channel, pcfg)
    eval_cfg = dataclasses.replace(
        cfg.sampler, num_slots=cfg.eval_slots,
        num_pages=cfg.eval_slots * cfg.sampler.pages_per_seq,
        sampling=logprobs_lib.SamplingConfig(greedy=True),
        **({} if cfg.sampler_compute_dtype is None  # evaluate at the learner's precision
           else {"cache_dtype": self.model.compute_dtype}))
    self.eval_engine = SamplerEngine(self.model, eval_cfg, self.learner.params,
                                     version=self.learner.version, mesh=learner_mesh)
    self.eval_set = evaluation.eval_problems(self.task, pcfg.eval_problems)
    self.eval_seconds = 0.0
    self.t_wall0 = time.perf_counter()
    self.steps_this_session = 0
    self.last_eval: float | None = extra.get("last_eval") if extra else None
    self.rd.write_config(cfg)

  # ---- checkpoints ----------------------------------------------------------------------------
  def _maybe_restore(self) -> dict | None:
    if not self.cfg.resume:
      return None
    try:
      extra = self.learner.restore()
    except CheckpointError as e:
      logging.warning("resume requested but no usable checkpoint (%s); starting fresh.", e)
      return None
    self.rd.truncate_metrics(self.learner.step)
    logging.info("resumed at learner step %d (version %d).", self.learner.step,
                 self.learner.version)
    return extra

  def save(self, time_s: float) -> None:
    queue_state = self.queue.state_dict()
    queued = {r["group_id"] for g in queue_state["ready"] for r in g["rollouts"]}
    live = [g for g, _ in queue_state["admission"]["live"]] if queue_state.get("admission") else []
    extra = {"worker": self.worker.state_dict(), "queue": queue_state,
             "in_flight_groups": [int(g) for g in live if g not in queued],
             "time_s": time_s, "last_eval": self.last_eval}
    step = self.learner.save(to_jsonable(extra))
    if self.reproducible:
      self._save_sampler_state(step)

  # The sampler side of a reproducible run is checkpointed too, so a resume continues exactly
  # as the uninterrupted run would have (threaded runs resume without their in-flight samples).
  def _sampler_dir(self, step: int) -> pathlib.Path:
    return self.rd.path / "sampler_state" / str(step)

  def _save_sampler_state(self, step: int) -> None:
    state, arrays = engine_snapshot.snapshot(self.engine)
    v = self.vstate
    state.update(
        worker_weights_version=self.worker.weights_version,
        worker_round_open=self.worker._round_open,  # pylint: disable=protected-access
        vstate={"t_s": v.t_s, "t_l": v.t_l, "next_seq": v.next_seq,
                "pending_arrival": v.pending_arrival, "learner_must_act": v.learner_must_act,
                "transit": [[t, n, rollout_to_dict(r)] for t, n, r in v.transit]})
    final = self._sampler_dir(step)
    tmp = final.with_name(final.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    np.savez(tmp / "arrays.npz", **arrays)
    self.timeline.to_jsonl(str(tmp / "timeline.jsonl"))
    (tmp / "state.json").write_text(json.dumps(to_jsonable(state)))
    if final.exists():
      shutil.rmtree(final)
    tmp.rename(final)  # complete or absent, never half-written
    keep = self.cfg.learner.keep_checkpoints
    steps = sorted(int(p.name) for p in final.parent.iterdir() if p.name.isdigit())
    for old in steps[:-keep]:
      shutil.rmtree(self._sampler_dir(old), ignore_errors=True)

  def _load_sampler_state(self) -> dict | None:
    d = self._sampler_dir(self.learner.step)
    if not (d / "state.json").exists():
      logging.warning("no sampler state for checkpoint step %d in %s: resuming without the "
                      "in-flight samples (the continuation will differ from an uninterrupted "
                      "run).", self.learner.step, d.parent)
      return None
    state = json.loads((d / "state.json").read_text())
    with np.load(d / "arrays.npz") as z:
      arrays = {k: z[k] for k in z.files}
    v = state["vstate"]
    vstate = driver_lib.VirtualState(
        t_s=v["t_s"], t_l=v["t_l"], next_seq=v["next_seq"], pending_arrival=v["pending_arrival"],
        learner_must_act=v["learner_must_act"],
        transit=[(t, n, rollout_from_dict(r)) for t, n, r in v["transit"]])
    spans = timeline_lib.Timeline.from_jsonl(str(d / "timeline.jsonl")).spans()
    logging.info("exact resume: sampler state of step %d restored from %s.", self.learner.step, d)
    return {"state": state, "arrays": arrays, "vstate": vstate, "spans": spans}

  # ---- evaluation / logging -------------------------------------------------------------------
  def _verify_push(self, sampler_params, version: int) -> None:
    """Debug check: sampler-side and learner-side log-probs of a probe sequence agree."""
    probe = np.asarray(self.tok.encode_prompt("Q: 1+2+3\n1+2=3\n3+3=6\nA: 6"), np.int32)[None]
    pos = np.arange(probe.shape[1], dtype=np.int32)[None]
    ls, _ = self.model.forward(sampler_params, probe, pos)
    ll, _ = self.model.forward(self.learner.params, probe, pos)
    diff = float(np.max(np.abs(np.asarray(ls) - np.asarray(ll))))
    if not diff < 1e-3:
      raise RuntimeError(f"weight push of version {version} did not apply: sampler and learner "
                         f"logits differ by {diff:.3g} on the probe sequence.")

  def evaluate(self, step: int, time_s: float) -> float:
    t0 = time.perf_counter()
    if self.learner.version != self.eval_engine.version:
      self.eval_engine.update_weights(self.learner.params, self.learner.version)
    res = evaluation.evaluate(self.eval_engine, self.task, self.tok, self.eval_set,
                              verifier=self.worker.verifier, grading=self.cfg.pipeline.grading)
    self.eval_seconds += time.perf_counter() - t0
    self.last_eval = res.accuracy
    self.rd.log({"kind": "eval", "step": step, "version": self.learner.version,
                 "time_s": time_s, "heldout_accuracy": res.accuracy,
                 "wall_s": time.perf_counter() - self.t_wall0 - self.eval_seconds,
                 "mean_completion_tokens": res.mean_completion_tokens,
                 "eval_filtered_overlong": res.num_filtered,
                 "eval_failed_rewards": res.num_failed_rewards}, step)
    logging.info("eval step %d: held-out accuracy %.3f (%d problems)", step, res.accuracy,
                 res.num_problems)
    return res.accuracy

  def on_step(self, result: StepResult, now: float) -> None:
    pcfg = self.cfg.pipeline
    step = self.learner.step
    self.steps_this_session += 1
    m = result.metrics
    time_s = now if self.reproducible else self.time_offset + (now - self.t_wall0 -
                                                               self.eval_seconds)
    lag_mean, lag_max = _lag_stats(m["lag_hist"])
    versions = np.concatenate([r.policy_versions for r in result.rollouts])
    summary = timeline_lib.summarize(self.timeline.spans())
    wall = time.perf_counter() - self.t_wall0 - self.eval_seconds  # as in eval rows
    remaining = self.cfg.pipeline.num_steps - step
    row = {
        "kind": "train", "step": step, "version": result.version, "time_s": time_s,
        "wall_s": wall, "reward_mean": result.reward_mean, "samples": len(result.rollouts),
        "completion_tokens": result.completion_tokens,
        "tokens_per_s": self.queue.stats().trained_tokens / max(time_s, 1e-9),
        "lag_mean": lag_mean, "lag_max": lag_max,
        "token_lag_max_at_train": int(result.version - 1 - versions.min()) if versions.size else 0,
        "sampler_version": self.worker.weights_version,
        "idle_sampler": summary.idle.get("sampler", float("nan")),
        "idle_learner": summary.idle.get("learner", float("nan")),
        "slot_occupancy": summary.slot_occupancy,
        "wasted_tokens": self.queue.stats().waste.wasted_tokens,
        "eta_s": wall / max(self.steps_this_session, 1) * remaining,
    }
    for k in ("loss", "ess", "ratio_mean", "ratio_var", "ratio_min", "ratio_max", "kl_k3",
              "entropy", "frac_truncated", "frac_masked", "grad_norm", "learning_rate",
              "logp_mismatch_mean", "logp_mismatch_max", "is_finite"):
      if k in m:
        row[k] = np.asarray(m[k]).item()
    row.update(result.sample_metrics)    # length-cut share, unrewarded samples (grading)
    row.update(self.worker.pop_metrics())  # filtered_overlong, reward outcomes of this step
    row["lag_hist"] = np.asarray(m["lag_hist"]).tolist()
    row["completion_lengths"] = [r.num_completion_tokens for r in result.rollouts]
    self.rd.log(row, step)
    logging.info(
        "step %d/%d  v%d  reward %.3f  held-out %s  lag mean %.2f max %d  ESS %.3f  "
        "tokens/s %.0f  ETA %.0fs", step, pcfg.num_steps, result.version, result.reward_mean,
        "n/a" if self.last_eval is None else f"{self.last_eval:.3f}", lag_mean, lag_max,
        row.get("ess", float("nan")), row["tokens_per_s"], row["eta_s"])
    if step % pcfg.eval_every == 0 and step < pcfg.num_steps:
      self.evaluate(step, time_s)
    if step % pcfg.checkpoint_every == 0:
      self.save(time_s)

  def finish(self, end_time: float) -> dict:
    pcfg = self.cfg.pipeline
    step = self.learner.step
    time_s = end_time if self.reproducible else self.time_offset + (
        end_time - self.t_wall0 - self.eval_seconds)
    final_acc = self.evaluate(step, time_s)
    self.save(time_s)
    self.learner.close()
    self.worker.close()
    rows = self.rd.read_metrics()
    evals = [r for r in rows if r["kind"] == "eval"]
    spans = self.timeline.spans()
    self.timeline.to_jsonl(str(self.rd.path / "timeline.jsonl"))
    summary = timeline_lib.summarize(spans) if spans else None
    if spans:
      timeline_lib.plot_gantt(spans, str(self.rd.path / "gantt.png"),
                              title=f"{pcfg.driver} ({pcfg.mode})")
    plots.plot_reward_accuracy(rows, str(self.rd.path / "reward_accuracy.png"))
    plots.plot_lag_hist(rows, str(self.rd.path / "lag_hist.png"))
    plots.plot_idle(rows, str(self.rd.path / "idle.png"))
    self.rd.close()
    out = {
        "run_dir": str(self.rd.path), "driver": pcfg.driver, "mode": pcfg.mode,
        "steps": step, "time_s": time_s, "wall_s": time.perf_counter() - self.t_wall0,
        "initial_heldout_accuracy": evals[0]["heldout_accuracy"] if evals else None,
        "final_heldout_accuracy": final_acc,
        "idle_fraction": summary.idle if summary else {},
        "slot_occupancy": summary.slot_occupancy if summary else None,
        "reward_outcomes": self.worker.reward_stats.snapshot(),
        "wasted_tokens": self.queue.stats().waste.wasted_tokens,
    }
    out = to_jsonable(out)
    (self.rd.path / "summary.json").write_text(json.dumps(out, indent=2))
    return out


def run(cfg: RunConfig, *, model: ModelLike | None = None, params: Any = None) -> dict:
  """Runs (or resumes) one RL job; returns the summary also written to run_dir/summary.json.

  Args:
    cfg: the run.
    model: the policy's model (`rlax_pipe.model.Model`, e.g. an `NnxModel`); None = the built-in
      transformer loaded from `cfg.init`.
    params: initial params of `model` (any placement); None = a random init from
      `cfg.learner.seed`. Ignored when `model` is None.

  Raises:
    Whatever a component raised; before re-raising, the learner state and the pipeline state are
    checkpointed (so `resume=True` continues from there).
  """
  job = _Job(cfg, model, params)
  pcfg = cfg.pipeline
  if job.last_eval is None:
    job.evaluate(job.start_step, job.time_offset)
  todo = pcfg.num_steps - job.start_step
  if todo > 0:
    try:
      if job.reproducible:
        end = driver_lib.run_reproducible(job.worker, job.trainer, job.channel, pcfg,
                                          job.timeline, todo, job.on_step,
                                          start_time=job.time_offset,
                                          sampler_clock=job.sampler_clock, state=job.vstate)
      else:
        end = driver_lib.run_threaded(job.worker, job.trainer, job.channel, pcfg, job.timeline,
                                      todo, job.on_step)
    except BaseException:
      logging.error("run stopped by an error at learner step %d; checkpointing before re-raising.",
                    job.learner.step)
      try:
        job.save(job.vstate.t_l if job.reproducible else job.time_offset)
        job.learner.close()
        job.worker.close()
      except Exception as e:  # pylint: disable=broad-except
        logging.error("checkpoint after the error failed too: %s", e)
      raise
  else:
    end = job.time_offset if job.reproducible else time.perf_counter()
  return job.finish(end)
