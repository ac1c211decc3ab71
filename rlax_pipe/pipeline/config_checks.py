"""Rules between fields of a `RunConfig`'s sub-configs, which no single dataclass (each checks its
own fields' ranges) can see, checked when the config is built (`check_run_config`).

Every rule names both fields by their path in `RunConfig` ("RunConfig.pipeline.seq_len"; the
command line spells it `--config.pipeline.seq_len`) and says how to fix it. Three kinds:
settings that cannot work together (they would fail later, at the first long sample or the first
train step); settings that would be silently ignored (a LoRA alpha or target list with LoRA off,
a bound of the group filter with the filter off), rejected so that a typo in the switch is not a
run that quietly does something else; settings that learn nothing (`_check_learning_signal`).

Rules that need the devices, the model or the tokenizer are checked when the job is built
(`rlax_pipe.pipeline.devices`, `job.build_job`, `job.check_job_settings`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rlax_pipe import advantages as advantages_lib
from rlax_pipe.config_dict import ConfigError

# Mesh axes each role's rules table splits over (rlax_pipe.sharding).
SAMPLER_MESH_AXES: tuple[str, ...] = ("data", "expert", "tp")
LEARNER_MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tp")
# Tasks whose config names the user's file (no usable default).
FILE_TASKS: tuple[str, ...] = ("jsonl", "dataset_file")


def _check_lengths(cfg) -> None:
  s, p, g = cfg.sampler, cfg.pipeline, cfg.pipeline.grading
  if p.seq_len < s.max_seq_len:
    raise ConfigError(
        f"RunConfig.pipeline.seq_len={p.seq_len} < RunConfig.sampler.max_seq_len={s.max_seq_len}:"
        " a sample of max_seq_len tokens would not fit in one packed learner row; set "
        f"pipeline.seq_len >= {s.max_seq_len} (or lower sampler.max_seq_len).")
  if s.num_pages < s.pages_per_seq:
    raise ConfigError(
        f"RunConfig.sampler.num_pages={s.num_pages} < {s.pages_per_seq} pages that one sequence "
        f"of RunConfig.sampler.max_seq_len={s.max_seq_len} tokens needs (page_size "
        f"{s.page_size}); every long request would be rejected. Raise sampler.num_pages (e.g. "
        f"num_slots x {s.pages_per_seq} = {s.num_slots * s.pages_per_seq}) or lower max_seq_len.")
  if s.max_seq_len - g.min_completion_tokens < 1:
    raise ConfigError(
        f"RunConfig.sampler.max_seq_len={s.max_seq_len} leaves no prompt token once "
        f"RunConfig.pipeline.grading.min_completion_tokens={g.min_completion_tokens} are "
        "reserved for the completion; raise sampler.max_seq_len or lower min_completion_tokens.")
  if g.max_prefill_len is not None and g.max_prefill_len > s.max_seq_len - g.min_completion_tokens:
    raise ConfigError(
        f"RunConfig.pipeline.grading.max_prefill_len={g.max_prefill_len} > "
        f"RunConfig.sampler.max_seq_len={s.max_seq_len} - "
        f"RunConfig.pipeline.grading.min_completion_tokens={g.min_completion_tokens}: such a "
        "prompt leaves no room for the completion; lower grading.max_prefill_len (<= "
        f"{s.max_seq_len - g.min_completion_tokens}, or None for the whole sequence budget) or "
        "raise sampler.max_seq_len.")
  if (g.overlong_policy == "soft_penalty" and g.overlong_max_tokens is not None
      and g.overlong_max_tokens - g.overlong_buffer_tokens >= s.max_new_tokens):
    raise ConfigError(
        f"RunConfig.pipeline.grading.overlong_max_tokens={g.overlong_max_tokens} minus "
        f"overlong_buffer_tokens={g.overlong_buffer_tokens} is >= "
        f"RunConfig.sampler.max_new_tokens={s.max_new_tokens}: no completion can reach the "
        "soft penalty's range, so it never applies; lower overlong_max_tokens (<= "
        f"{s.max_new_tokens + g.overlong_buffer_tokens - 1}) or leave it None (each sample's "
        "own budget).")


def _check_objective(cfg) -> None:
  o, s = cfg.objective, cfg.sampler
  if o.aggregation == "constant" and o.max_completion_len != s.max_new_tokens:
    raise ConfigError(
        f"RunConfig.objective.max_completion_len={o.max_completion_len} != "
        f"RunConfig.sampler.max_new_tokens={s.max_new_tokens}: the Dr. GRPO constant normaliser "
        "(aggregation='constant') is samples x the longest completion the sampler may generate; "
        f"set objective.max_completion_len={s.max_new_tokens}.")


def _check_timeouts(cfg) -> None:
  """A reward call must end well within the learner's wait: the fixed `wait_timeout_s`, or,
  when that is None (scaled to measured intervals), its floor `wait_timeout_floor_s`."""
  p = cfg.pipeline
  name = "wait_timeout_s" if p.wait_timeout_s is not None else "wait_timeout_floor_s"
  wait = getattr(p, name)
  if p.reward_timeout_s >= wait:
    raise ConfigError(
        f"RunConfig.pipeline.reward_timeout_s={p.reward_timeout_s} >= "
        f"RunConfig.pipeline.{name}={wait}: one slow reward call would time "
        f"out the learner's wait for a batch; keep reward_timeout_s well below {name}.")


def _check_learning_signal(cfg) -> None:
  """Settings under which every advantage (so every token's gradient weight) is zero."""
  p, sampling = cfg.pipeline, cfg.sampler.sampling
  if p.advantage not in advantages_lib.ADVANTAGES:
    raise ConfigError(f"RunConfig.pipeline.advantage={p.advantage!r}; choose one of "
                      f"{tuple(advantages_lib.ADVANTAGES)}.")
  need = advantages_lib.MIN_GROUP_SIZE[p.advantage]
  if p.group_size < need:
    group_relative = sorted(n for n, g in advantages_lib.MIN_GROUP_SIZE.items() if g >= 2)
    raise ConfigError(
        f"RunConfig.pipeline.group_size={p.group_size} with "
        f"RunConfig.pipeline.advantage={p.advantage!r} learns nothing: the group-relative "
        f"estimators {group_relative} need group_size >= 2 (a sample's baseline comes from the "
        f"other samples of its group, so a group of one gets advantage 0 and every token weight "
        f"is 0). Set pipeline.group_size >= {need} (e.g. 8).")
  if p.group_size >= 2 and (sampling.greedy or sampling.top_k == 1):
    knob = "greedy=True" if sampling.greedy else "top_k=1"
    raise ConfigError(
        f"RunConfig.sampler.sampling.{knob} with RunConfig.pipeline.group_size={p.group_size} "
        f"learns nothing: every sample of a group is the same argmax completion, so every "
        f"group-relative advantage ({p.advantage}) is 0. Sample (greedy=False, top_k=0 or > 1, "
        "temperature > 0); greedy decoding is for evaluation, which the job already does.")


def _check_unused_settings(cfg) -> None:
  """Fields that only mean something when a switch is on, set while it is off."""
  lora = cfg.learner.lora
  if not lora.enabled:
    changed = [f.name for f in dataclasses.fields(lora)
               if f.name != "rank" and getattr(lora, f.name) != f.default]
    if changed:
      fields = ", ".join(f"RunConfig.learner.lora.{n}={getattr(lora, n)!r}" for n in changed)
      raise ConfigError(
          f"{fields} set with RunConfig.learner.lora.rank=0 (LoRA off): it would be ignored. "
          "Set learner.lora.rank >= 1 (e.g. 16) to train adapters, or leave "
          f"{' / '.join(changed)} at the default.")
  p = cfg.pipeline
  default = type(p).filter_max_dropped_per_step  # a dataclass default stays a class attribute
  if p.filter_groups == "off" and p.filter_max_dropped_per_step != default:
    raise ConfigError(
        f"RunConfig.pipeline.filter_max_dropped_per_step={p.filter_max_dropped_per_step} set "
        "with RunConfig.pipeline.filter_groups='off': the bound of the group filter would be "
        "ignored. Set pipeline.filter_groups='zero_variance' to drop groups without learning "
        "signal, or leave filter_max_dropped_per_step at its default "
        f"({default}).")


def _check_meshes(cfg) -> None:
  for field, axes, known in (("sampler_mesh_axes", cfg.sampler_mesh_axes, SAMPLER_MESH_AXES),
                             ("learner.mesh_axes", cfg.learner.mesh_axes, LEARNER_MESH_AXES)):
    if not isinstance(axes, tuple) or not all(
        isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str)
        and isinstance(a[1], int) and a[1] >= 1 for a in axes):
      raise ConfigError(f"RunConfig.{field}={axes!r} must be () (chosen from the devices "
                        "present) or (axis, size >= 1) pairs, e.g. (('tp', 2),).")
    unknown = [name for name, _ in axes if name not in known]
    if unknown or len({name for name, _ in axes}) != len(axes):
      raise ConfigError(f"RunConfig.{field}={axes!r}: axes must be distinct names among "
                        f"{known}; () chooses them from the devices present.")


