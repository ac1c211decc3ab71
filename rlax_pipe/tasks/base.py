"""The Task protocol, the Problem record, and the conventions every task shares.

A task makes prompts and grades completions; it is pure Python (no JAX). Problems are addressable
by `(index, split)`: `task.problem(i, split)` is a pure function of the task's config, so a prompt
stream is restored after a restart from an integer counter alone (`take_problems`).

Answer convention: a completion states its final answer on a line that starts after the marker
`ANSWER_MARKER` ("A:"); `extract_marked_answer` returns the text after the FIRST marker that starts
a whitespace-separated token (so "DATA:", "NASA:" or a heading's "Q&A:" never count; opening
brackets, quotes, "*" and ">" may precede it) up to the end of that line (later markers are
ignored, so writing several answers never helps).

Splits: "train" and "eval" are disjoint by content. `split_of(prompt, eval_fraction)` assigns a
prompt to a split from a stable hash of its text (BLAKE2b, independent of seeds and of Python's
hash randomization), so two problems with the same prompt text always land in the same split.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Protocol, runtime_checkable

import numpy as np

from rlax_pipe.tasks import answers

ANSWER_MARKER = answers.ANSWER_MARKER
SPLITS: tuple[str, ...] = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One prompt with its reference answer and reference completion.

  Attributes:
    index: address of the problem in its split: `task.problem(index, split)` returns it again.
    split: "train" or "eval".
    prompt: the text the policy is conditioned on (ends with "\\n" for the built-in tasks).
    answer: the reference final answer, as a string (what follows `ANSWER_MARKER`).
    solution: a reference completion that earns reward 1.0 (for SFT warm starts); it does not
      include the EOS token.
    difficulty: task-defined difficulty, larger is harder (arithmetic: number of terms; JSONL: the
      optional "difficulty" field, else 0.0).
  """

  index: int
  split: str
  prompt: str
  answer: str
  solution: str
  difficulty: float = 0.0


@runtime_checkable
class Task(Protocol):
  """What the pipeline needs from a task.

  Implementations: `ArithmeticTask` (built-in, long-tailed lengths) and `JsonlTask` (users' data).
  """

  name: str

  def problem(self, index: int, split: str = "train") -> Problem:
    """The problem at `index` (int >= 0) of `split`; deterministic given the task's config."""
    ...

  def num_problems(self, split: str = "train") -> int | None:
    """Distinct problems in `split`, or None when the index space is unbounded (generated)."""
    ...

  def sample_prompts(self, rng: np.random.Generator, n: int,
                     split: str = "train") -> list[Problem]:
    """`n` problems of `split` drawn with `rng`; the same generator state gives the same list."""
    ...

  def reward(self, problem: Problem, completion: str) -> float:
    """Reward in [0, 1] of `completion` (decoded text, without EOS) for `problem`."""
    ...


def check_split(split: str) -> None:
  """Raises ValueError unless `split` is one of `SPLITS`."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}; choose one of {SPLITS}.")


def check_index(index: int) -> None:
  """Raises ValueError unless `index` is an int >= 0 (numpy integers accepted)."""
  if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
    raise ValueError(f"Problem index must be an int >= 0, got {index!r}.")


def split_of(prompt: str, eval_fraction: float) -> str:
  """The split ("train" or "eval") a prompt text belongs to.

  u = first 8 bytes of BLAKE2b(prompt, UTF-8) as an integer / 2**64, uniform in [0, 1);
  the prompt is "eval" iff u < eval_fraction.

  Args:
    prompt: the prompt text.
    eval_fraction: share of the prompt space held out, in [0, 1].

  Returns:
    "train" or "eval".

  Raises:
    ValueError: when `eval_fraction` is outside [0, 1].
  """
  if not 0.0 <= eval_fraction <= 1.0:
    raise ValueError(f"eval_fraction={eval_fraction} must be in [0, 1].")
  digest = hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
  u = int.from_bytes(digest, "little") / 2.0**64
  return "eval" if u < eval_fraction else "train"


def extract_marked_answer(completion: str, marker: str = ANSWER_MARKER) -> str | None:
  """Text after the first `marker` that starts a token, up to the end of its line, stripped; None
  without such a marker (`answers.extract_marked_answer`).

  Example: extract_marked_answer("1+2=3\\nA: 3\\nA: 4") == "3";
  extract_marked_answer("Launches by NASA: 7") is None.
  """
  return answers.extract_marked_answer(completion, marker)


def take_problems(task: Task, start: int, n: int, split: str = "train") -> list[Problem]:
  """Problems `start, ..., start + n - 1` of `split`: a prompt stream resumable from a counter.

  Args:
    task: any `Task`.
    start: first index (int >= 0); persist `start + n` to resume after a restart.
    n: number of problems (int >= 0).
    split: "train" or "eval".

  Returns:
    list[Problem] of length n.

  Raises:
    ValueError: on a negative `start` or `n`, or a bad split.
  """
  check_index(start)
  if n < 0:
    raise ValueError(f"n={n} must be >= 0.")
  return [task.problem(start + k, split) for k in range(n)]
