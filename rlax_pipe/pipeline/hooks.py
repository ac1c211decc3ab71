"""Step hooks of the RL job (`StepHook`); `run.run_job` says which run, in what order."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Protocol

from absl import logging
import jax
import numpy as np

from rlax_pipe import costs as costs_lib
from rlax_pipe import envs
from rlax_pipe import evaluation
from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe import model_dir
from rlax_pipe import plots
from rlax_pipe import timeline as timeline_lib
from rlax_pipe.model import Transformer, lora_hf, save_peft_adapter
from rlax_pipe.pipeline import group_filter
from rlax_pipe.pipeline.job import Job
from rlax_pipe.pipeline import rules
from rlax_pipe.pipeline.trainer import StepResult
from rlax_pipe.run_dir import to_jsonable
from rlax_pipe.sampler import SamplerEngine
from rlax_pipe.types import WeightUpdate

# Learner metrics copied into each train row when present (kl_ref: only with objective.kl on;
# moe_*: only for MoE models).
ROW_METRICS = ("loss", "ess", "ratio_mean", "ratio_var", "ratio_min", "ratio_max", "kl_k3",
               "entropy", "frac_truncated", "frac_masked", "grad_norm", "learning_rate",
               "logp_mismatch_mean", "logp_mismatch_max", "is_finite", "kl_ref",
               "moe_load_balance_loss", "moe_z_loss")


class StepHook(Protocol):
  """Something the job runs after every learner step and once at the end; a subclass inherits a
  no-op for the one it does not need."""

  def on_step(self, job: Job, result: StepResult, time_s: float) -> None:
    """After learner step `job.learner.step`; `time_s` is the run time (seconds)."""

  def on_end(self, job: Job, time_s: float) -> None:
    """After the last step (also on a run with no step left to do)."""


def lag_stats(lag_hist: np.ndarray) -> tuple[float, int]:
  """(mean, max) token lag of a lag histogram (bin i = lag i)."""
  counts = np.asarray(lag_hist, np.float64)
  if counts.sum() == 0:
    return 0.0, 0
  return (float(np.average(np.arange(counts.shape[0]), weights=counts)),
          int(np.flatnonzero(counts)[-1]))


def sample_lag_stats(result: StepResult) -> tuple[float, int]:
  """(mean, max) per-sample staleness of a step's trained samples: the lag of each sample's
  oldest token, v - min(policy_versions), at the version v the batch was trained at
  (Applied Compute's definition; DESIGN.md "Staleness"). Samples without a reward (not trained)
  and without tokens are left out; (0.0, 0) when none is left."""
  v = result.trained_at
  lags = [rules.sample_lag(r.policy_versions, v) for r in result.rollouts
          if r.policy_versions.size and not np.isnan(r.reward)]
  return (float(np.mean(lags)), int(max(lags))) if lags else (0.0, 0)


def sampler_idle(idle: dict[str, float]) -> float:
  """Idle fraction of the sampler: its lane, or the mean over the replicas' lanes ("sampler/r"
  in a multi-process job); NaN without any."""
  if "sampler" in idle:
    return idle["sampler"]
  lanes = [v for k, v in idle.items() if k.startswith("sampler/")]
  return float(np.mean(lanes)) if lanes else float("nan")


def clock_name(job: Job) -> str:
  """"virtual" (reproducible mode: modelled durations) or "measured" (threaded: wall clock)."""
  return "virtual" if job.reproducible else "measured"


def clock_rows(job: Job, time_s: float, trained_tokens: int | None = None) -> dict:
  """The run-time fields of a metrics row, labelled with the clock they come from.

  `time_s` (and `tokens_per_s`) keep their names for readers of earlier runs; `clock` says which
  clock they are on, and `virtual_time_s` / `measured_time_s` (and `*_tokens_per_s`) repeat them
  under a name that says it.
  """
  name = clock_name(job)
  out = {"clock": name, "time_s": time_s, f"{name}_time_s": time_s}
  if trained_tokens is not None:
    rate = trained_tokens / max(time_s, 1e-9)
    out.update({"tokens_per_s": rate, f"{name}_tokens_per_s": rate})
  return out


class Eta:
  """Measured wall-clock time left: the median duration of this session's learner steps after
  its first (which includes compilation) times the steps left, plus the evaluations left at the
  duration of the latest one. None until two steps of this session were timed.

  The median, not the mean: a step that compiles a new batch shape takes 5-10x a typical one
  (README command 1 on 2 loaded CPU cores: 27.5 s among 1.2-3.4 s steps), and one such step
  early in a run made a mean-based ETA 2.5x too long (notes_ux.md, "ETA").
  """

  def __init__(self):
    self.last_wall: float | None = None
    self.durations: list[float] = []
    self.eval_s: float | None = None

  def step(self, wall_s: float) -> None:
    if self.last_wall is not None:
      self.durations.append(wall_s - self.last_wall)
    self.last_wall = wall_s

  def seconds_left(self, steps_left: int, evals_left: int) -> float | None:
    if not self.durations:
      return None
    per_step = float(np.median(self.durations))
    return per_step * steps_left + (self.eval_s or 0.0) * evals_left


def _evals_left(step: int, num_steps: int, every: int) -> int:
  """Held-out evaluations still to run after learner step `step` (periodic + final)."""
  return len([s for s in range(step + 1, num_steps) if s % every == 0]) + 1


def signal_group_fraction(result: StepResult) -> float:
  """Share of the step's prompt groups whose valid rewards differ: the only groups a
  group-relative advantage is non-zero for (a group of equal rewards teaches nothing). NaN
  without groups."""
  groups: dict[int, list[float]] = {}
  for r in result.rollouts:
    if not np.isnan(r.reward):
      groups.setdefault(r.group_id, []).append(r.reward)
  if not groups:
    return float("nan")
  return float(np.mean([group_filter.has_signal(v) for v in groups.values()]))


NO_SIGNAL_WARN_STEPS = 5  # see `TrainLog`


class TrainLog(StepHook):
  """One metrics row per learner step (metrics.jsonl, TensorBoard) and a progress line; a
  warning when `NO_SIGNAL_WARN_STEPS` steps in a row had no learning signal (every group's
  rewards equal, so every advantage was 0)."""

  def __init__(self, eta: Eta | None = None):
    self.eta = eta or Eta()
    self.no_signal_steps = 0

  def _check_signal(self, step: int, frac: float) -> None:
    self.no_signal_steps = self.no_signal_steps + 1 if frac == 0.0 else 0
    if self.no_signal_steps == NO_SIGNAL_WARN_STEPS:
      logging.warning(
          "steps %d-%d learned nothing: in every prompt group all samples got the same reward, "
          "so every group-relative advantage was 0. The task may be too hard or too easy for "
          "the policy (batch reward near 0 or 1), or sampling too deterministic "
          "(sampler.sampling.temperature).", step - NO_SIGNAL_WARN_STEPS + 1, step)

  def on_step(self, job: Job, result: StepResult, time_s: float) -> None:
    step, m, pcfg = job.learner.step, result.metrics, job.cfg.pipeline
    lag_mean, lag_max = lag_stats(m["lag_hist"])
    sample_lags = sample_lag_stats(result)
    versions = np.concatenate([r.policy_versions for r in result.rollouts]) if result.rollouts \
        else np.zeros(0, np.int32)
    summary = job.timeline.summary()  # running totals: O(1) per step, not O(spans)
    wall = job.clock.wall_s()
    self.eta.step(wall)
    eta = self.eta.seconds_left(pcfg.num_steps - step,
                                _evals_left(step, pcfg.num_steps, pcfg.eval_every))
    stats = job.queue.stats()
    row = {
        "kind": "train", "step": step, "version": result.produced,
        **clock_rows(job, time_s, stats.trained_tokens),
        "wall_s": wall, "reward_mean": result.reward_mean, "samples": len(result.rollouts),
        "completion_tokens": result.completion_tokens,  # the model's tokens
        "token_lag_mean": lag_mean, "token_lag_max": lag_max,
        "sample_lag_mean": sample_lags[0], "sample_lag_max": sample_lags[1],
        "token_lag_max_at_train": int(result.trained_at - versions.min()) if versions.size else 0,
        "sampler_version": job.worker.engine.latest_version,
        "push_bytes": result.push_bytes,  # one version's weights (LoRA: the adapters only)
        "idle_sampler": sampler_idle(summary.idle),
        "idle_learner": summary.idle.get("learner", float("nan")),
        "slot_occupancy": summary.slot_occupancy,
        "wasted_tokens": stats.waste.wasted_tokens,
        "rejected_samples": stats.rejected_samples,  # duplicates / foreign samples, whole run
        "lost_groups": stats.waste.lost_groups,
        "eta_s": eta,
    }
    if pcfg.group_filter.active:  # dynamic sampling, cumulative over the run, not per step
      row.update({name: getattr(stats.waste, name) for name in
                  ("filtered_groups", "filtered_samples", "filtered_tokens")},
                 filter_kept_groups=stats.filter_kept_groups)
    row.update({k: np.asarray(m[k]).item() for k in ROW_METRICS if k in m})
    row["signal_group_frac"] = signal_group_fraction(result)
    self._check_signal(step, row["signal_group_frac"])
    row.update(result.sample_metrics)    # length-cut share, unrewarded samples (grading)
    row.update(job.worker.pop_metrics())  # filtered_overlong, reward outcomes of this step
    if isinstance(job.engine, envs.EpisodeEngine):  # turns, tool calls, outcomes (run totals)
      row["env_tokens"] = result.env_tokens  # environment tokens (tool results) of this step
      row.update(job.engine.episode_metrics())
    row["lag_hist"] = np.asarray(m["lag_hist"]).tolist()
    row["completion_lengths"] = [r.num_completion_tokens for r in result.rollouts]
    row["prompt_lengths"] = [int(r.prompt_tokens.shape[0]) for r in result.rollouts]
    job.run_dir.log(row, step)
    logging.info("%s", progress_line(job, row))


def _duration(seconds: float | None) -> str:
  if seconds is None:
    return "--"
  seconds = int(round(seconds))
  return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def progress_line(job: Job, row: dict) -> str:
  """The progress line of a train row: step, reward, held-out accuracy, lag, ESS, the run time
  and throughput on their clock, measured wall time and ETA."""
  name, num_steps = row["clock"], job.cfg.pipeline.num_steps
  held = "n/a" if job.last_eval is None else f"{job.last_eval:.3f}"
  pct = 100.0 * row["step"] / num_steps
  clock = (f"virtual t {row['time_s']:.2f}s, {row['tokens_per_s']:.0f} tok/s (modelled)"
           if name == "virtual" else f"{row['tokens_per_s']:.0f} tok/s (measured)")
  eta = ("ETA -- (after step 2; step 1 includes compiles)" if row["eta_s"] is None
         else f"ETA {_duration(row['eta_s'])}")
  return (f"step {row['step']}/{num_steps} ({pct:.0f}%)  v{row['version']}  reward "
          f"{row['reward_mean']:.3f}  held-out {held}  token lag mean {row['token_lag_mean']:.2f} max "
          f"{row['token_lag_max']}  ESS {row.get('ess', float('nan')):.3f}  |  {clock}  |  measured "
          f"{_duration(row['wall_s'])} elapsed, {eta}")


class Evaluation(StepHook):
  """Held-out greedy accuracy with an engine on the learner mesh, every `eval_every` steps
  (not at the last step) and once at the end; its wall time is excluded from the run time.
  With `PipelineConfig.eval_samples` = n > 0 a second engine (the sampler's `SamplingConfig`,
  e.g. its temperature) also draws n samples per problem: mean@n and pass@k join the row."""

  def __init__(self, job: Job, eta: Eta | None = None):
    self.eta = eta
    cfg = job.cfg
    eval_cfg = dataclasses.replace(
        cfg.sampler, num_slots=cfg.eval_slots,
        num_pages=cfg.eval_slots * cfg.sampler.pages_per_seq,
        sampling=logprobs_lib.SamplingConfig(greedy=True),
        **({} if cfg.sampler_compute_dtype is None  # evaluate at the learner's precision
           else {"cache_dtype": job.model.compute_dtype}))
    self.episodes = envs.is_environment(job.task)
    self.engine = self._engine(job, eval_cfg)
    self.sampled_engine = (
        self._engine(job, dataclasses.replace(eval_cfg, sampling=cfg.sampler.sampling))
        if cfg.pipeline.eval_samples else None)
    self.problems = evaluation.eval_problems(job.task, cfg.pipeline.eval_problems)
    self.final_accuracy: float | None = None

  def _engine(self, job: Job, sampler_cfg) -> SamplerEngine:
    """An engine of `sampler_cfg` on the evaluation mesh holding the newest policy; for an
    environment task one that runs episodes with its tools (`envs.evaluation_engine`)."""
    engine = SamplerEngine(job.model, sampler_cfg, policy_update(job),
                           mesh=job.eval_mesh or job.learner.mesh)
    if not self.episodes:
      return engine
    return envs.evaluation_engine(engine, job.task, job.tok, job.cfg.env,
                                  chat=job.cfg.prompt_format.kind == "chat")

  def _sampled_row(self, job: Job) -> dict:
    """mean@n and pass@k of n samples per problem ({} when eval_samples is 0)."""
    if self.sampled_engine is None:
      return {}
    if job.learner.version != self.sampled_engine.version:
      self.sampled_engine.update_weights(policy_update(job))
    pcfg = job.cfg.pipeline
    res = evaluation.evaluate_samples(
        self.sampled_engine, job.task, job.tok, self.problems, pcfg.eval_samples, pcfg.pass_ks,
        verifier=job.worker.verifier, grading=pcfg.grading)
    logging.info("eval: mean@%d %.3f, %s", res.num_samples, res.mean_at_n, ", ".join(
        f"pass@{k} {v:.3f}" for k, v in res.pass_at_k.items()))
    return {"eval_samples": res.num_samples, f"heldout_mean_at_{res.num_samples}": res.mean_at_n,
            **{f"heldout_pass_at_{k}": v for k, v in res.pass_at_k.items()},
            "eval_sampled_completion_tokens": res.mean_completion_tokens}

  def evaluate(self, job: Job, step: int, time_s: float) -> float:
    """Evaluates the learner's current params; logs an eval row; returns the accuracy."""
    t0 = time.perf_counter()
    if job.learner.version != self.engine.version:  # the learner keeps its params
      self.engine.update_weights(policy_update(job))
    res = evaluation.evaluate(self.engine, job.task, job.tok, self.problems,
                              verifier=job.worker.verifier, grading=job.cfg.pipeline.grading)
    sampled = self._sampled_row(job)
    seconds = time.perf_counter() - t0
    job.clock.excluded += seconds
    if self.eta is not None:
      self.eta.eval_s = seconds
    job.last_eval = res.accuracy
    # episodes: tool use of this pass; per difficulty the problems, accuracy and tool-use share
    episode_row = {"eval_mean_turns": res.mean_turns, "eval_tool_calls": res.tool_calls,
                   "eval_tool_failures": res.tool_failures,
                   "heldout_count_by_difficulty": res.count_by_difficulty,
                   "heldout_accuracy_by_difficulty": res.accuracy_by_difficulty,
                   "heldout_tool_use_by_difficulty": res.tool_use_by_difficulty}
    job.run_dir.log({"kind": "eval", "step": step, "version": job.learner.version,
                     **clock_rows(job, time_s), "heldout_accuracy": res.accuracy,
                     "wall_s": job.clock.wall_s(), "eval_wall_s": seconds,
                     "mean_completion_tokens": res.mean_completion_tokens,
                     "eval_filtered_overlong": res.num_filtered,
                     "eval_failed_rewards": res.num_failed_rewards,
                     **(episode_row if self.episodes else {}), **sampled}, step)
    logging.info("eval step %d: held-out accuracy %.3f (%d problems, measured %.1fs)", step,
                 res.accuracy, res.num_problems, seconds)
    return res.accuracy

  def close(self) -> None:
    """Ends the tool workers of episode evaluation engines (nothing to do otherwise)."""
    for engine in (self.engine, self.sampled_engine):
      if isinstance(engine, envs.EpisodeEngine):
        engine.close()

  def on_step(self, job: Job, result: StepResult, time_s: float) -> None:
    del result
    step, pcfg = job.learner.step, job.cfg.pipeline
    if step % pcfg.eval_every == 0 and step < pcfg.num_steps:
      self.evaluate(job, step, time_s)

  def on_end(self, job: Job, time_s: float) -> None:
    self.final_accuracy = self.evaluate(job, job.learner.step, time_s)
    self.close()