def task_config_of(cfg) -> Any:
  """The task's config dataclass of a RunConfig (`task_config_for` with its fields)."""
  return task_config_for(cfg.task, cfg.task_config, cfg.jsonl_path)


def task_config_for(task: str, task_cfg: Any, jsonl_path: str | None = None, *,
                    owner: str = "RunConfig", preset_file: str = "pipeline_rl") -> Any:
  """The config dataclass of task `task` from a dataclass, a mapping of its fields or None.

  Args:
    task: a task name of `tasks.TASKS`.
    task_cfg: the task's config (dataclass, mapping, or None for its defaults).
    jsonl_path: the older spelling of a JSONL task's file.
    owner: how the fields' owner is named in messages ("RunConfig", "--config").
    preset_file: the config file whose task presets the message suggests.

  Raises:
    ConfigError: for an unknown task, a task config of another task, unknown fields, or a file
      task without its file (the message names `<owner>.task_config.<field>`).
  """
  from rlax_pipe import tasks  # pylint: disable=import-outside-toplevel
  if task not in tasks.TASKS:
    raise ConfigError(f"{owner}.task={task!r}; choose one of {sorted(tasks.TASKS)}.")
  config_cls = tasks.TASKS[task][1]
  if jsonl_path is not None:
    if task != "jsonl":
      raise ConfigError(f"{owner}.jsonl_path={jsonl_path!r} is only read by task 'jsonl' "
                        f"({owner}.task={task!r}); drop it or set task='jsonl'.")
    if task_cfg is not None:
      raise ConfigError(f"{owner}.jsonl_path and {owner}.task_config both name the JSONL "
                        "file; keep one (task_config.path).")
    return config_cls(path=jsonl_path)
  if task_cfg is None:
    if task in FILE_TASKS:
      raise ConfigError(
          f"{owner}.task={task!r} needs its file: set {owner}.task_config.path (on the "
          f"command line: --config=experiments/configs/{preset_file}.py:{task} "
          "--config.task_config.path=FILE).")
    return config_cls()
  if dataclasses.is_dataclass(task_cfg):
    if not isinstance(task_cfg, config_cls):
      raise ConfigError(f"{owner}.task_config is a {type(task_cfg).__name__}, but task "
                        f"{task!r} takes a {config_cls.__name__}.")
    return task_cfg
  if hasattr(task_cfg, "to_dict"):  # a ConfigDict
    task_cfg = task_cfg.to_dict()
  if not isinstance(task_cfg, Mapping):
    raise ConfigError(f"{owner}.task_config={task_cfg!r} must be a {config_cls.__name__}, a "
                      "dict of its fields, or None.")
  fields = {f.name for f in dataclasses.fields(config_cls)}
  unknown = sorted(set(task_cfg) - fields)
  if unknown:
    raise ConfigError(f"{owner}.task_config has no field(s) {unknown} for task {task!r} "
                      f"({config_cls.__name__}: {sorted(fields)}).")
  if "path" in fields and task_cfg.get("path") is None:
    raise ConfigError(f"{owner}.task={task!r} needs its file: set {owner}.task_config.path.")
  try:
    return config_cls(**task_cfg)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{owner}.task_config: {e}") from None


def check_run_config(cfg) -> None:
  """Checks every cross-field rule of a `RunConfig` (module docstring).

  Raises:
    ConfigError: naming the fields of the first broken rule and the fix.
  """
  for check in (_check_lengths, _check_objective, _check_timeouts, _check_learning_signal,
                _check_unused_settings, _check_meshes, task_config_of):
    check(cfg)

