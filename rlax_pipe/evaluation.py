"""Held-out evaluation: sample completions for task problems with the paged sampler and grade them.

Used by the SFT warm start (greedy and T=1 accuracy) and by the RL drivers (held-out accuracy).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.sampler import Request, SamplerEngine
from rlax_pipe.tasks import base as task_base
from rlax_pipe.tasks.safe_reward import RewardStats, safe_reward


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """Accuracy of one evaluation pass.

  Attributes:
    accuracy: mean reward over the problems (rewards are 0/1 for the built-in tasks).
    num_problems: problems evaluated.
    mean_completion_tokens: mean completion length in tokens.
    accuracy_by_difficulty: {difficulty: mean reward} (difficulty as defined by the task).
  """

  accuracy: float
  num_problems: int
  mean_completion_tokens: float
  accuracy_by_difficulty: dict


def eval_problems(task: task_base.Task, n: int, split: str = "eval") -> list[task_base.Problem]:
  """The first `n` problems of `split` (a fixed held-out set)."""
  return task_base.take_problems(task, 0, n, split)


def evaluate(engine: SamplerEngine, task: task_base.Task, tok: tokenizer_lib.Tokenizer,
             problems: Sequence[task_base.Problem], *, timeout_s: float = 5.0) -> EvalResult:
  """Generates one completion per problem with `engine` (its weights and sampling config) and grades it.

  The engine must be idle (no running or waiting requests); it is left idle.

  Args:
    engine: a sampler engine holding the weights to evaluate.
    task: the task that grades completions.
    tok: tokenizer used to encode prompts and decode completions.
    problems: problems to evaluate.
    timeout_s: per-completion limit for the reward function (seconds).

  Returns:
    EvalResult.

  Raises:
    RuntimeError: if the engine has work in flight.
  """
  if engine.has_work:
    raise RuntimeError("evaluate() needs an idle engine; it has requests in flight.")
  for i, p in enumerate(problems):
    engine.submit(Request(prompt_tokens=np.asarray(tok.encode(p.prompt, add_bos=True), np.int32),
                          sample_id=i, group_id=i, prompt_index=p.index))
  rollouts = {r.sample_id: r for r in engine.run_to_completion()}
  stats = RewardStats()
  rewards, lengths, by_diff = [], [], {}
  for i, p in enumerate(problems):
    r = rollouts[i]
    text = tok.decode(r.completion_tokens)
    reward = safe_reward(task, p, text, sample_id=i, timeout_s=timeout_s,
                                         stats=stats)
    rewards.append(reward)
    lengths.append(r.num_completion_tokens)
    by_diff.setdefault(float(p.difficulty), []).append(reward)
  return EvalResult(
      accuracy=float(np.mean(rewards)) if rewards else 0.0, num_problems=len(problems),
      mean_completion_tokens=float(np.mean(lengths)) if lengths else 0.0,
      accuracy_by_difficulty={k: float(np.mean(v)) for k, v in sorted(by_diff.items())})
