"""Command-line configs of the experiments: `--config` (an ml_collections config file plus
`--config.<field>=value` overrides), the flags of earlier versions (which fail with a message
naming their new spelling), resumed runs (the saved configuration plus the fields the command line
names), and `user_errors()`, which ends an entry point with a one-line message for a user's
mistake instead of a traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import pathlib
import re
import sys
from typing import Any, Iterator, Mapping, Sequence

from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags

from rlax_pipe import config_dict
from rlax_pipe import platform_setup
from rlax_pipe import run_dir as run_dir_lib

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"

# The flags of experiments/rl_flags.py (removed) -> their spelling as config overrides.
RL_RENAMED: Mapping[str, str] = {
    "run_dir": "--config.run_dir",
    "init": "--config.init",
    "task": "--config.task",
    "jsonl_path": "--config.jsonl_path",
    "resume": "--config.resume",
    "sampler_devices": "--config.sampler_mesh_axes (its product is the device count)",
    "sampler_tp": "--config.sampler_mesh_axes=\"(('data', 2), ('tp', 2))\"",
    "learner_devices": "--config.learner.mesh_axes (its product is the device count)",
    "learner_fsdp": "--config.learner.mesh_axes=\"(('fsdp', 2), ('tp', 2))\"",
    "driver": "--config.pipeline.driver",
    "mode": "--config.pipeline.mode",
    "steps": "--config.pipeline.num_steps",
    "groups_per_step": "--config.pipeline.staleness.groups_per_step",
    "group_size": "--config.pipeline.group_size",
    "max_lag": "--config.pipeline.staleness.max_lag (unbounded: leave it None in a config file)",
    "staleness_policy": "--config.pipeline.staleness.policy",
    "queue_capacity_groups": "--config.pipeline.staleness.queue_capacity_groups",
    "objective": "--config.objective.name",
    "aggregation": "--config.objective.aggregation (with 'constant' also "
                   "--config.objective.max_completion_len, the sampler's max_new_tokens)",
    "truncation": "--config.objective.truncation",
    "advantage": "--config.pipeline.advantage",
    "learning_rate": "--config.learner.optimizer.learning_rate",
    "adam_eps": "--config.learner.optimizer.adam_eps",
    "warmup_steps": "--config.learner.optimizer.warmup_steps",
    "slots": "--config.sampler.num_slots",
    "pages": "--config.sampler.num_pages",
    "page_size": "--config.sampler.page_size",
    "max_seq_len": "--config.sampler.max_seq_len, --config.sampler.max_new_tokens and "
                   "--config.pipeline.seq_len",
    "temperature": "--config.sampler.sampling.temperature",
    "kv_policy": "--config.sampler.kv_policy",
    "sampler_dtype": "--config.sampler_compute_dtype and --config.sampler.cache_dtype",
    "eval_every": "--config.pipeline.eval_every",
    "eval_problems": "--config.pipeline.eval_problems",
    "checkpoint_every": "--config.pipeline.checkpoint_every",
    "wait_timeout_s": "--config.pipeline.wait_timeout_s",
    "debug_verify_push": "--config.pipeline.debug_verify_push",
    "seed": "--config.sampler.seed and --config.learner.seed",
    "cost_decode_base_s": "--config.pipeline.cost_model.decode_step_s (or a measured model: "
                          "--config.pipeline.cost_model_file=<run>/cost_fit.json)",
    "cost_decode_per_slot_s": "--config.pipeline.cost_model.slot_step_s",
    "cost_prefill_per_token_s": "--config.pipeline.cost_model.prefill_token_s",
    "cost_train_base_s": "--config.pipeline.cost_model.train_step_s",
    "cost_train_per_token_s": "--config.pipeline.cost_model.train_token_s",
    "cost_push_s": "--config.pipeline.cost_model.push_s",
}

# The flags of experiments/sft.py before config files.
SFT_RENAMED: Mapping[str, str] = {
    "out_dir": "--config.out_dir", "task": "--config.task", "jsonl_path": "--config.jsonl_path",
    "steps": "--config.sft.steps", "rows": "--config.sft.rows", "seq_len": "--config.sft.seq_len",
    "learning_rate": "--config.sft.learning_rate", "warmup_steps": "--config.sft.warmup_steps",
    "eval_problems": "--config.sft.eval_problems", "seed": "--config.sft.seed",
    "direct_answer_fraction": "--config.sft.direct_answer_fraction",
}
_BOOLEAN = ("resume", "debug_verify_push")


def load_config_file(path: str | pathlib.Path, preset: str = "default") -> Any:
  """`get_config(preset)` of a config file (as `--config=path:preset` would load it)."""
  spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(preset)


def define_config(family: str, intro: str, field_lines: list[str],
                  flag_values: flags.FlagValues = flags.FLAGS, sys_argv: list[str] | None = None,
                  preset: str = "default"):
  """Defines `--config` (default: configs/<family>.py:<preset>) whose help lists every field.

  Args:
    family: config file name without ".py", e.g. "pipeline_rl".
    intro: first paragraph of the help.
    field_lines: one "path: description [default]" line per field (`describe_fields`).
    flag_values: where to define it (tests pass their own `FlagValues`).
    sys_argv: the command line whose `--config.<field>` overrides are registered (None =
      `sys.argv`; tests pass theirs).
    preset: the preset of the default config file.

  Returns:
    The flag holder; `.value` is the ConfigDict after parsing.
  """
  help_text = (f"{intro} Presets: `--config=experiments/configs/{family}.py:<preset>`; override "
               "any field with --config.<field>=<value>. Fields, their units and their default "
               "values:\n    " + "\n    ".join(field_lines))
  default = str(CONFIGS / f"{family}.py") + ("" if preset == "default" else f":{preset}")
  argv = sys.argv if sys_argv is None else sys_argv
  try:
    check_override_paths(argv, default)
  except config_dict.ConfigError as e:
    if sys_argv is not None:
      raise
    print(f"{pathlib.Path(argv[0]).name}: error: {e}", file=sys.stderr)
    sys.exit(2)
  return config_flags.DEFINE_config_file("config", default, help_text,
                                         flag_values=flag_values, lock_config=True,
                                         sys_argv=sys_argv)


def define_removed_flags(renamed: Mapping[str, str],
                         flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines each old flag so that using it fails with a message naming its new spelling."""
  for name, new in renamed.items():
    message = f"--{name} was replaced by the config file: use {new}."
    define = flags.DEFINE_bool if name in _BOOLEAN else flags.DEFINE_string
    define(name, None, f"Removed: use {new}.", flag_values=flag_values)
    flags.register_validator(name, lambda value: value is None, message=message,
                             flag_values=flag_values)


