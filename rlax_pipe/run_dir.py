"""A run directory: config, metrics.jsonl, TensorBoard events, timeline, checkpoints, plots.

Layout:
  config.json          the run configuration as given (dataclasses as dicts); on resume, the one
                       in effect (saved configuration + the changes named in change_on_resume)
  config_changes.jsonl one row per setting changed on resume: step it took effect, field, before,
                       after
  run_info.json        what the job resolved: device split and mesh shapes, stop ids, tokenizer
  metrics.jsonl        one JSON object per learner step (and one per evaluation)
  tb/                  TensorBoard event files (scalars of every metrics row)
  timeline.jsonl       spans of every mesh (see rlax_pipe.timeline)
  gantt.png, reward_accuracy.png, lag_hist.png, idle.png   plots (rlax_pipe.plots)
  summary.json         the run summary (also the entry point's last output line)
  checkpoints/         orbax checkpoints of the learner (+ pipeline state)
  pipeline_state/<step>/  host state of the other components at that checkpoint (state.json +
                       arrays.npz), for exact resumes of reproducible runs
  hf/                  the trained policy as an HF model directory (RunConfig.export_hf)

The directory is a record of one run: a fresh start in a directory without checkpoints removes
the records of earlier attempts (`reset_records`), and a resume from checkpoint step k drops
every record of steps after k (`truncate_records`: metrics rows, TensorBoard events rebuilt from
the kept rows, config changes, end-of-run files), so no record ever mixes two attempts.

Component state (`state_dict()` of engine, scheduler, queue, worker, ...) is a tree of dicts and
lists whose leaves are JSON values or numpy arrays; `save_state` writes it as JSON + one npz
without pickle, `load_state` reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import pathlib
import shutil
import uuid
from typing import Any

import numpy as np


def to_jsonable(x: Any, strict: bool = False) -> Any:
  """Converts dataclasses, numpy arrays/scalars and tuples into plain JSON types.

  strict=True also replaces every non-finite float (nan, inf) by None, so that
  `json.dumps(..., allow_nan=False)` writes strict JSON (`null`, not `NaN`).
  """
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return {f.name: to_jsonable(getattr(x, f.name), strict) for f in dataclasses.fields(x)}
  if isinstance(x, dict):
    return {str(k): to_jsonable(v, strict) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [to_jsonable(v, strict) for v in x]
  if isinstance(x, np.ndarray):
    return to_jsonable(x.tolist(), strict) if strict else x.tolist()
  if isinstance(x, np.generic):
    x = x.item()
  if strict and isinstance(x, float) and not math.isfinite(x):
    return None
  return x


_ARRAY_KEY = "__array__"


def split_arrays(state: Any) -> tuple[Any, dict[str, np.ndarray]]:
  """(JSON-able tree, {name: array}): each numpy array leaf becomes {"__array__": name}."""
  arrays: dict[str, np.ndarray] = {}

  def walk(x, path):
    if isinstance(x, np.ndarray):
      arrays[path] = x
      return {_ARRAY_KEY: path}
    if isinstance(x, dict):
      return {str(k): walk(v, f"{path}/{k}") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [walk(v, f"{path}/{i}") for i, v in enumerate(x)]
    return to_jsonable(x)

  return walk(state, "state"), arrays


def join_arrays(tree: Any, arrays: dict[str, np.ndarray]) -> Any:
  """Inverse of `split_arrays`."""
  if isinstance(tree, dict):
    if set(tree) == {_ARRAY_KEY}:
      return arrays[tree[_ARRAY_KEY]]
    return {k: join_arrays(v, arrays) for k, v in tree.items()}
  if isinstance(tree, list):
    return [join_arrays(v, arrays) for v in tree]
  return tree


def save_state(directory: str | pathlib.Path, state: Any) -> None:
  """Writes `state` atomically as directory/state.json + arrays.npz (complete or absent)."""
  final = pathlib.Path(directory)
  tmp = final.with_name(final.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  tree, arrays = split_arrays(state)
  np.savez(tmp / "arrays.npz", **arrays)
  (tmp / "state.json").write_text(json.dumps(tree))
  if final.exists():
    shutil.rmtree(final)
  tmp.rename(final)


def load_state(directory: str | pathlib.Path) -> Any | None:
  """The state `save_state` wrote to `directory`, or None if there is none."""
  d = pathlib.Path(directory)
  if not (d / "state.json").exists():
    return None
  with np.load(d / "arrays.npz") as z:
    arrays = {k: z[k] for k in z.files}
  return join_arrays(json.loads((d / "state.json").read_text()), arrays)


def read_metrics(run_dir: str | pathlib.Path) -> list[dict]:
  """The rows of `run_dir/metrics.jsonl` (empty if the run has not logged anything yet)."""
  p = pathlib.Path(run_dir) / "metrics.jsonl"
  if not p.exists():
    return []
  return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


# Files written at the end of a run (or per session), removed when a record is reset/truncated.
# timeline.jsonl is not one: it is appended as the run goes and a resume truncates it to the
# checkpoint's span count (`Timeline.load_state_dict`); a fresh start removes it.
END_FILES = ("summary.json", "gantt.png", "reward_accuracy.png", "lag_hist.png", "idle.png",
             "run_info.json")
CHANGES_FILE = "config_changes.jsonl"


def read_config(run_dir: str | pathlib.Path) -> dict | None:
  """The configuration saved in `run_dir/config.json` (a dict), or None if there is none."""
  p = pathlib.Path(run_dir) / "config.json"
  return json.loads(p.read_text()) if p.exists() else None


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """{dotted path: leaf} of nested dicts (lists and other values are leaves)."""
  if isinstance(tree, dict) and tree:
    out = {}
    for k, v in tree.items():
      out.update(flatten(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


class RunDir:
  """Writes the files of one run (append-only metrics; resumable)."""

  def __init__(self, path: str | pathlib.Path):
    self.path = pathlib.Path(path)
    self.path.mkdir(parents=True, exist_ok=True)
    self._tb = None

  @property
  def checkpoint_dir(self) -> str:
    return str(self.path / "checkpoints")

  def has_checkpoint(self) -> bool:
    """Whether checkpoints/ holds at least one checkpoint step directory."""
    ckpts = self.path / "checkpoints"
    return ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())

  def write_config(self, config: Any) -> None:
    (self.path / "config.json").write_text(json.dumps(to_jsonable(config), indent=2))

  def read_config(self) -> dict | None:
    return read_config(self.path)

  def write_json(self, name: str, obj: Any) -> None:
    (self.path / name).write_text(json.dumps(to_jsonable(obj), indent=2))

  def reset_records(self) -> list[str]:
    """Removes the records of an earlier attempt that left no checkpoint (a fresh start).

    Returns:
      The names removed (for the log).
    """
    self.close()
    removed = []
    for name in ("metrics.jsonl", CHANGES_FILE, "config.json", "timeline.jsonl") + END_FILES:
      if (self.path / name).exists():
        (self.path / name).unlink()
        removed.append(name)
    for name in ("tb", "pipeline_state", "hf"):
      if (self.path / name).exists():
        shutil.rmtree(self.path / name)
        removed.append(name + "/")
    return removed

  def truncate_records(self, step: int) -> None:
    """Drops every record of steps after checkpoint step `step` (a resume from it).

    metrics.jsonl keeps rows with step <= `step`; TensorBoard events are rebuilt from them;
    config_changes.jsonl keeps rows of steps before `step` (a change at `step` is re-decided by
    this session); pipeline-state directories of later steps and end-of-run files go.
    """
    self.truncate_metrics(step)
    changes = self.path / CHANGES_FILE
    if changes.exists():
      rows = [json.loads(l) for l in changes.read_text().splitlines() if l.strip()]
      changes.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] < step))
    state = self.path / "pipeline_state"
    if state.is_dir():
      for p in state.iterdir():
        if not (p.name.isdigit() and int(p.name) <= step):
          shutil.rmtree(p, ignore_errors=True)
    for name in END_FILES:
      if (self.path / name).exists():
        (self.path / name).unlink()
    shutil.rmtree(self.path / "hf", ignore_errors=True)
    self.rebuild_tensorboard()

  def rebuild_tensorboard(self) -> None:
    """Rewrites tb/ from metrics.jsonl (so TensorBoard shows exactly the kept rows)."""
    self.close()
    shutil.rmtree(self.path / "tb", ignore_errors=True)
    rows = self.read_metrics()
    if not rows:
      return
    writer = self._writer()
    for row in rows:
      self._add_scalars(writer, row, int(row.get("step", 0)))
    writer.flush()

  def record_changes(self, step: int, changes: dict[str, tuple[Any, Any]]) -> None:
    """Appends one config_changes.jsonl row per changed field (effective from `step`)."""
    with open(self.path / CHANGES_FILE, "a") as f:
      for field, (before, after) in sorted(changes.items()):
        f.write(json.dumps({"step": step, "field": field, "before": before, "after": after})
                + "\n")

  def read_changes(self) -> list[dict]:
    p = self.path / CHANGES_FILE
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []

  def _writer(self):
    if self._tb is None:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      # tensorboardX names the file events.out.tfevents.<unix seconds>.<host>: a second writer
      # opened in the same second on this directory (a resume, a rebuild, a test) would reopen
      # the first one's file and truncate its events (issue #27 item 7). A random suffix makes
      # every writer's file its own.
      self._tb = SummaryWriter(str(self.path / "tb"),
                               filename_suffix=f".{uuid.uuid4().hex}")
    return self._tb

  def log(self, row: dict, step: int) -> None:
    """Appends one metrics row to metrics.jsonl and its finite scalars to TensorBoard."""
    row = to_jsonable(row)
    with open(self.path / "metrics.jsonl", "a") as f:
      f.write(json.dumps(row) + "\n")
    writer = self._writer()
    self._add_scalars(writer, row, step)
    writer.flush()

  @staticmethod
  def _add_scalars(writer, row: dict, step: int) -> None:
    """TensorBoard tag "<kind>/<key>" per finite number of the row (eval and train apart)."""
    kind = row.get("kind", "train")
    for k, v in row.items():
      if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v):
        writer.add_scalar(f"{kind}/{k}", v, step)

  def read_metrics(self) -> list[dict]:
    return read_metrics(self.path)

  def truncate_metrics(self, after_step: int) -> None:
    """Drops rows logged after `after_step` (used on resume from an older checkpoint)."""
    rows = [r for r in self.read_metrics() if r.get("step", 0) <= after_step]
    (self.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None
