"""Built-in arithmetic task: running sums with a long-tailed number of terms.

Prompt and reference completion (the completion does not include EOS):

    Q: 3+5+2+7            <- prompt "Q: 3+5+2+7\\n"
    3+5=8
    8+2=10                <- one trace line per term after the first
    10+7=17
    A: 17

Each trace line costs ~7-9 tokens with the shipped character-level tokenizer, so the completion
length is linear in the number of terms n. n is heavy-tailed (truncated Lomax / Pareto II):

    x ~ Lomax(alpha) truncated to x < (max_terms - min_terms + 1) / scale,
    n = min_terms + floor(scale * x),

drawn by inverse CDF: F(x) = 1 - (1 + x)^(-alpha), x = (1 - u F(x_max))^(-1/alpha) - 1 with
u ~ U[0, 1) (Arnold, "Pareto Distributions", 2nd ed., 2015, ch. 3, Pareto II with location 0).
With the defaults (3..32 terms) 60% of problems have 3-4 terms and about one in a hundred has
26+, so the p99 of the completion length is ~7x its median: the straggler regime of synchronous RL.
(min_terms=3 by default because the 100 two-term prompts of 0..9 are memorized, not learned.)

Why this is learnable but not trivial for a 2-layer transformer: each line copies the previous
result (a local lookup), fetches the next prompt term (a lookup by count of lines so far, which
gets less reliable as n grows) and adds a one-digit number (carries). Per-line error compounds
over n lines, so accuracy falls with length and RL has headroom on the long tail. Knobs: the term
distribution (`tail_index`, `scale`, `min_terms`, `max_terms`), operand size (`max_operand`) and
subtraction (`operators="+-"`, running values may become negative).

Calibration (2026-11-30, one run each, not a benchmark): the 2-layer d_model-128 `ModelConfig`
default, SFT on reference traces (AdamW lr 3e-3, 180 steps of 8 x 512 packed tokens = 0.67M
tokens, ~3.3 CPU-minutes), greedy decoding on 256 eval problems: default config 46% accuracy
(n=3: 82%, n=4-5: 46%, n=6-9: 11%, n>=10: 0%); with min_terms=2, 59% (n=2: 94%).

Reward (`ArithmeticTask.reward`): 1.0 iff the text after the first "A:" up to the end of that
line, stripped of surrounding whitespace, equals the reference integer exactly (canonical form:
no leading zeros, no "+" sign, no trailing period); else 0.0. A completion without "A:" (e.g. cut
off at the length limit) scores 0.0. The trace itself is not graded.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlax_pipe.tasks import base

_MAX_SPLIT_ATTEMPTS = 10_000
_TERM_ATTEMPTS = 100  # Term draws per draw of n before n is redrawn.
_MAX_INDEX = 2**62


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
  """Difficulty and split knobs of the arithmetic task (calibration in the module docstring).

  Attributes:
    min_terms: fewest terms per problem (>= 1; one term gives the completion "A: <term>").
    max_terms: most terms per problem (>= min_terms). Longest completion ~ 9 * max_terms tokens.
    tail_index: Lomax shape alpha (> 0); smaller = heavier tail (more long problems).
    scale: Lomax scale in terms (> 0); larger = more terms on average.
    max_operand: terms are uniform integers in [0, max_operand] (>= 0).
    operators: operators drawn uniformly for each term after the first; a non-empty subset of
      "+-" (with "-" running values may be negative).
    eval_fraction: share of the prompt space held out as the "eval" split, in (0, 1).
    seed: task seed (int >= 0); problem (index, split) is a pure function of (config, index, split).
      The split of a prompt does not depend on it (see `base.split_of`).
  """

  min_terms: int = 3
  max_terms: int = 32
  tail_index: float = 1.5
  scale: float = 2.5
  max_operand: int = 9
  operators: str = "+"
  eval_fraction: float = 0.1
  seed: int = 0

  def __post_init__(self):
    if self.min_terms < 1:
      raise ValueError(f"ArithmeticConfig.min_terms={self.min_terms} must be >= 1.")
    if self.max_terms < self.min_terms:
      raise ValueError(f"ArithmeticConfig.max_terms={self.max_terms} must be >= min_terms="
                       f"{self.min_terms}.")
    if not self.tail_index > 0 or not self.scale > 0:
      raise ValueError(f"ArithmeticConfig.tail_index={self.tail_index} and scale={self.scale} "
                       "must be > 0.")
    if self.max_operand < 0:
      raise ValueError(f"ArithmeticConfig.max_operand={self.max_operand} must be >= 0.")
    if not self.operators or set(self.operators) - set("+-"):
      raise ValueError(f"ArithmeticConfig.operators={self.operators!r} must be a non-empty "
                       "subset of '+-'.")
    if not 0.0 < self.eval_fraction < 1.0:
      raise ValueError(f"ArithmeticConfig.eval_fraction={self.eval_fraction} must be in (0, 1).")
    if self.seed < 0:
      raise ValueError(f"ArithmeticConfig.seed={self.seed} must be >= 0.")


def draw_num_terms(rng: np.random.Generator, config: ArithmeticConfig) -> int:
  """Draws the number of terms n in [min_terms, max_terms] (see the module docstring).

  Args:
    rng: numpy generator; consumes one uniform draw.
    config: the task config.

  Returns:
    n, an int.
  """
  alpha = config.tail_index
  x_max = (config.max_terms - config.min_terms + 1) / config.scale
  cdf_max = 1.0 - (1.0 + x_max) ** (-alpha)
  u = rng.random()
  x = (1.0 - u * cdf_max) ** (-1.0 / alpha) - 1.0
  return min(config.max_terms, config.min_terms + int(np.floor(config.scale * x)))


def render(terms: list[int], ops: list[str]) -> tuple[str, str, str]:
  """Prompt, reference answer and reference trace of one running-sum problem.

  Args:
    terms: the n >= 1 non-negative integer terms.
    ops: the n - 1 operators ("+" or "-") placed before terms[1:].

  Returns:
    (prompt, answer, solution), e.g. ("Q: 3+5\\n", "8", "3+5=8\\nA: 8") for ([3, 5], ["+"]).

  Raises:
    ValueError: when there is no term or len(ops) != len(terms) - 1.
  """
  if not terms or len(ops) != len(terms) - 1:
    raise ValueError(f"render needs n >= 1 terms and n - 1 operators, got {terms}, {ops}.")
  prompt = "Q: " + str(terms[0]) + "".join(f"{o}{t}" for o, t in zip(ops, terms[1:])) + "\n"
  total = terms[0]
  lines = []
  for o, t in zip(ops, terms[1:]):
    new = total + t if o == "+" else total - t
    lines.append(f"{total}{o}{t}={new}")
    total = new
  lines.append(f"{base.ANSWER_MARKER} {total}")
  return prompt, str(total), "\n".join(lines)


class ArithmeticTask:
  """Running-sum arithmetic with long-tailed trace lengths; implements `base.Task`.

  Example:
    >>> task = ArithmeticTask(ArithmeticConfig())
    >>> p = task.problem(0)
    >>> task.reward(p, p.solution)
    1.0
  """

  name = "arithmetic"

  def __init__(self, config: ArithmeticConfig = ArithmeticConfig()):
    self.config = config

  def problem(self, index: int, split: str = "train") -> base.Problem:
    """The problem at `index` (int >= 0) of `split`.

    Generated from a generator seeded with (config.seed, split, index): n is drawn first, then
    terms and operators are redrawn until the prompt hashes into `split`, so "eval" prompts never
    occur in "train" and vice versa, and both splits share the distribution of n. Only when 100
    draws for one n find no prompt of `split` (a tiny space, e.g. one term of 0..9) is n redrawn.

    Raises:
      ValueError: on a bad index or split.
      RuntimeError: when the config's prompt space is too small to find a prompt of `split`
        within 10,000 draws (e.g. max_terms=1, max_operand=0).
    """
    base.check_index(index)
    base.check_split(split)
    cfg = self.config
    rng = np.random.default_rng([cfg.seed, base.SPLITS.index(split), int(index)])
    for _ in range(_MAX_SPLIT_ATTEMPTS // _TERM_ATTEMPTS):
      n = draw_num_terms(rng, cfg)
      for _ in range(_TERM_ATTEMPTS):
        terms = rng.integers(0, cfg.max_operand + 1, size=n).tolist()
        ops = [cfg.operators[k] for k in rng.integers(0, len(cfg.operators), size=n - 1)]
        prompt, answer, solution = render(terms, ops)
        if base.split_of(prompt, cfg.eval_fraction) == split:
          return base.Problem(index=int(index), split=split, prompt=prompt, answer=answer,
                              solution=solution, difficulty=float(n))
    raise RuntimeError(f"No {split!r} prompt found in {_MAX_SPLIT_ATTEMPTS} draws for {cfg}; "
                       "the prompt space is too small for this eval_fraction.")

  def num_problems(self, split: str = "train") -> int | None:
    """None: problems are generated, the index space is unbounded."""
    base.check_split(split)
    return None

  def sample_prompts(self, rng: np.random.Generator, n: int,
                     split: str = "train") -> list[base.Problem]:
    """`n` problems at indices drawn uniformly from [0, 2**62) with `rng`."""
    if n < 0:
      raise ValueError(f"n={n} must be >= 0.")
    return [self.problem(int(i), split) for i in rng.integers(0, _MAX_INDEX, size=n)]

  def reward(self, problem: base.Problem, completion: str) -> float:
    """1.0 iff the answer after the first "A:" equals `problem.answer` exactly, else 0.0."""
    answer = base.extract_marked_answer(completion)
    return 1.0 if answer is not None and answer == problem.answer else 0.0
