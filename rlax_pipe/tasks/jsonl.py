"""Users' own problems from JSON Lines files, graded by normalized exact match.

File format: one JSON object per line, UTF-8. Blank lines are skipped. Keys:
  "prompt"     (required, non-empty string) the text the policy is conditioned on;
  "answer"     (required, string or number; numbers are converted with str()) the reference answer;
  "solution"   (optional string) a reference completion; default "A: <answer>";
  "difficulty" (optional number) default 0.0.
Other keys are ignored. Any other deviation raises `JsonlFormatError` naming the file, the line
number (1-based) and what is wrong.

Verifier: the answer of a completion is the text after the first "A:" up to the end of that line
if the completion contains "A:", else its last non-empty line. Both it and the reference go through
`normalize_answer` (strip, collapse whitespace runs to one space, case-fold, strip trailing
periods) and must then be equal: reward 1.0, else 0.0.

Splits: with `eval_path` the file at `path` is "train" and `eval_path` is "eval"; without it the
lines of `path` are partitioned by `base.split_of(prompt, eval_fraction)`. Index i of a split
addresses epoch i // N, position i % N of a per-epoch permutation seeded by (seed, split, epoch).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re

import numpy as np

from rlax_pipe.tasks import base

_WHITESPACE = re.compile(r"\s+")


class JsonlFormatError(ValueError):
  """A malformed JSONL task file; the message names the file and the 1-based line number."""


@dataclasses.dataclass(frozen=True)
class JsonlConfig:
  """Where the problems are and how they are split.

  Attributes:
    path: JSONL file of problems (the whole "train" split when `eval_path` is set).
    eval_path: optional JSONL file holding the "eval" split.
    eval_fraction: without `eval_path`, share of prompts held out as "eval" (by prompt hash),
      in [0, 1].
    seed: seed of the per-epoch shuffles (int >= 0).
  """

  path: str | os.PathLike[str]
  eval_path: str | os.PathLike[str] | None = None
  eval_fraction: float = 0.1
  seed: int = 0

  def __post_init__(self):
    if not 0.0 <= self.eval_fraction <= 1.0:
      raise ValueError(f"JsonlConfig.eval_fraction={self.eval_fraction} must be in [0, 1].")
    if self.seed < 0:
      raise ValueError(f"JsonlConfig.seed={self.seed} must be >= 0.")


def normalize_answer(text: str) -> str:
  """Strip, collapse whitespace runs to one space, case-fold, strip trailing periods.

  Example: normalize_answer("  The  Eiffel\\tTower. ") == "the eiffel tower".
  """
  text = _WHITESPACE.sub(" ", text).strip().casefold()
  return text.rstrip(".").rstrip()


def extract_answer(completion: str) -> str:
  """The answer part of a completion: after the first "A:" on its line, else the last non-empty line."""
  marked = base.extract_marked_answer(completion)
  if marked is not None:
    return marked
  lines = [line for line in completion.split("\n") if line.strip()]
  return lines[-1] if lines else ""


def _fail(path: pathlib.Path, line_no: int, what: str) -> JsonlFormatError:
  return JsonlFormatError(f"{path}:{line_no}: {what}")


def _parse_line(path: pathlib.Path, line_no: int, line: str) -> dict:
  """One validated record {"prompt", "answer", "solution", "difficulty"} from one line."""
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    raise _fail(path, line_no, f"invalid JSON ({e.msg} at column {e.colno}).") from e
  if not isinstance(obj, dict):
    raise _fail(path, line_no, f"expected a JSON object, got {type(obj).__name__}.")
  for key in ("prompt", "answer"):
    if key not in obj:
      raise _fail(path, line_no, f"missing required key {key!r} (keys: {sorted(obj)}).")
  prompt, answer = obj["prompt"], obj["answer"]
  if not isinstance(prompt, str) or not prompt.strip():
    raise _fail(path, line_no, f"'prompt' must be a non-empty string, got {prompt!r}.")
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
    raise _fail(path, line_no, f"'answer' must be a string or a number, got {answer!r}.")
  answer = str(answer)
  if not normalize_answer(answer):
    raise _fail(path, line_no, f"'answer' {answer!r} is empty after normalization.")
  solution = obj.get("solution", f"{base.ANSWER_MARKER} {answer}")
  if not isinstance(solution, str):
    raise _fail(path, line_no, f"'solution' must be a string, got {solution!r}.")
  difficulty = obj.get("difficulty", 0.0)
  if (isinstance(difficulty, bool) or not isinstance(difficulty, (int, float))
      or not math.isfinite(difficulty)):
    raise _fail(path, line_no, f"'difficulty' must be a finite number, got {difficulty!r}.")
  return {"prompt": prompt, "answer": answer, "solution": solution,
          "difficulty": float(difficulty)}


def read_jsonl_problems(path: str | os.PathLike[str]) -> list[dict]:
  """Reads and validates a JSONL task file.

  Args:
    path: the file.

  Returns:
    One dict {"prompt": str, "answer": str, "solution": str, "difficulty": float} per non-blank
    line, in file order.

  Raises:
    FileNotFoundError: when the file does not exist.
    JsonlFormatError: on a malformed line ("<path>:<line>: <what is wrong>"), invalid UTF-8, or a
      file without any problem.
  """
  path = pathlib.Path(path)
  records = []
  with path.open("rb") as f:
    for line_no, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise _fail(path, line_no, f"not valid UTF-8 ({e.reason}).") from e
      if line.strip():
        records.append(_parse_line(path, line_no, line))
  if not records:
    raise JsonlFormatError(f"{path}: no problems (the file is empty or blank).")
  return records


class JsonlTask:
  """Problems from JSONL files with a normalized exact-match verifier; implements `base.Task`.

  Example:
    >>> task = JsonlTask(JsonlConfig(path="qa.jsonl", eval_fraction=0.2))
    >>> p = task.problem(0)
    >>> task.reward(p, "Let me think.\\nA: " + p.answer.upper())
    1.0
  """

  name = "jsonl"

  def __init__(self, config: JsonlConfig):
    """Reads and validates the file(s); raises like `read_jsonl_problems`."""
    self.config = config
    records = read_jsonl_problems(config.path)
    if config.eval_path is not None:
      self._records = {"train": records, "eval": read_jsonl_problems(config.eval_path)}
    else:
      self._records = {s: [r for r in records
                           if base.split_of(r["prompt"], config.eval_fraction) == s]
                       for s in base.SPLITS}
    self._perm_cache: dict[tuple[str, int], np.ndarray] = {}

  def num_problems(self, split: str = "train") -> int:
    """Number of problems (lines) in `split`; may be 0 for a small file and a small eval_fraction."""
    base.check_split(split)
    return len(self._records[split])

  def _permutation(self, split: str, epoch: int) -> np.ndarray:
    key = (split, epoch)
    perm = self._perm_cache.get(key)
    if perm is None:
      rng = np.random.default_rng([self.config.seed, base.SPLITS.index(split), epoch])
      perm = rng.permutation(len(self._records[split]))
      self._perm_cache = {key: perm}  # Keep one epoch: streams read epochs in order.
    return perm

  def problem(self, index: int, split: str = "train") -> base.Problem:
    """The problem at stream position `index` of `split` (shuffled per epoch, see module doc).

    Raises:
      ValueError: on a bad index or split, or when `split` holds no problem.
    """
    base.check_index(index)
    base.check_split(split)
    size = len(self._records[split])
    if not size:
      raise ValueError(f"Split {split!r} of {self.config.path} is empty (eval_fraction="
                       f"{self.config.eval_fraction}); add lines, change eval_fraction, or pass "
                       "eval_path.")
    epoch, pos = divmod(int(index), size)
    r = self._records[split][int(self._permutation(split, epoch)[pos])]
    return base.Problem(index=int(index), split=split, prompt=r["prompt"], answer=r["answer"],
                        solution=r["solution"], difficulty=r["difficulty"])

  def sample_prompts(self, rng: np.random.Generator, n: int,
                     split: str = "train") -> list[base.Problem]:
    """`n` problems drawn uniformly with replacement from `split` using `rng`."""
    if n < 0:
      raise ValueError(f"n={n} must be >= 0.")
    size = self.num_problems(split)
    if not size:
      raise ValueError(f"Split {split!r} of {self.config.path} is empty.")
    return [self.problem(int(i), split) for i in rng.integers(0, size, size=n)]

  def reward(self, problem: base.Problem, completion: str) -> float:
    """1.0 iff normalize_answer(extract_answer(completion)) == normalize_answer(problem.answer)."""
    got = normalize_answer(extract_answer(completion))
    return 1.0 if got == normalize_answer(problem.answer) else 0.0
