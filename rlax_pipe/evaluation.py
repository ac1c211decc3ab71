"""Held-out evaluation: sample completions for task problems with the paged sampler and grade them.

Used by the SFT warm start (greedy and T=1 accuracy) and by the RL drivers (held-out accuracy,
and with `PipelineConfig.eval_samples` = n > 0 also mean@n and unbiased pass@k from n samples
per problem at the sampling temperature, `evaluate_samples`).
Prompts are encoded as in training (`tok.encode_prompt`, the same over-long-prompt policy) and
completions graded as in training (the text after the reasoning block, `grading`); verifiers run
in worker processes (`tasks.VerifierPool`).

Environment tasks (tools, `rlax_pipe.envs`) are evaluated as episodes: wrap the engine with
`envs.evaluation_engine` (tools run in worker processes as in training, on the held-out problems) and
`evaluate` grades each episode's last turn, as training does, and counts turns and tool calls.
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
    count_by_difficulty: {difficulty: problems evaluated} (the n behind each accuracy).
    mean_turns: mean model turns per problem (1.0 for single-turn tasks).
    tool_use_by_difficulty: {difficulty: share of problems whose episode had > 1 turn, i.e.
      got at least one tool result} ({} for single-turn engines).
    tool_calls: tool calls run during this evaluation (`EpisodeEngine.counts`; 0 single-turn).
    tool_failures: of them, calls that failed (`ToolPool.counts`, every outcome but "ok").
  """

  accuracy: float
  num_problems: int
  mean_completion_tokens: float
  accuracy_by_difficulty: dict
  num_filtered: int = 0
  num_failed_rewards: int = 0
  count_by_difficulty: dict = dataclasses.field(default_factory=dict)
  mean_turns: float = 1.0
  tool_use_by_difficulty: dict = dataclasses.field(default_factory=dict)
  tool_calls: int = 0
  tool_failures: int = 0


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1).

  pass@k = 1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i),
  the numerically stable product form of the paper's Fig. 3 (no large binomials); 1.0 when
  n - c < k (every k-subset holds a correct sample).

  Args:
    n: samples drawn (>= 1).
    c: correct samples (0 <= c <= n).
    k: subset size (1 <= k <= n).

  Returns:
    float in [0, 1].

  Raises:
    ValueError: on n < 1, c outside [0, n] or k outside [1, n].
  """
  if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, "
                     f"k={k}.")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


@dataclasses.dataclass(frozen=True)
class SampledEvalResult:
  """n samples per problem at the sampling temperature.

  Attributes:
    num_samples: n, samples per problem.
    mean_at_n: mean over problems of the mean reward of their n samples (= c / n averaged for
      0/1 rewards); a failed verifier call counts 0.0.
    pass_at_k: {k: mean over problems of `pass_at_k(n, c_i, k)`}, c_i the samples of problem i
      with reward >= 1 (a full pass; partial credit does not pass).
    num_problems: problems evaluated (given minus `num_filtered`).
    mean_completion_tokens: mean completion length over all samples (tokens).
    num_filtered: problems skipped because their prompt does not fit.
    num_failed_rewards: verifier calls that failed.
  """

  num_samples: int
  mean_at_n: float
  pass_at_k: dict
  num_problems: int
  mean_completion_tokens: float
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
    engine: a sampler engine holding the weights to evaluate, or an `envs.evaluation_engine` around
      one (an environment's episodes: the last turn is graded, turns and tool calls counted).
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
  counts = getattr(engine, "counts", None)  # an EpisodeEngine's episode counters
  calls0 = counts["tool_calls"] if counts else 0
  tools = getattr(engine, "tools", None)
  fails0 = sum(v for k, v in tools.counts.items() if k != "ok") if tools is not None else 0
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
                                                  rollouts[i].last_turn_tokens, markers))
           for i, p in enumerate(kept)]  # an episode is graded on its last turn
  pool = verifier if verifier is not None else VerifierPool(task, timeout_s=timeout_s)
  try:
    verdicts = pool.grade(items, list(range(len(kept))))
  finally:
    if verifier is None:
      pool.close()
  rewards = [0.0 if math.isnan(v.reward) or (grading.overlong_policy != "keep"
                                             and grading_lib.is_cut(rollouts[i])) else v.reward
             for i, v in enumerate(verdicts)]
  by_diff, tool_use = {}, {}
  for i, (p, reward) in enumerate(zip(kept, rewards)):
    by_diff.setdefault(float(p.difficulty), []).append(reward)
    tool_use.setdefault(float(p.difficulty), []).append(float(rollouts[i].num_turns > 1))
  lengths = [rollouts[i].num_completion_tokens for i in range(len(kept))]
  fails = sum(v for k, v in tools.counts.items() if k != "ok") if tools is not None else 0
  return EvalResult(
      accuracy=float(np.mean(rewards)) if rewards else 0.0, num_problems=len(kept),
      mean_completion_tokens=float(np.mean(lengths)) if lengths else 0.0,
      accuracy_by_difficulty={k: float(np.mean(v)) for k, v in sorted(by_diff.items())},
      num_filtered=len(problems) - len(kept),
      num_failed_rewards=sum(v.failed for v in verdicts),
      count_by_difficulty={k: len(v) for k, v in sorted(by_diff.items())},
      mean_turns=float(np.mean([rollouts[i].num_turns for i in range(len(kept))])) if kept
      else 1.0,
      tool_use_by_difficulty=({k: float(np.mean(v)) for k, v in sorted(tool_use.items())}
                              if counts is not None else {}),
      tool_calls=(counts["tool_calls"] - calls0) if counts else 0,
      tool_failures=fails - fails0)


def evaluate_samples(engine: SamplerEngine, task: task_base.Task, tok: tokenizer_lib.Tokenizer,
                     problems: Sequence[task_base.Problem], num_samples: int,
                     ks: Sequence[int], *, timeout_s: float = 5.0,
                     verifier: VerifierPool | None = None,
                     grading: grading_lib.GradingConfig = grading_lib.GradingConfig()
                     ) -> SampledEvalResult:
  """Generates `num_samples` completions per problem with `engine` (its weights and sampling
  config, e.g. the training temperature) and reports mean@n and unbiased pass@k.

  A problem's n requests share a group id, so the paged sampler shares their prompt's pages.
  The engine must be idle; it is left idle.

  Args:
    engine: a sampler engine holding the weights to evaluate (sampling, not greedy: n greedy
      samples would be n copies of one).
    task, tok, problems, timeout_s, verifier, grading: as for `evaluate`.
    num_samples: n >= 1 samples per problem.
    ks: the k of each pass@k (1 <= k <= n).

  Returns:
    SampledEvalResult.

  Raises:
    ValueError: on n < 1 or a k outside [1, n].
    RuntimeError: if the engine has work in flight.
  """
  if num_samples < 1 or any(not 1 <= k <= num_samples for k in ks):
    raise ValueError(f"evaluate_samples: need num_samples >= 1 and every k in [1, "
                     f"{num_samples}]; got num_samples={num_samples}, ks={tuple(ks)}.")
  if engine.has_work:
    raise RuntimeError("evaluate_samples() needs an idle engine; it has requests in flight.")
  kept = []
  for p in problems:
    prepared = grading_lib.prepare_prompt(tok, p.prompt, engine.cfg.max_seq_len, grading)
    if prepared.ids is None:
      continue
    kept.append(p)
    i = len(kept) - 1
    for j in range(num_samples):
      engine.submit(Request(prompt_tokens=prepared.ids, sample_id=i * num_samples + j,
                            group_id=i, prompt_index=p.index))
  rollouts = {r.sample_id: r for r in engine.run_to_completion()} if kept else {}
  ids = sorted(rollouts)
  items = [(kept[sid // num_samples], tok.decode(rollouts[sid].last_turn_tokens))
           for sid in ids]  # an episode is graded on its last turn
  pool = verifier if verifier is not None else VerifierPool(task, timeout_s=timeout_s)
  try:
    verdicts = pool.grade(items, ids) if items else []
  finally:
    if verifier is None:
      pool.close()
  rewards = np.zeros((len(kept), num_samples))
  for sid, v in zip(ids, verdicts):
    rewards[sid // num_samples, sid % num_samples] = 0.0 if math.isnan(v.reward) else v.reward
  correct = (rewards >= 1.0).sum(axis=1)
  lengths = [rollouts[sid].num_completion_tokens for sid in ids]
  return SampledEvalResult(
      num_samples=num_samples,
      mean_at_n=float(rewards.mean()) if kept else 0.0,
      pass_at_k={int(k): float(np.mean([pass_at_k(num_samples, int(c), int(k))
                                        for c in correct])) if kept else 0.0 for k in ks},
      num_problems=len(kept),
      mean_completion_tokens=float(np.mean(lengths)) if lengths else 0.0,
      num_filtered=len(problems) - len(kept),
      num_failed_rewards=sum(v.failed for v in verdicts))
