"""A run directory: config, metrics.jsonl, TensorBoard events, timeline, checkpoints, plots.

Layout:
  config.json          the full run configuration (dataclasses as dicts)
  metrics.jsonl        one JSON object per learner step (and one per evaluation)
  tb/                  TensorBoard event files (scalars of every metrics row)
  timeline.jsonl       spans of every mesh (see rlax_pipe.timeline)
  gantt.png, reward.png, lag_hist.png, idle.png   plots (rlax_pipe.plots)
  checkpoints/         orbax checkpoints of the learner (+ pipeline state)
  pipeline_state/<step>/  host state of the other components at that checkpoint (state.json +
                       arrays.npz), for exact resumes of reproducible runs

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
from typing import Any

import numpy as np


def to_jsonable(x: Any) -> Any:
  """Converts dataclasses, numpy arrays/scalars and tuples into plain JSON types."""
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return {f.name: to_jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
  if isinstance(x, dict):
    return {str(k): to_jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [to_jsonable(v) for v in x]
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, np.generic):
    return x.item()
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


class RunDir:
  """Writes the files of one run (append-only metrics; resumable)."""

  def __init__(self, path: str | pathlib.Path):
    self.path = pathlib.Path(path)
    self.path.mkdir(parents=True, exist_ok=True)
    self._tb = None

  @property
  def checkpoint_dir(self) -> str:
    return str(self.path / "checkpoints")

  def write_config(self, config: Any) -> None:
    (self.path / "config.json").write_text(json.dumps(to_jsonable(config), indent=2))

  def _writer(self):
    if self._tb is None:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(str(self.path / "tb"))
    return self._tb

  def log(self, row: dict, step: int) -> None:
    """Appends one metrics row to metrics.jsonl and its finite scalars to TensorBoard."""
    row = to_jsonable(row)
    with open(self.path / "metrics.jsonl", "a") as f:
      f.write(json.dumps(row) + "\n")
    writer = self._writer()
    for k, v in row.items():
      if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v):
        writer.add_scalar(k, v, step)
    writer.flush()

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