def policy_update(job: Job) -> WeightUpdate:
  """The newest policy for evaluation and export: the job's `eval_params` (a multi-process
  lead's own copy, which the receiving engine owns and frees: `donated`), else the learner's
  params (LoRA merged into the base; the learner keeps them)."""
  if job.eval_params is not None:
    return WeightUpdate(*job.eval_params(), donated=True)
  return WeightUpdate(job.learner.version, job.learner.merged_params(), donated=False)


class Checkpoint(StepHook):
  """Checkpoints every `checkpoint_every` steps and at the end (then waits for the writes)."""

  def on_step(self, job: Job, result: StepResult, time_s: float) -> None:
    del result
    if job.learner.step % job.cfg.pipeline.checkpoint_every == 0:
      job.save(time_s)

  def on_end(self, job: Job, time_s: float) -> None:
    job.save(time_s)
    job.learner.close()
    job.worker.close()


def save_cost_fit(job: Job) -> None:
  """Threaded runs: writes the timed operations (cost_records.jsonl) and the cost model fitted
  to them with confidence intervals (cost_fit.json, `costs.fit_cost_model`) into the run
  directory (nothing without records)."""
  rec = job.cost_recorder
  if rec is None or not rec.records():
    return
  rd = job.run_dir.path
  rec.to_jsonl(rd / "cost_records.jsonl")
  pcfg = job.cfg.pipeline
  fit = costs_lib.fit_cost_model(
      rec.records(), source=(f"measured: threaded {pcfg.driver} run {rd}, "
                             f"{job.cfg.num_sampler_devices} sampler + "
                             f"{job.cfg.num_learner_devices} learner devices "
                             f"({jax.devices()[0].device_kind})"))
  fit.save(rd / "cost_fit.json")


