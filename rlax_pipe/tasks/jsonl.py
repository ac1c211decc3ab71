"""Users' own problems from JSON Lines files, graded by answer equivalence.

File format: one JSON object per line, UTF-8. Blank lines are skipped. Keys:
  "prompt"     (required, non-empty string) the text the policy is conditioned on;
  "answer"     (required, string or number) the reference answer; a number is kept exactly as
               written in the file ("2.50" stays "2.50", never rewritten through float);
  "solution"   (optional string) a reference completion; default "A: <answer>";
  "difficulty" (optional number) default 0.0.
Other keys are ignored. Any other deviation raises `JsonlFormatError` naming the file, the line
number (1-based) and what is wrong.

Verifier: the answer of a completion is the text after the first "A:" that starts a token
(`answers.extract_marked_answer`), up to the end of that line, if there is one, else its last
non-empty line. It matches the reference under
`JsonlConfig.grader` (`answers.answers_match`; default "numeric": numbers compared as numbers,
`72.0` == `72`, `1e3` == `1000`, other text by normalized exact match): reward 1.0, else 0.0.

Splits and shuffling: `records.RecordTask` (with `eval_path` the file at `path` is "train" and
`eval_path` is "eval"; without it the lines of `path` are partitioned by prompt hash).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib

from rlax_pipe.tasks import answers
from rlax_pipe.tasks import base
from rlax_pipe.tasks import records as records_lib


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
    grader: answer equivalence, one of `answers.GRADERS` ("exact", "numeric", "math_verify").
  """

  path: str | os.PathLike[str]
  eval_path: str | os.PathLike[str] | None = None
  eval_fraction: float = 0.1
  seed: int = 0
  grader: str = "numeric"

  def __post_init__(self):
    if not 0.0 <= self.eval_fraction <= 1.0:
      raise ValueError(f"JsonlConfig.eval_fraction={self.eval_fraction} must be in [0, 1].")
    if self.seed < 0:
      raise ValueError(f"JsonlConfig.seed={self.seed} must be >= 0.")
    if self.grader not in answers.GRADERS:
      raise ValueError(f"JsonlConfig.grader={self.grader!r}; choose one of {answers.GRADERS}.")


def normalize_answer(text: str) -> str:
  """Strip, collapse whitespace runs to one space, case-fold, strip trailing periods.

  Example: normalize_answer("  The  Eiffel\\tTower. ") == "the eiffel tower".
  """
  return answers.normalize_text(text)


def extract_answer(completion: str) -> str:
  """The answer part of a completion: after the first "A:" that starts a token, to the end of its
  line; else the last non-empty line."""
  marked = base.extract_marked_answer(completion)
  if marked is not None:
    return marked
  lines = [line for line in completion.split("\n") if line.strip()]
  return lines[-1] if lines else ""


class NumberText(str):
  """A JSON number kept as the text it was written as (json.loads parse_int/parse_float hook)."""


def load_json_keeping_numbers(text: str):
  """`json.loads` with every number (and NaN / Infinity) returned as its `NumberText`."""
  return json.loads(text, parse_int=NumberText, parse_float=NumberText,
                    parse_constant=NumberText)


def _fail(path: pathlib.Path, line_no: int, what: str) -> JsonlFormatError:
  return JsonlFormatError(f"{path}:{line_no}: {what}")


def _parse_line(path: pathlib.Path, line_no: int, line: str) -> records_lib.Record:
  """One validated record from one line."""
  try:
    obj = load_json_keeping_numbers(line)
  except json.JSONDecodeError as e:
    raise _fail(path, line_no, f"invalid JSON ({e.msg} at column {e.colno}).") from e
  if not isinstance(obj, dict):
    raise _fail(path, line_no, f"expected a JSON object, got {type(obj).__name__}.")
  for key in ("prompt", "answer"):
    if key not in obj:
      raise _fail(path, line_no, f"missing required key {key!r} (keys: {sorted(obj)}).")
  prompt, answer = obj["prompt"], obj["answer"]
  if type(prompt) is not str or not prompt.strip():  # pylint: disable=unidiomatic-typecheck
    raise _fail(path, line_no, f"'prompt' must be a non-empty string, got {prompt!r}.")
  if not isinstance(answer, str):  # a JSON string or a NumberText
    raise _fail(path, line_no, f"'answer' must be a string or a number, got {answer!r}.")
  answer = str(answer)
  if not normalize_answer(answer):
    raise _fail(path, line_no, f"'answer' {answer!r} is empty after normalization.")
  solution = obj.get("solution", answers.format_answer(answer, "marker"))
  if type(solution) is not str:  # pylint: disable=unidiomatic-typecheck
    raise _fail(path, line_no, f"'solution' must be a string, got {solution!r}.")
  difficulty = obj.get("difficulty", NumberText("0"))
  if not isinstance(difficulty, NumberText) or not math.isfinite(float(difficulty)):
    raise _fail(path, line_no, f"'difficulty' must be a finite number, got {difficulty!r}.")
  return records_lib.Record(prompt=prompt, answer=answer, solution=solution,
                            difficulty=float(difficulty))


def read_jsonl_problems(path: str | os.PathLike[str]) -> list[records_lib.Record]:
  """Reads and validates a JSONL task file.

  Args:
    path: the file.

  Returns:
    One `records.Record` per non-blank line, in file order (answers as written).

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


class JsonlTask(records_lib.RecordTask):
  """Problems from JSONL files, graded by answer equivalence; implements `base.Task`.

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
    recs = read_jsonl_problems(config.path)
    if config.eval_path is not None:
      by_split = {"train": recs, "eval": read_jsonl_problems(config.eval_path)}
    else:
      by_split = records_lib.split_records(recs, config.eval_fraction)
    super().__init__(by_split, seed=config.seed, source=str(config.path),
                     empty_hint=f"(eval_fraction={config.eval_fraction}); add lines, change "
                     "eval_fraction, or pass eval_path.")

  def reward(self, problem: base.Problem, completion: str) -> float:
    """1.0 iff `extract_answer(completion)` matches `problem.answer` under `config.grader`."""
    got = extract_answer(completion)
    return 1.0 if answers.answers_match(got, problem.answer, self.config.grader) else 0.0
