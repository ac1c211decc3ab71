"""The single list of task names a flag may pick, and the factory behind it."""

from __future__ import annotations

from rlax_pipe.tasks import arithmetic
from rlax_pipe.tasks import base
from rlax_pipe.tasks import jsonl

TASKS = {
    "arithmetic": (arithmetic.ArithmeticTask, arithmetic.ArithmeticConfig),
    "jsonl": (jsonl.JsonlTask, jsonl.JsonlConfig),
}


def make_task(name: str, config: arithmetic.ArithmeticConfig | jsonl.JsonlConfig | None = None
              ) -> base.Task:
  """Builds the task registered as `name` from its config.

  Args:
    name: one of `TASKS` ("arithmetic", "jsonl").
    config: the task's config dataclass; None means the default config (arithmetic only, since a
      JSONL task needs a path).

  Returns:
    The task.

  Raises:
    ValueError: for an unknown name (the message lists the choices) or a missing JSONL config.
    TypeError: when `config` is not the config class of `name`.
  """
  if name not in TASKS:
    raise ValueError(f"Unknown task {name!r}; choose one of {sorted(TASKS)}.")
  task_cls, config_cls = TASKS[name]
  if config is None:
    if config_cls is jsonl.JsonlConfig:
      raise ValueError("Task 'jsonl' needs a JsonlConfig with the path of the problems file.")
    config = config_cls()
  if not isinstance(config, config_cls):
    raise TypeError(f"Task {name!r} takes a {config_cls.__name__}, got {type(config).__name__}.")
  return task_cls(config)
