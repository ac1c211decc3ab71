"""A run directory as the record of one run: fresh starts, resumes, and configuration changes.

Rules (`prepare_run_dir`, `check_changes`):
- A fresh run (resume=False) refuses a directory that holds checkpoints (continue it with
  resume, or choose another run_dir) and removes the records of an earlier attempt that never
  checkpointed, so metrics.jsonl / TensorBoard / timeline never hold two attempts.
- A resume needs a checkpoint: a directory without one is an error (usually a mistyped run_dir),
  never a silent fresh start.
- A resume runs with the saved configuration: a field that differs is refused unless
  `RunConfig.change_on_resume` names it (which says how it is recorded) or it is a `FREE_FIELDS`.
- The records of steps after the restored checkpoint are dropped (`record_resume`).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping

from absl import logging

from rlax_pipe.config_dict import ConfigError
from rlax_pipe.run_dir import RunDir, flatten, to_jsonable

# Fields that say where and how to resume, not what the run does.
FREE_FIELDS: tuple[str, ...] = ("run_dir", "resume", "change_on_resume")


def check_changes(saved: Mapping[str, Any], cfg, *, source: str) -> dict[str, tuple[Any, Any]]:
  """The changes of `cfg` against the `saved` configuration, refused unless named.

  Args:
    saved: the saved configuration (a JSON-like dict, `run_dir.to_jsonable` of a RunConfig).
    cfg: the RunConfig of this session.
    source: where `saved` was read (for the message).

  Returns:
    The allowed changes {dotted field path: (saved value, given value)}: every field that
    differs (tuples and lists compare equal), the `FREE_FIELDS` left out.

  Raises:
    ConfigError: listing every change not named in `change_on_resume`, with the fix.
  """
  before, after = flatten(to_jsonable(dict(saved))), flatten(to_jsonable(cfg))
  changes = {p: (before.get(p), after.get(p)) for p in sorted(set(before) | set(after))
             if p.split(".")[0] not in FREE_FIELDS and before.get(p) != after.get(p)}
  refused = {p: v for p, v in changes.items()
             if not any(p == a or p.startswith(a + ".") for a in cfg.change_on_resume)}
  if refused:
    listing = "; ".join(f"RunConfig.{p}: saved {b!r}, now {a!r}" for p, (b, a) in refused.items())
    raise ConfigError(
        f"resume of {cfg.run_dir} with settings that differ from the run's saved configuration "
        f"({source}): {listing}. A resumed run keeps its configuration: drop these settings, or "
        f"name them to change them from this step on (RunConfig.change_on_resume; on the "
        f"command line --config.change_on_resume={','.join(refused)}).")
  return changes


def prepare_run_dir(cfg) -> RunDir:
  """Opens `cfg.run_dir` for a fresh run or a resume (module docstring).

  Raises:
    ConfigError: a run directory that cannot be created (a missing parent one cannot create,
      no permission, a file of that name); a fresh run in a directory with checkpoints; a resume
      without a checkpoint; a resume whose settings differ from config.json without being named.
  """
  try:
    rd = RunDir(cfg.run_dir)
  except OSError as e:
    raise ConfigError(f"RunConfig.run_dir={cfg.run_dir!r} cannot be created ({e.strerror or e}); "
                      "choose a writable directory (--config.run_dir).") from None
  if not cfg.resume:
    if rd.has_checkpoint():
      raise ConfigError(
          f"RunConfig.run_dir={cfg.run_dir!r} already holds checkpoints of an earlier run: set "
          "RunConfig.resume (--config.resume) to continue it, or choose a new run_dir "
          "(--config.run_dir).")
    removed = rd.reset_records()
    if removed:
      logging.warning("run dir %s: removed the records of an earlier attempt that left no "
                      "checkpoint: %s", rd.path, ", ".join(removed))
    return rd
  if not rd.has_checkpoint():
    raise ConfigError(
        f"RunConfig.resume: RunConfig.run_dir={cfg.run_dir!r} holds no checkpoint, so there is "
        "nothing to resume (a mistyped --config.run_dir?). To start a new run there, drop "
        "--config.resume.")
  saved = rd.read_config()
  if saved is not None:
    check_changes(saved, cfg, source=str(rd.path / "config.json"))
  return rd


def record_resume(rd: RunDir, cfg, step: int, saved: Mapping[str, Any] | None) -> None:
  """After restoring checkpoint `step`: checks `cfg` against the configuration saved with that
  checkpoint, drops the records of later steps, records the allowed changes, writes config.json.

  Raises:
    ConfigError: as `check_changes`.
  """
  changes = check_changes(saved, cfg, source=f"checkpoint step {step}") if saved else {}
  rd.truncate_records(step)
  if changes:
    rd.record_changes(step, changes)
    for path, (before, after) in changes.items():
      logging.warning("resume at step %d: %s changed from %r to %r (recorded in %s).", step, path,
                      before, after, rd.path / "config_changes.jsonl")
  rd.write_config(cfg)


def merge_saved(saved: Mapping[str, Any], given: Mapping[str, Any],
                paths: Iterable[str]) -> dict:
  """The saved configuration with the values of `paths` taken from `given`.

  Args:
    saved: config.json of the run (dict).
    given: this command line's configuration (nested dict, e.g. `ConfigDict.to_dict()`).
    paths: dotted paths the command line sets explicitly (e.g. "pipeline.num_steps").

  Returns:
    A nested dict for `config_dict.from_config_dict(RunConfig, ...)`; resume is True.
  """
  out = copy.deepcopy(dict(saved))
  for path in paths:
    keys = path.split(".")
    value: Any = given
    for key in keys:
      value = value.get(key) if isinstance(value, Mapping) else None
    node = out
    for key in keys[:-1]:
      if not isinstance(node.get(key), dict):
        node[key] = {}
      node = node[key]
    node[keys[-1]] = to_jsonable(value)
  out["resume"] = True
  return out