def rl_field_lines() -> list[str]:
  """Help lines of the RL family: every RunConfig field with the default preset's value."""
  from rlax_pipe.pipeline.config import RunConfig  # pylint: disable=import-outside-toplevel
  default = config_dict.from_config_dict(RunConfig, load_config_file(CONFIGS / "pipeline_rl.py"))
  return config_dict.describe_fields(default, "config.")


def check_override_paths(argv: Sequence[str], default: str) -> None:
  """Checks that every `--config.<path>` of `argv` names a field of the config file (`--config=`
  of argv, else `default`), before absl parses them (a typo there ends in a traceback).

  Fields whose value is free-form (e.g. `task_config` without a task preset) are not looked into.

  Raises:
    ConfigError: naming the unknown field, the closest valid name and the valid names.
  """
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), default)
  path, _, preset = spec.partition(":")
  try:
    config = load_config_file(path, preset or "default")
  except (OSError, ValueError) as e:
    raise config_dict.ConfigError(f"--config={spec}: {e}") from None
  for override in override_paths(argv):
    node, walked = config, "--config"
    for key in override.split("."):
      if node is None:
        raise config_dict.ConfigError(
            f"--config.{override}: {walked} is not set, so it has no fields to override; for a "
            "task's config choose the task's preset first (--config=experiments/configs/"
            "<file>.py:<task>, e.g. pipeline_rl.py:dataset_file).")
      if not isinstance(node, ml_collections.ConfigDict):
        break  # a free-form value (dict, tuple): its keys are checked when it is used
      if key not in node:
        names = sorted(node.keys())
        close = difflib.get_close_matches(key, names, n=1)
        hint = f" (did you mean {walked}.{close[0]}?)" if close else ""
        raise config_dict.ConfigError(f"--config.{override}: {walked} has no field {key!r}"
                                      f"{hint}; valid: {names}.")
      node, walked = node[key], f"{walked}.{key}"


