"""Problems from dataset files people already have: JSONL / JSON, Parquet or CSV, local only.

Reading (never the hub; `file_format` "auto" goes by the extension):

- Parquet and CSV through the `datasets` library's packaged builders (`Dataset.from_parquet`,
  `Dataset.from_csv`), in memory, with a throw-away cache directory. CSV columns are read as text
  (every column typed `string`, "NA" kept as text), so an answer is kept exactly as written.
  Parquet keeps the file's own types; a numeric answer column arrives as a number and is used as
  `str(value)`.
- JSONL / JSON (a JSON array of objects, or one object per line) with the standard library, every
  number kept as the text it was written as. (`datasets`' JSON builder parses numbers with
  pyarrow before any cast: measured with datasets 5.2.0, a reference `2.50` came back as "2.5" and
  `12345678901234567890` as "1.2345678901234567e+19", which would change what is graded.)

Each row gives a problem: the prompt is the `prompt_field` column as is, or `prompt_template`
formatted with the row's columns; the reference answer is read from the
`answer_field` column with `reference_format` ("auto": the content of a final `\\boxed{...}` or the
text after `####` if the column holds a worked solution as MATH and GSM8K do, else the whole
text, stripped). A completion's answer is read with `answer_format` (`answers.ANSWER_FORMATS`) and
matched with `grader` (`answers.answers_match`: numbers as numbers; "math_verify" optional).
The reference completion (`solution`, for SFT warm starts) is the answer column itself when it
holds a worked solution, else the answer stated in `answer_format`.

Example, GSM8K's own files (columns "question", "answer" = reasoning + "#### 72"):

    DatasetFileConfig(path="gsm8k/train.parquet", prompt_field="question",
                      prompt_template="{question}\\nGive the final answer after '####'.\\n")
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import pathlib
import string
import tempfile

from rlax_pipe.tasks import answers
from rlax_pipe.tasks import base
from rlax_pipe.tasks import jsonl
from rlax_pipe.tasks import records as records_lib

FILE_FORMATS: tuple[str, ...] = ("auto", "jsonl", "json", "parquet", "csv")
REFERENCE_FORMATS: tuple[str, ...] = ("auto", "plain", "gsm8k", "boxed")
_EXTENSIONS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetFileError(ValueError):
  """A dataset file that cannot be used; the message names the file (and row) and the fix."""


@dataclasses.dataclass(frozen=True)
class DatasetFileConfig:
  """Which file, which columns, how answers are written and graded.

  Attributes:
    path: the problems file (the whole "train" split when `eval_path` is set).
    eval_path: optional file of the "eval" split (same format and columns).
    eval_fraction: without `eval_path`, share of prompts held out as "eval" (by prompt hash),
      in [0, 1].
    file_format: one of `FILE_FORMATS`; "auto" = by extension (.jsonl, .json, .parquet, .csv).
    prompt_field: column holding the prompt text.
    answer_field: column holding the reference answer (or a worked solution ending in one).
    prompt_template: `str.format` template over the row's columns that makes the prompt, e.g.
      "Question: {question}\\nA:" ; "" = the `prompt_field` column as is.
    reference_format: how the reference is read out of `answer_field`: "plain" (whole text),
      "gsm8k" (after `####`), "boxed" (final `\\boxed{}`), "auto" (boxed, else gsm8k, else plain).
    answer_format: how a completion states its answer (`answers.ANSWER_FORMATS`).
    grader: answer equivalence (`answers.GRADERS`).
    seed: seed of the per-epoch shuffles (int >= 0).
  """

  path: str | os.PathLike[str]
  eval_path: str | os.PathLike[str] | None = None
  eval_fraction: float = 0.1
  file_format: str = "auto"
  prompt_field: str = "prompt"
  answer_field: str = "answer"
  prompt_template: str = ""
  reference_format: str = "auto"
  answer_format: str = "auto"
  grader: str = "numeric"
  seed: int = 0

  def __post_init__(self):
    for name, choices in (("file_format", FILE_FORMATS), ("reference_format", REFERENCE_FORMATS),
                          ("answer_format", answers.ANSWER_FORMATS),
                          ("grader", answers.GRADERS)):
      if getattr(self, name) not in choices:
        raise ValueError(f"DatasetFileConfig.{name}={getattr(self, name)!r}; choose one of "
                         f"{choices}.")
    if not 0.0 <= self.eval_fraction <= 1.0:
      raise ValueError(f"DatasetFileConfig.eval_fraction={self.eval_fraction} must be in [0, 1].")
    if self.seed < 0:
      raise ValueError(f"DatasetFileConfig.seed={self.seed} must be >= 0.")
    fields = {f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f}
    if self.prompt_template and not fields:
      raise ValueError(f"DatasetFileConfig.prompt_template={self.prompt_template!r} names no "
                       "column; write e.g. '{question}\\n'.")


def _file_format(path: pathlib.Path, file_format: str) -> str:
  if file_format != "auto":
    return file_format
  fmt = _EXTENSIONS.get(path.suffix.lower())
  if fmt is None:
    raise DatasetFileError(f"{path}: cannot tell the format from the extension {path.suffix!r}; "
                           f"use one of {sorted(_EXTENSIONS)} or set file_format.")
  return fmt


def _read_json_rows(path: pathlib.Path, fmt: str) -> list[dict]:
  text = path.read_text(encoding="utf-8")
  try:
    if fmt == "json" and text.lstrip().startswith("["):
      rows = jsonl.load_json_keeping_numbers(text)
    else:
      rows = [jsonl.load_json_keeping_numbers(line) for line in text.splitlines() if line.strip()]
  except json.JSONDecodeError as e:
    raise DatasetFileError(f"{path}: invalid JSON ({e.msg}, line {e.lineno}).") from e
  if not all(isinstance(r, dict) for r in rows):
    raise DatasetFileError(f"{path}: every row must be a JSON object.")
  return rows


def _read_with_datasets(path: pathlib.Path, fmt: str) -> list[dict]:
  try:
    import datasets  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"reading {fmt} files needs the datasets library: pip install -e "
                      "\".[data]\" (or pip install datasets).") from e
  with tempfile.TemporaryDirectory(prefix="rlax_pipe_datasets_") as cache:
    if fmt == "csv":
      with path.open(newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), None)
      if not header:
        raise DatasetFileError(f"{path}: empty CSV file (no header row).")
      features = datasets.Features({c: datasets.Value("string") for c in header})
      table = datasets.Dataset.from_csv(str(path), features=features, keep_default_na=False,
                                        keep_in_memory=True, cache_dir=cache)
    else:
      table = datasets.Dataset.from_parquet(str(path), keep_in_memory=True, cache_dir=cache)
    return table.to_list()


def read_rows(path: str | os.PathLike[str], file_format: str = "auto") -> list[dict]:
  """The rows of a local dataset file as dicts (see the module docstring for how).

  Raises:
    FileNotFoundError: when the file does not exist.
    DatasetFileError: on an unknown extension or malformed JSON.
    ImportError: for Parquet / CSV without the `datasets` library.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"dataset file not found: {path}")
  fmt = _file_format(path, file_format)
  if fmt in ("jsonl", "json"):
    return _read_json_rows(path, fmt)
  return _read_with_datasets(path, fmt)


