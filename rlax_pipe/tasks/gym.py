"""Procedural reasoning tasks from reasoning-gym (optional extra: `pip install -e ".[gym]"`).

reasoning-gym (Stojanovski et al. 2025, "REASONING GYM: Reasoning Environments for Reinforcement
Learning with Verifiable Rewards") generates problems procedurally: `create_dataset(name,
seed=..., size=..., **config)` returns a dataset whose item `i` is a pure function of (seed, i),
a dict {"question", "answer", "metadata"}, and whose `score_answer(answer, entry)` grades an
answer string in [0, 1] (exact match, numeric or partial credit, as each dataset defines).

`ReasoningGymTask` wraps one dataset, chosen by name and config:

- problem (index, split): the dataset items of the block `(2 * index + split_no) * 256 + k`,
  k = 0, 1, ..., are tried in order and the first whose question hashes into `split`
  (`base.split_of`, as the built-in arithmetic task) is the problem, so "train" and "eval" never
  share a question and every problem is a pure function of (config, index, split);
- prompt: `prompt_template` formatted with the question (default "{question}\\n"); for an
  instruct model, pair it with a system prompt that asks for the answer format (reasoning-gym's
  own prompts ask for `<answer>...</answer>`, the default `answer_format`);
- reward: the completion's answer (`answers.extract_answer` with `answer_format`, None when there
  is none) scored by the dataset's own `score_answer` against the regenerated item;
- solution (SFT warm starts): the item's answer stated in `answer_format`.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from rlax_pipe.tasks import answers
from rlax_pipe.tasks import base

_ATTEMPTS = 256  # items tried per (index, split); P(no eval item | eval_fraction 0.1) ~ 2e-12
_INSTALL_HINT = ('reasoning-gym is not installed: pip install -e ".[gym]" '
                 "(or pip install reasoning-gym).")


def _reasoning_gym():
  try:
    import reasoning_gym  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(_INSTALL_HINT) from e
  return reasoning_gym


@dataclasses.dataclass(frozen=True)
class ReasoningGymConfig:
  """Which reasoning-gym dataset, how it is seeded, prompted and graded.

  Attributes:
    dataset: registered reasoning-gym dataset name, e.g. "basic_arithmetic", "chain_sum",
      "countdown".
    dataset_config: the dataset's own config fields as (name, value) pairs (a dict is accepted
      and stored sorted), e.g. {"min_terms": 2, "max_terms": 4}.
    seed: the dataset seed (int >= 0).
    size: the dataset's index space (items 0..size-1 exist); problems address items below it.
    eval_fraction: share of questions held out as "eval" (by question hash), in (0, 1).
    prompt_template: `str.format` template with `{question}`.
    answer_format: how a completion states its answer (`answers.ANSWER_FORMATS`).
  """

  dataset: str = "chain_sum"
  dataset_config: Any = ()
  seed: int = 0
  size: int = 10**9
  eval_fraction: float = 0.1
  prompt_template: str = "{question}\n"
  answer_format: str = "answer_tag"

  def __post_init__(self):
    items = self.dataset_config
    if isinstance(items, dict):
      items = tuple(sorted(items.items()))
    if not isinstance(items, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in items):
      raise ValueError(f"ReasoningGymConfig.dataset_config={self.dataset_config!r} must be a dict "
                       "or (name, value) pairs of the dataset's config fields.")
    object.__setattr__(self, "dataset_config", items)
    if self.seed < 0 or self.size < 1:
      raise ValueError(f"ReasoningGymConfig.seed={self.seed} must be >= 0 and size={self.size} "
                       ">= 1.")
    if not 0.0 < self.eval_fraction < 1.0:
      raise ValueError(f"ReasoningGymConfig.eval_fraction={self.eval_fraction} must be in (0, 1).")
    if "{question}" not in self.prompt_template:
      raise ValueError(f"ReasoningGymConfig.prompt_template={self.prompt_template!r} must contain "
                       "'{question}'.")
    if self.answer_format not in answers.ANSWER_FORMATS:
      raise ValueError(f"ReasoningGymConfig.answer_format={self.answer_format!r}; choose one of "
                       f"{answers.ANSWER_FORMATS}.")


def make_dataset(config: ReasoningGymConfig):
  """The reasoning-gym dataset of `config`.

  Raises:
    ImportError: without the gym extra.
    ValueError: for an unknown dataset name (with close matches) or config field.
  """
  rg = _reasoning_gym()
  names = sorted(rg.factory.DATASETS)
  if config.dataset not in names:
    close = difflib.get_close_matches(config.dataset, names, n=3)
    raise ValueError(f"Unknown reasoning-gym dataset {config.dataset!r}"
                     + (f"; did you mean {close}?" if close else "")
                     + f" Registered: {names}.")
  try:
    return rg.create_dataset(config.dataset, seed=config.seed, size=config.size,
                             **dict(config.dataset_config))
  except TypeError as e:  # unknown config field
    raise ValueError(f"reasoning-gym dataset {config.dataset!r} rejected dataset_config="
                     f"{dict(config.dataset_config)}: {e}") from e


class ReasoningGymTask:
  """One reasoning-gym dataset as a `base.Task` (see the module docstring).

  Example:
    >>> task = ReasoningGymTask(ReasoningGymConfig("chain_sum", {"max_terms": 3}))
    >>> p = task.problem(0)
    >>> task.reward(p, p.solution)
    1.0
  """

  name = "reasoning_gym"

  def __init__(self, config: ReasoningGymConfig = ReasoningGymConfig()):
    """Creates the dataset; raises like `make_dataset`."""
    self.config = config
    self._dataset = make_dataset(config)

  def _entry(self, index: int, split: str) -> dict:
    base.check_index(index)
    base.check_split(split)
    start = (2 * int(index) + base.SPLITS.index(split)) * _ATTEMPTS
    for k in range(_ATTEMPTS):
      entry = self._dataset[(start + k) % self.config.size]
      if base.split_of(entry["question"], self.config.eval_fraction) == split:
        return entry
    raise RuntimeError(f"no {split!r} question among {_ATTEMPTS} items of {self.config.dataset} "
                       f"for index {index}; the dataset's question space is too small for "
                       f"eval_fraction={self.config.eval_fraction}.")

  def problem(self, index: int, split: str = "train") -> base.Problem:
    """The problem at `index` (int >= 0) of `split`; a pure function of (config, index, split).

    Raises:
      ValueError: on a bad index or split.
      RuntimeError: when no question of `split` is found (a tiny question space).
    """
    entry = self._entry(index, split)
    answer = str(entry["answer"])
    return base.Problem(index=int(index), split=split,
                        prompt=self.config.prompt_template.format(question=entry["question"]),
                        answer=answer,
                        solution=answers.format_answer(answer, self.config.answer_format))

  def num_problems(self, split: str = "train") -> None:
    """None: problems are generated, the index space is unbounded."""
    base.check_split(split)

  def sample_prompts(self, rng, n: int, split: str = "train") -> list[base.Problem]:
    """`n` problems at indices drawn uniformly from [0, size // 512) with `rng`."""
    if n < 0:
      raise ValueError(f"n={n} must be >= 0.")
    high = max(1, self.config.size // (2 * _ATTEMPTS))
    return [self.problem(int(i), split) for i in rng.integers(0, high, size=n)]

  def reward(self, problem: base.Problem, completion: str) -> float:
    """The dataset's `score_answer` of the completion's answer, in [0, 1]."""
    entry = self._entry(problem.index, problem.split)
    got = answers.extract_answer(completion, self.config.answer_format)
    return float(self._dataset.score_answer(got, entry))
