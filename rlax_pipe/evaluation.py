"""Held-out evaluation: sample completions for task problems with the paged sampler and grade them.

Used by the SFT warm start (greedy and T=1 accuracy) and by the RL drivers (held-out accuracy).
Prompts are encoded as in training (`tok.encode_prompt`, the same over-long-prompt policy) and
completions graded as in training (the text after the reasoning block, `grading`); verifiers run
in worker processes (`tasks.VerifierPool`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe import grading as grading_lib
from rlax_pipe.sampler import Request, SamplerEngine
from rlax_pipe.tasks import base as task_base
from rlax_pipe.tasks.verifier_pool import VerifierPool


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """Accuracy of one evaluation pass.

  Attributes:
    accuracy: mean reward over the problems evaluated; a problem whose verifier call failed
      counts 0.0, and so does one whose completion was cut by the length limit unless the
      grading's overlong_policy is "keep" (rewards are 0/1 for the built-in tasks).
    num_problems: problems evaluated (problems given minus `num_filtered`).
    mean_completion_tokens: mean completion length in tokens.
    accuracy_by_difficulty: {difficulty: mean reward} (difficulty as defined by the task).
    num_filtered: problems skipped because their prompt does not fit (over-long, "filter").
    num_failed_rewards: verifier calls that failed (error, timeout, invalid).
  """

  accuracy: float
  num_problems: int
  mean_completion_tokens: float
  accuracy_by_difficulty: dict
  num_filtered: int = 0
  num_failed_rewards: int = 0


def eval_problems(task: task_base.Task, n: int, split: str = "eval") -> list[task_base.Problem]:
  """The first `n` problems of `split` (a fixed held-out set)."""
  return task_base.take_problems(task, 0, n, split)


def evaluate(engine: SamplerEngine, task: task_base.Task, tok: tokenizer_lib.Tokenizer,
             problems: Sequence[task_base.Problem], *, timeout_s: float = 5.0,
             verifier: VerifierPool | None = None,
             grading: grading_lib.GradingConfig = grading_lib.GradingConfig()) -> EvalResult:
  """Generates one completion per problem with `engine` (its weights and sampling config) and grades it.

  The engine must be idle (no running or waiting requests); it is left idle.

  Args:
    engine: a sampler engine holding the weights to evaluate.
    task: the task that grades completions.
    tok: tokenizer used to encode prompts and decode completions.
    problems: problems to evaluate.
    timeout_s: per-call limit of the reward function (seconds) when `verifier` is None.
    verifier: verifier processes to grade with (e.g. the rollout worker's); None = a temporary
      `VerifierPool(task, timeout_s=timeout_s)`.
    grading: the over-long-prompt policy (`prompt_policy`, `min_completion_tokens`,
      `max_prefill_len`), the reasoning markers (the verifier sees the text after the block)
      and `overlong_policy` (cut completions count 0.0 unless it is "keep").

  Returns:
    EvalResult.

  Raises:
    RuntimeError: if the engine has work in flight.
  """
  if engine.has_work:
    raise RuntimeError("evaluate() needs an idle engine; it has requests in flight.")
  kept = []
  for i, p in enumerate(problems):
    prepared = grading_lib.prepare_prompt(tok, p.prompt, engine.cfg.max_seq_len, grading)
    if prepared.ids is not None:
      kept.append(p)
      engine.submit(Request(prompt_tokens=prepared.ids, sample_id=len(kept) - 1,
                            group_id=len(kept) - 1, prompt_index=p.index))
  rollouts = {r.sample_id: r for r in engine.run_to_completion()} if kept else {}
  markers = grading_lib.resolve_reasoning_markers(tok, grading)
  items = [(p, grading_lib.completion_for_grading(tok, rollouts[i].prompt_tokens,
                                                  rollouts[i].completion_tokens, markers))
           for i, p in enumerate(kept)]
  pool = verifier if verifier is not None else VerifierPool(task, timeout_s=timeout_s)
  try:
    verdicts = pool.grade(items, list(range(len(kept))))
  finally:
    if verifier is None:
      pool.close()
  rewards = [0.0 if math.isnan(v.reward) or (grading.overlong_policy != "keep"
                                             and grading_lib.is_cut(rollouts[i])) else v.reward
             for i, v in enumerate(verdicts)]
  by_diff = {}
  for p, reward in zip(kept, rewards):
    by_diff.setdefault(float(p.difficulty), []).append(reward)
  lengths = [rollouts[i].num_completion_tokens for i in range(len(kept))]
  return EvalResult(
      accuracy=float(np.mean(rewards)) if rewards else 0.0, num_problems=len(kept),
      mean_completion_tokens=float(np.mean(lengths)) if lengths else 0.0,
      accuracy_by_difficulty={k: float(np.mean(v)) for k, v in sorted(by_diff.items())},
      num_filtered=len(problems) - len(kept),
      num_failed_rewards=sum(v.failed for v in verdicts))