class Export(StepHook):
  """At the end: the trained policy as an HF model directory run_dir/hf/ (`RunConfig.export_hf`;
  built-in model family only), with the run's tokenizer and generation config. With LoRA, hf/
  holds the merged weights and run_dir/hf_lora/ the adapters as a PEFT adapter directory."""

  def on_end(self, job: Job, time_s: float) -> None:
    del time_s
    if not job.cfg.export_hf:
      return
    if not isinstance(job.model, Transformer):
      logging.warning("export_hf: %s has no HF format; nothing exported.",
                      type(job.model).__name__)
      return
    path = job.run_dir.path / "hf"
    model_dir.export_model_dir(path, jax.device_get(policy_update(job).params), job.model.cfg,
                               job.tok)
    logging.info("trained policy exported as an HF model directory: %s", path)
    lora = getattr(job.learner, "lora", None)
    if lora is not None:  # the adapters alone too, loadable by peft on top of the base
      adapter_path = job.run_dir.path / "hf_lora"
      # A target PEFT cannot express (e.g. the embedding): merged only (warned at startup too,
      # by `job.check_job_settings`).
      problem = lora_hf.peft_export_problem(lora)
      if problem is not None:
        logging.warning("export_hf: no PEFT adapter directory (%s); the merged policy is in %s.",
                        problem, path)
        return
      save_peft_adapter(adapter_path, jax.device_get(job.learner.params), lora,
                        base_model_name_or_path=str(job.cfg.init))
      logging.info("LoRA adapters exported as a PEFT adapter directory: %s (merged policy in "
                   "%s)", adapter_path, path)


