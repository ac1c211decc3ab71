"""Configuration of an RL run: `PipelineConfig` and the whole run's `RunConfig`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from rlax_pipe import config as model_config
from rlax_pipe.cluster.config import DistributedConfig
from rlax_pipe import objectives
from rlax_pipe.costs import CostModel, load_cost_model  # CostModel: re-exported (virtual clock)
from rlax_pipe.envs.base import EnvConfig
from rlax_pipe.grading import GradingConfig
from rlax_pipe.learner.config import LearnerConfig
from rlax_pipe.pipeline import config_checks
from rlax_pipe.pipeline.group_filter import GroupFilterConfig
from rlax_pipe.pipeline.staleness import StalenessConfig
from rlax_pipe.sampler.config import SamplerConfig
from rlax_pipe.tokenizer import PromptFormat

BUILTIN_INIT = "builtin"  # the shipped warm starts of `RunConfig.init`
BUILTIN_MOE_INIT = "builtin_moe"

from rlax_pipe.pipeline.rules import DRIVERS  # pylint: disable=unused-import
MODES: tuple[str, ...] = ("reproducible", "threaded")
LOST_SAMPLE_POLICIES: tuple[str, ...] = ("redispatch", "discard")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """How sampling and learning are interleaved.

  Attributes:
    driver: "sync" (sample a whole batch with version v, wait for its last sample, train, push:
      lag 0), "async-batch" (conventional asynchronous RL: the sampler generates round r+1 while
      the learner trains on round r; weights change only between rounds, so no sample mixes
      versions) or "pipeline" (samplers never stop; in-flight weight updates between two decode
      steps; per-token lag bounded by `staleness`).
    mode: "reproducible" (one thread, deterministic interleaving on a virtual clock driven by
      the cost model: same seed, same run) or "threaded" (sampler in its own thread, real clock,
      grading on its own thread).
    num_steps: learner optimizer steps to run (>= 1).
    group_size: samples per prompt (>= 1; the group-relative advantages, every estimator of
      `rlax_pipe.advantages`, need >= 2, which `RunConfig` checks).
    seq_len: tokens per packed learner row (>= the sampler's max_seq_len).
    advantage: advantage estimator name (see `rlax_pipe.advantages`).
    filter_groups: dynamic sampling (DAPO, arXiv 2503.14476, Sec. 3.2; the rule and its
      counters are `pipeline.group_filter`'s): "off" (train every complete scored group) or
      "zero_variance" (the queue drops a group whose valid rewards are all equal and admits a
      replacement prompt; metrics `filtered_groups`, `filtered_samples`, `filtered_tokens` are
      cumulative over the whole run, resumes included, not per step).
    filter_max_dropped_per_step: the bound of "zero_variance": most groups dropped between two
      learner batches (>= 1); past it, zero-variance groups are trained and counted
      (`filter_kept_groups`). Set with the filter off, it is rejected.
    staleness: enforcement of max_lag (policy, bound, queue capacity) and the learner batch size
      in prompt groups, `staleness.groups_per_step` (the unit of the AReaL admission bound; the
      one place it is set, read as `groups_per_step`).
    eval_every: learner steps between held-out evaluations (>= 1); also at step 0 and the end.
    eval_problems: held-out problems per evaluation (>= 1).
    eval_samples: n >= 0 samples per held-out problem at the sampling temperature (the
      sampler's `SamplingConfig`) at every evaluation, reported as mean@n and unbiased pass@k
      (Chen et al. 2021) beside the greedy accuracy; 0 = off (default: greedy only). Costs n
      times the greedy evaluation's decode work.
    eval_pass_k: the k of the reported pass@k, a tuple of ints in [1, eval_samples], or None
      (default) for (1, eval_samples). Only valid with eval_samples > 0.
    checkpoint_every: learner steps between checkpoints (>= 1).
    wait_timeout_s: limit of every blocking wait (seconds, > 0; the error says what was awaited
      and names samples that have not arrived), or None to scale it to measured step times
      (`driver.wait_timeout`).
    wait_timeout_factor: multiple of the measured batch interval (> 1) when wait_timeout_s is None.
    wait_timeout_floor_s: smallest scaled timeout (seconds, > 0).
    lost_sample_policy: what to do with a lost sample, under every staleness policy: one the
      engine no longer holds that never came back (issue #14 item 9), or one it handed back that
      is not in the queue half a wait limit later (`driver.delivery_limit`; issue #27 item 2):
      "redispatch" (sample it again, same id and prompt) or "discard" (give up its group;
      counted as waste reason "lost"). Both are named in the log and counted in the metrics.
    debug_verify_push: after each push, check that sampler and learner log-probs agree on a
      probe sequence (slow; catches a push that silently did not apply). Always on, and cheap:
      the engine checks the checksums of the weights it decodes with after every swap.
    lag0_logp_alarm: alarm threshold (nats) on the learner's mean |log pi - log mu| over lag-0
      tokens (`logp_mismatch_mean`: tokens sampled with exactly the weights being trained),
      which a sampler decoding with other weights than its tags say drives up (0.37 in the
      case of issue #14 item 10); measured 0.0018 for stale-KV "keep" and 0.0022 for a bf16
      sampler (WORKSPACE_NOTES A5, A9). Above it a step logs a warning; its metrics are
      `trainer.lag0_alarm`'s. None = off.
    reward_timeout_s: limit of one reward-function call (seconds, > 0); a call still running then
      is killed with its verifier process and the sample gets no reward.
    grading: over-long prompts, completions cut by the length limit, failed rewards
      (`rlax_pipe.grading`).
    cost_model: virtual-clock durations for the reproducible mode (`rlax_pipe.costs.CostModel`;
      the default is hand-set, labelled so in its `source`, never a measurement).
    cost_model_file: a stored cost model (a calibration's cost_fit.json, `costs.CostFit.save`)
      that replaces `cost_model` when set.
  """

  REMOVED_FIELDS: ClassVar[dict[str, str]] = {
      "seed": "it was read by nothing; set --config.sampler.seed (sampling), "
              "--config.learner.seed (init and learner PRNG) and the task config's seed "
              "(prompt stream) instead, and delete pipeline.seed"}

  driver: str = "pipeline"
  mode: str = "reproducible"
  num_steps: int = 30
  group_size: int = 8
  seq_len: int = 384
  advantage: str = "grpo"
  filter_groups: str = "off"
  filter_max_dropped_per_step: int = 32
  staleness: StalenessConfig = StalenessConfig()
  eval_every: int = 10
  eval_problems: int = 128
  eval_samples: int = 0
  eval_pass_k: tuple[int, ...] | None = None
  checkpoint_every: int = 5
  wait_timeout_s: float | None = None
  wait_timeout_factor: float = 20.0
  wait_timeout_floor_s: float = 60.0
  lost_sample_policy: str = "redispatch"
  debug_verify_push: bool = False
  lag0_logp_alarm: float | None = 0.05
  reward_timeout_s: float = 5.0
  grading: GradingConfig = GradingConfig()
  cost_model: CostModel = CostModel()
  cost_model_file: str | None = None

  def __post_init__(self):
    for name, allowed in (("driver", DRIVERS), ("mode", MODES),
                          ("lost_sample_policy", LOST_SAMPLE_POLICIES)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"PipelineConfig.{name}={getattr(self, name)!r}; choose one of {allowed}.")
    for name in ("num_steps", "group_size", "seq_len", "eval_every", "eval_problems",
                 "checkpoint_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"PipelineConfig.{name}={getattr(self, name)} must be >= 1.")
    if (self.wait_timeout_s is not None and not self.wait_timeout_s > 0) or (
        not self.reward_timeout_s > 0):
      raise ValueError("PipelineConfig.wait_timeout_s (or None) and reward_timeout_s must be > 0.")
    if not self.wait_timeout_factor > 1 or not self.wait_timeout_floor_s > 0:
      raise ValueError(f"PipelineConfig.wait_timeout_factor={self.wait_timeout_factor} must be "
                       f"> 1 and wait_timeout_floor_s={self.wait_timeout_floor_s} > 0.")
    self.group_filter  # pylint: disable=pointless-statement  (validates the filter fields)
    n, ks = self.eval_samples, self.eval_pass_k
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
      raise ValueError(f"PipelineConfig.eval_samples={n!r} must be an int >= 0 (0 = off).")
    if ks is not None and n == 0:
      raise ValueError(f"PipelineConfig.eval_pass_k={ks!r} has no effect with eval_samples=0; "
                       "set --config.pipeline.eval_samples=n (>= max k) or leave it None.")
    if ks is not None and (not isinstance(ks, tuple) or not ks or not all(
        isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= n for k in ks)):
      raise ValueError(f"PipelineConfig.eval_pass_k={ks!r} must be a non-empty tuple of ints in "
                       f"[1, eval_samples={n}] (pass@k needs k <= n samples).")

  @property
  def pass_ks(self) -> tuple[int, ...]:
    """The k of the reported pass@k: eval_pass_k, or (1, eval_samples); () when off."""
    if self.eval_samples == 0:
      return ()
    return tuple(sorted(set(self.eval_pass_k or (1, self.eval_samples))))

  @property
  def groups_per_step(self) -> int:
    """Prompt groups per learner batch (set in `staleness.groups_per_step`)."""
    return self.staleness.groups_per_step

  @property
  def group_filter(self) -> GroupFilterConfig:
    """The queue's dynamic-sampling filter (`filter_groups`, `filter_max_dropped_per_step`).

    Raises:
      ValueError: naming the `--config.pipeline.` field, when a value is out of range.
    """
    return GroupFilterConfig(self.filter_groups, self.filter_max_dropped_per_step)

  def resolved_cost_model(self) -> CostModel:
    """The virtual clock's cost model: `cost_model_file`'s when set, else `cost_model`.

    Raises:
      FileNotFoundError / ValueError: from `costs.load_cost_model`.
    """
    return load_cost_model(self.cost_model_file) if self.cost_model_file else self.cost_model


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One RL run. Its defaults are the default experiment (README command 1).

  Rules between fields of different sub-configs are checked when it is built (`config_checks`).

  Attributes:
    run_dir: output directory (created; reused with resume=True).
    init: initial policy: "builtin" (the shipped SFT warm start for the arithmetic task),
      "builtin_moe" (the same, sparsely upcycled to 4 experts, top-2, in every layer: the tiny
      MoE of `configs/pipeline_rl.py:tiny_moe`), or an HF model directory (config.json +
      *.safetensors; its tokenizer and generation_config.json are used when present).
    task: task name (see rlax_pipe.tasks.TASKS); jsonl_path for task "jsonl".
    jsonl_path: problems file of the JSONL task (or task_config.path).
    task_config: the task's own config (e.g. `tasks.ArithmeticConfig`, `tasks.DatasetFileConfig`
      with `path` and an optional separate evaluation file `eval_path`), a dict of its fields, or
      None for the task's defaults.
    tokenizer_path: tokenizer file or HF directory (see `tokenizer.load_tokenizer`); None = the
      tokenizer of `init` when that directory holds one (tokenizer.json or tokenizer.model), else
      the shipped tokenizer.
    prompt_format: how prompts become token ids (`tokenizer.PromptFormat`): kind "raw" (the text,
      with BOS when the tokenizer adds one) or "chat" (the user message of the tokenizer's chat
      template with its generation prompt), optional system prompt and template variables.
    sampler_mesh_axes: ordered (axis, size) pairs of the sampler mesh (axes among
      `config_checks.SAMPLER_MESH_AXES`); the product is the number of sampler devices.
      () = chosen from the devices present (`pipeline.devices`).
    learner: learner config; its mesh_axes give the learner mesh (product = learner devices;
      () = chosen from the devices present, as for the sampler).
      Its checkpoint.directory must stay None: the job checkpoints into run_dir/checkpoints.
    objective: objective config. Its max_lag must stay None: the one staleness bound is
      pipeline.staleness.max_lag, which the learner's objective also receives (its hard lag
      mask is a second guard behind the queue).
    sampler: sampler config (slots, pages, completion budget max_new_tokens, sampling with
      temperature / top_k / top_p). Its `sampling` defines the behaviour policy mu, the
      distribution the learner scores and corrects for with the same `SamplingConfig`; its
      default is `SamplingConfig()`'s (temperature 1.0: the model's own distribution). Its
      eos_id None (or ()) = the tokenizer's and the model's stop set (`job.stop_ids_for`); set
      ids to override. An RL run always has a stop set.
    pipeline: driver, batch shape, staleness, evaluation and checkpoint cadence.
    eval_slots: decode slots of the held-out evaluation sampler (>= 1).
    sampler_compute_dtype: activation/matmul dtype of the rollout sampler's forward pass
      ("float32", "bfloat16", "float16"), or None for the model's own `compute_dtype`. The learner
      and the held-out evaluation keep the model's dtype, so "bfloat16" reproduces the precision
      mismatch of a bf16 inference engine feeding an fp32 learner (Yao et al. 2025; ablation A9);
      weights still travel in the learner's param dtype. Set `sampler.cache_dtype` to match.
    export_hf: at the end, write the trained policy as an HF model directory run_dir/hf/
      (config.json, model.safetensors, tokenizer files, generation_config.json; built-in model
      family only), loadable by transformers and by `init`.
    resume: continue from the newest checkpoint in run_dir/checkpoints with the configuration
      saved in run_dir/config.json (an error when there is no checkpoint).
    change_on_resume: dotted field paths (e.g. "learner.optimizer.learning_rate",
      "pipeline.num_steps"; a sub-config's path names all its fields; comma-separated text is
      split) whose values may differ from the saved configuration on resume;
      each change is recorded in run_dir/config_changes.jsonl with the step it takes effect.
      Any other difference is refused.
    env: limits and tool-failure handling of multi-turn episodes (`rlax_pipe.envs.EnvConfig`),
      read when the task is an environment (has tools, e.g. task "arithmetic_calculator").
    distributed: the multi-process mode (`num_learner_processes` > 0: one `jax.distributed` job,
      the first K processes the learner mesh, every other process a sampler replica on its own
      devices; `launch/README.md`). 0 (default) = this single process splits its devices.
  """

  run_dir: str = "runs/pipeline_rl"
  init: str = BUILTIN_INIT
  task: str = "arithmetic"
  jsonl_path: str | None = None
  task_config: Any = None
  tokenizer_path: str | None = None
  prompt_format: PromptFormat = PromptFormat()
  sampler_mesh_axes: tuple[tuple[str, int], ...] = ()
  learner: LearnerConfig = LearnerConfig(mesh_axes=())
  objective: objectives.ObjectiveConfig = objectives.ObjectiveConfig()
  sampler: SamplerConfig = SamplerConfig(
      num_slots=64, num_pages=512, max_seq_len=384, max_new_tokens=384)
  pipeline: PipelineConfig = PipelineConfig()
  eval_slots: int = 32
  sampler_compute_dtype: str | None = None
  export_hf: bool = True
  resume: bool = False
  change_on_resume: tuple[str, ...] = ()
  distributed: DistributedConfig = DistributedConfig()
  env: EnvConfig = EnvConfig()

  def __post_init__(self):
    if self.sampler_compute_dtype not in (None,) + model_config.DTYPES:
      raise ValueError(f"RunConfig.sampler_compute_dtype={self.sampler_compute_dtype!r}; use "
                       f"None or one of {model_config.DTYPES}.")
    if self.objective.max_lag is not None:
      raise ValueError(
          f"RunConfig.objective.max_lag={self.objective.max_lag}: set the staleness bound once, "
          "in pipeline.staleness.max_lag (the objective receives it); leave objective.max_lag "
          "None.")
    if self.learner.checkpoint.directory is not None:
      raise ValueError(
          f"RunConfig.learner.checkpoint.directory={self.learner.checkpoint.directory!r}: the "
          "job checkpoints into run_dir/checkpoints; leave it None and set run_dir.")
    if self.eval_slots < 1:
      raise ValueError(f"RunConfig.eval_slots={self.eval_slots} must be >= 1.")
    paths = (self.change_on_resume,) if isinstance(self.change_on_resume, str) else (
        self.change_on_resume)
    if not all(isinstance(p, str) for p in paths):
      raise ValueError(f"RunConfig.change_on_resume={self.change_on_resume!r} must be dotted "
                       "field paths, e.g. ('pipeline.num_steps',) or 'a.b,c.d'.")
    object.__setattr__(self, "change_on_resume", tuple(  # "a,b" (command line) -> ("a", "b")
        q.strip() for p in paths for q in p.split(",") if q.strip()))
    config_checks.check_run_config(self)

  @property
  def num_sampler_devices(self) -> int:
    """Devices of the sampler mesh (product of `sampler_mesh_axes`; a job's resolved config).

    Raises:
      ValueError: when the shape is () (chosen from the devices present when the job is built:
        read `Job.cfg` or `Job.plan`).
    """
    return _num_devices(self.sampler_mesh_axes, "sampler_mesh_axes")

  @property
  def num_learner_devices(self) -> int:
    """Devices of the learner mesh (product of `learner.mesh_axes`; a job's resolved config).

    Raises:
      ValueError: when the shape is () (see `num_sampler_devices`).
    """
    return _num_devices(self.learner.mesh_axes, "learner.mesh_axes")


def _num_devices(axes: tuple[tuple[str, int], ...], field: str) -> int:
  if not axes:
    raise ValueError(f"RunConfig.{field}=() is chosen from the devices present when the job is "
                     "built; read the job's resolved config (Job.cfg) or plan (Job.plan).")
  return math.prod(size for _, size in axes)
