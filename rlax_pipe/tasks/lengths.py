"""Length statistics of a task's reference completions, in tokens.

Used to check that the built-in task really has a long tail (p99 several times p50), which is what
makes synchronous RL wait on stragglers.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.tasks import base


@dataclasses.dataclass(frozen=True)
class LengthStats:
  """Quantiles of reference completion length in tokens (EOS included) over `n` problems.

  Attributes:
    n: number of problems measured.
    mean, p50, p90, p99, max: length statistics in tokens (quantiles by linear interpolation,
      numpy's default).
    prompt_mean, prompt_max: prompt length in tokens (BOS included).
  """

  n: int
  mean: float
  p50: float
  p90: float
  p99: float
  max: int
  prompt_mean: float
  prompt_max: int


def length_stats(task: base.Task, rng: np.random.Generator, n: int,
                 tokenizer: tokenizer_lib.Tokenizer, split: str = "train") -> LengthStats:
  """Measures prompt and reference-completion lengths of `n` sampled problems.

  Completion lengths count the tokens the sampler would generate for the reference solution:
  `len(tokenizer.encode(problem.solution, add_eos=True))`. Prompt lengths are those of
  `tokenizer.encode_prompt` (BOS or chat template included, as the sampler sees them).

  Args:
    task: any `base.Task`.
    rng: generator passed to `task.sample_prompts`.
    n: number of problems (>= 1).
    tokenizer: the tokenizer that defines a token.
    split: "train" or "eval".

  Returns:
    A `LengthStats`.

  Raises:
    ValueError: when n < 1.
  """
  if n < 1:
    raise ValueError(f"length_stats needs n >= 1, got {n}.")
  problems = task.sample_prompts(rng, n, split)
  completion = np.array([len(tokenizer.encode(p.solution, add_eos=True)) for p in problems])
  prompt = np.array([len(tokenizer.encode_prompt(p.prompt))
                     for p in problems])
  p50, p90, p99 = np.percentile(completion, [50, 90, 99]).tolist()
  return LengthStats(n=n, mean=float(completion.mean()), p50=p50, p90=p90, p99=p99,
                     max=int(completion.max()), prompt_mean=float(prompt.mean()),
                     prompt_max=int(prompt.max()))