class Report(StepHook):
  """At the end: timeline.jsonl, Gantt chart and plots, the cost records and the fitted cost
  model of a threaded run, and the run summary (summary.json)."""

  def __init__(self, evaluation_hook: Evaluation):
    self._eval = evaluation_hook
    self.summary: dict | None = None

  def on_end(self, job: Job, time_s: float) -> None:
    pcfg, rd = job.cfg.pipeline, job.run_dir
    rows = rd.read_metrics()
    evals = [r for r in rows if r["kind"] == "eval"]
    spans = job.timeline.spans()
    job.timeline.flush()  # timeline.jsonl: the spans not yet appended
    summary = job.timeline.summary() if spans else None
    if spans:
      timeline_lib.plot_gantt(spans, str(rd.path / "gantt.png"),
                              title=f"Timeline of the meshes: {pcfg.driver} driver ({pcfg.mode})",
                              xlabel=f"run time (s, {plots.CLOCK_LABELS[clock_name(job)]})")
    plots.plot_reward_accuracy(rows, str(rd.path / "reward_accuracy.png"))
    plots.plot_lag_hist(rows, str(rd.path / "lag_hist.png"))
    plots.plot_staleness(rows, str(rd.path / "staleness.png"))
    plots.plot_idle(rows, str(rd.path / "idle.png"))
    save_cost_fit(job)
    rd.close()
    self.summary = to_jsonable({
        "run_dir": str(rd.path), "driver": pcfg.driver, "mode": pcfg.mode,
        "steps": job.learner.step, "clock": clock_name(job), "time_s": time_s,
        "wall_s": time.perf_counter() - job.clock.wall0,
        "initial_heldout_accuracy": evals[0]["heldout_accuracy"] if evals else None,
        "final_heldout_accuracy": self._eval.final_accuracy,
        **({"final_heldout_sampled": {k: v for k, v in evals[-1].items()
                                      if k.startswith(("heldout_mean_at_", "heldout_pass_at_"))}}
           if evals and "eval_samples" in evals[-1] else {}),
        "idle_fraction": summary.idle if summary else {},
        "slot_occupancy": summary.slot_occupancy if summary else None,
        "reward_outcomes": job.worker.verifier.stats.snapshot(),  # per verifier outcome
        "wasted_tokens": job.queue.stats().waste.wasted_tokens,
    })
    (rd.path / "summary.json").write_text(json.dumps(self.summary, indent=2))