def _cell_text(value) -> str | None:
  """A cell as text: strings as they are, finite numbers through str(); None otherwise."""
  if isinstance(value, str):
    return value
  if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
    return str(value)
  return None


def read_reference(text: str, reference_format: str) -> tuple[str, bool]:
  """(reference answer, whether `text` is a worked solution) read with `reference_format`."""
  if reference_format == "plain":
    return text.strip(), False
  order = ("boxed", "gsm8k") if reference_format == "auto" else (reference_format,)
  for fmt in order:
    found = answers.extract_answer(text, fmt)
    if found:
      return found, True
  if reference_format == "auto":
    return text.strip(), False
  raise ValueError(f"no {reference_format} answer in {text!r:.80}")


def rows_to_records(rows: list[dict], config: DatasetFileConfig,
                    source: pathlib.Path) -> list[records_lib.Record]:
  """Problems of `rows` under `config`; DatasetFileError naming the row (1-based) on bad input."""
  out = []
  for k, row in enumerate(rows, start=1):
    where = f"{source}: row {k}"
    for field in (config.prompt_field, config.answer_field):
      if field not in row:
        raise DatasetFileError(f"{where}: no column {field!r} (columns: {sorted(row)}); set "
                               "prompt_field / answer_field.")
    cells = {key: _cell_text(value) for key, value in row.items()}
    prompt = cells[config.prompt_field]
    if config.prompt_template:
      try:
        prompt = config.prompt_template.format(**{c: v or "" for c, v in cells.items()})
      except (KeyError, IndexError) as e:
        raise DatasetFileError(f"{where}: prompt_template names {e} which is not a column "
                               f"(columns: {sorted(row)}).") from e
    if not prompt or not prompt.strip():
      raise DatasetFileError(f"{where}: empty prompt in column {config.prompt_field!r}.")
    answer_text = cells[config.answer_field]
    if answer_text is None or not answer_text.strip():
      raise DatasetFileError(f"{where}: empty or non-text answer in column "
                             f"{config.answer_field!r}: {row[config.answer_field]!r}.")
    try:
      reference, worked = read_reference(answer_text, config.reference_format)
    except ValueError as e:
      raise DatasetFileError(f"{where}: {e}; check reference_format.") from e
    solution = answer_text if worked else answers.format_answer(reference, config.answer_format)
    out.append(records_lib.Record(prompt=prompt, answer=reference, solution=solution))
  if not out:
    raise DatasetFileError(f"{source}: no rows.")
  return out


class DatasetFileTask(records_lib.RecordTask):
  """Problems of a local JSONL / JSON / Parquet / CSV file; implements `base.Task`.

  Example:
    >>> task = DatasetFileTask(DatasetFileConfig(path="gsm8k.jsonl", prompt_field="question"))
    >>> p = task.problem(0)
    >>> task.reward(p, "... so she sold 72 clips.\\n#### 72")
    1.0
  """

  name = "dataset_file"

  def __init__(self, config: DatasetFileConfig):
    """Reads and validates the file(s); raises like `read_rows` and `rows_to_records`."""
    self.config = config
    path = pathlib.Path(config.path)
    recs = rows_to_records(read_rows(path, config.file_format), config, path)
    if config.eval_path is not None:
      eval_path = pathlib.Path(config.eval_path)
      by_split = {"train": recs, "eval": rows_to_records(
          read_rows(eval_path, config.file_format), config, eval_path)}
    else:
      by_split = records_lib.split_records(recs, config.eval_fraction)
    super().__init__(by_split, seed=config.seed, source=str(path),
                     empty_hint=f"(eval_fraction={config.eval_fraction}); add rows, change "
                     "eval_fraction, or pass eval_path.")

  def reward(self, problem: base.Problem, completion: str) -> float:
    """1.0 iff the completion's answer (`answer_format`) matches the reference (`grader`)."""
    got = answers.extract_answer(completion, self.config.answer_format)
    return 1.0 if answers.answers_match(got, problem.answer, self.config.grader) else 0.0