def override_paths(argv: Sequence[str]) -> list[str]:
  """Dotted field paths a command line sets explicitly (`--config.a.b=v`, `--[no]config.a`)."""
  out = []
  for arg in argv:
    m = re.match(r"^--(?:no)?config\.([\w.]+)(?:=|$)", arg)
    if m:
      out.append(m.group(1))
  return out


def run_config(config: Any, argv: Sequence[str] | None = None):
  """The `RunConfig` of a parsed `--config` (validated; errors name `--config.<field>`).

  With `--config.resume`, the configuration is the one saved in `<run_dir>/config.json`, with
  only the fields this command line names explicitly (`override_paths(argv)`) taken from it; a
  named field whose value differs from the saved one must also be listed in
  `--config.change_on_resume` (checked by the job, which records the change).

  Args:
    config: the parsed ConfigDict.
    argv: the command line (default `sys.argv`).

  Raises:
    config_dict.ConfigError: on a field's own check, a cross-field rule, or a resume of a
      directory that holds no run.
  """
  from rlax_pipe.pipeline import record  # pylint: disable=import-outside-toplevel
  from rlax_pipe.pipeline.config import RunConfig  # pylint: disable=import-outside-toplevel
  if config.resume:
    saved = run_dir_lib.read_config(config.run_dir)
    if saved is None:
      raise config_dict.ConfigError(
          f"--config.resume: --config.run_dir={config.run_dir} holds no run (no config.json): "
          "a mistyped run dir? To start a new run there, drop --config.resume.")
    paths = ["run_dir", "change_on_resume"] + override_paths(sys.argv if argv is None else argv)
    config = record.merge_saved(saved, config.to_dict(), paths)
  return config_dict.from_config_dict(RunConfig, config, prefix="--config.")


@contextlib.contextmanager
def user_errors(program: str | None = None) -> Iterator[None]:
  """Ends the program with one line "<program>: error: <message>" (exit status 2) when the block
  raises `ConfigError` (a user's mistake: the message names the flag / config field and the
  fix); any other exception keeps its traceback."""
  try:
    yield
  except config_dict.ConfigError as e:
    name = program or pathlib.Path(sys.argv[0]).name
    message = str(e).replace("RunConfig.", "--config.")
    logging.flush()
    print(f"{name}: error: {message}", file=sys.stderr)
    sys.exit(2)


def setup_logging() -> None:
  """Library logging at warning level (orbax: ~50 info lines per checkpoint otherwise); set
  `--library_log_level=info` to see them."""
  platform_setup.quiet_library_logging(_LIB_LEVEL.value)


_LIB_LEVEL = flags.DEFINE_enum(
    "library_log_level", "warning", ["debug", "info", "warning", "error"],
    "Lowest level of the log lines of the libraries rlax_pipe uses (orbax) that are shown.")


def define_rl_flags(flag_values: flags.FlagValues = flags.FLAGS,
                    sys_argv: list[str] | None = None, preset: str = "default"):
  """`--config` of the RL family (default preset `preset`) plus the removed flags of
  rl_flags.py; returns the holder."""
  holder = define_config("pipeline_rl", "The RL run (ml_collections config file).",
                         rl_field_lines(), flag_values, sys_argv, preset)
  define_removed_flags(RL_RENAMED, flag_values)
  return holder
