"""The single list of task names a flag may pick, and the factory behind it."""

from __future__ import annotations

from typing import Any

from rlax_pipe.tasks import arithmetic
from rlax_pipe.tasks import base
from rlax_pipe.tasks import calculator
from rlax_pipe.tasks import dataset_file
from rlax_pipe.tasks import gym
from rlax_pipe.tasks import jsonl

TASKS = {
    "arithmetic": (arithmetic.ArithmeticTask, arithmetic.ArithmeticConfig),
    # multi-turn: the arithmetic task with a calculator tool (`rlax_pipe.envs`)
    "arithmetic_calculator": (calculator.CalculatorArithmeticTask, arithmetic.ArithmeticConfig),
    "jsonl": (jsonl.JsonlTask, jsonl.JsonlConfig),
    "dataset_file": (dataset_file.DatasetFileTask, dataset_file.DatasetFileConfig),
    "reasoning_gym": (gym.ReasoningGymTask, gym.ReasoningGymConfig),
}
# Tasks whose config has no usable default (it names the user's file).
_NEEDS_CONFIG = {"jsonl": "a JsonlConfig with the path of the problems file",
                 "dataset_file": "a DatasetFileConfig with the path of the dataset file"}


def make_task(name: str, config: Any = None) -> base.Task:
  """Builds the task registered as `name` from its config.

  Args:
    name: one of `TASKS` ("arithmetic", "arithmetic_calculator", "jsonl", "dataset_file",
      "reasoning_gym").
    config: the task's config dataclass; None means the default config (not for the file tasks,
      which need a path).

  Returns:
    The task.

  Raises:
    ValueError: for an unknown name (the message lists the choices) or a missing file config.
    ImportError: for "reasoning_gym" without the gym extra.
    TypeError: when `config` is not the config class of `name`.
  """
  if name not in TASKS:
    raise ValueError(f"Unknown task {name!r}; choose one of {sorted(TASKS)}.")
  task_cls, config_cls = TASKS[name]
  if config is None:
    if name in _NEEDS_CONFIG:
      raise ValueError(f"Task {name!r} needs {_NEEDS_CONFIG[name]}.")
    config = config_cls()
  if not isinstance(config, config_cls):
    raise TypeError(f"Task {name!r} takes a {config_cls.__name__}, got {type(config).__name__}.")
  return task_cls(config)
