"""What happens between a finished sample and its reward: prompts that do not fit, completions cut
by the length limit, reasoning blocks, verifiers that fail. Host-side policy, configured by
`GradingConfig`.

Over-long prompts (before sampling). A prompt is over-long when it is longer than the prompt
budget min(max_prefill_len, max_seq_len - min_completion_tokens) tokens (`max_prefill_len` None:
the whole sequence budget less the completion's minimum). `prompt_policy`:
- "filter" (default): the problem is skipped before any sample is started, and counted
  (`filtered_overlong`);
- "truncate": the prompt keeps its head (BOS included) and, in chat format, its generation-prompt
  tail (the assistant header), dropping tokens in between, so that it is exactly the prompt
  budget long; every sample of it is marked (`Rollout.prompt_truncated`) and counted.

Reasoning blocks (before the verifier). A task's `reward` sees only the completion's text after
the model's reasoning block (`completion_for_grading`), so a tentative answer written while
reasoning is never read as the final one; a block left open (cut, or never closed) leaves no
final answer, graded as the empty completion. The markers are the tokenizer's
(`Tokenizer.reasoning_markers`: from the chat template, e.g. Qwen3's "<think>" / "</think>") or
set by `reasoning_markers`; a prompt whose generation prompt opens a block (DeepSeek-R1's
"<think>\n") starts its completion inside one.

Completions cut by the length limit (finish reason "length" or "capacity": the completion budget
or the KV capacity ran out before a stop token). `overlong_policy`:
- "zero" (default): reward 0.0, the lowest reward of the `Task` protocol's [0, 1] (what a wrong
  answer gets), whatever the cut text holds: a cut answer is not an answer (an answer is only
  complete once the model stops), and the pressure to stop within the budget stays;
- "keep": graded like any other completion (a cut sample that happens to contain a correct answer
  gets its reward; one without an answer gets the wrong-answer reward);
- "mask": the sample gets no reward (NaN): it is excluded from its group's baseline and from the
  loss, like a failed verifier (DAPO's "overlong filtering", Yu et al. 2025, arXiv:2503.14476,
  Sec. 3.4). Masking removes the pressure to stop: a policy that never ends its answers is not
  penalised, so pair it with a budget that rarely binds;
- "soft_penalty": the graded reward plus DAPO's soft overlong punishment (Sec. 3.4, Eq. 13),
  applied to every sample by its length |y|:

      R_length(y) = 0                                  if |y| <= L_max - L_cache,
                    ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max,
                    -1                                 if |y| > L_max,

  with L_cache = `overlong_buffer_tokens` and L_max = `overlong_max_tokens`, or by default the
  sample's own completion budget min(max_new_tokens, max_seq_len - len(prompt)) (so a cut sample
  always gets -1).

In every policy a failed verifier stays failed (NaN). Held-out evaluation (`rlax_pipe.evaluation`)
counts a cut completion as 0.0 under every policy but "keep".

Failed verifiers (raised, timed out, returned a non-number; see `tasks.safe_reward`): the sample
gets no reward (NaN) and is excluded from its group's baseline and from the loss; a group left
without any reward is dropped by the queue and counted (waste reason "unscored"). When more than
`max_failure_fraction` of the last `failure_window` verifier calls failed, the run stops with
`RewardFailureError` naming the counts and the first failure.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

import numpy as np

from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.tasks import answers
from rlax_pipe.tasks import safe_reward
from rlax_pipe.types import Rollout

OVERLONG_POLICIES: tuple[str, ...] = ("zero", "keep", "mask", "soft_penalty")
PROMPT_POLICIES: tuple[str, ...] = ("filter", "truncate")
# Finish reasons of a completion cut before a stop token ("length": completion budget;
# "capacity": KV / max_seq_len capacity).
CUT_FINISH_REASONS: tuple[str, ...] = ("length", "capacity")


class RewardFailureError(RuntimeError):
  """Too many verifier calls failed; the message has the counts and the first failure."""


@dataclasses.dataclass(frozen=True)
class GradingConfig:
  """Prompt-length, overlong and failed-reward policies (module docstring).

  Attributes:
    prompt_policy: "filter" or "truncate" over-long prompts.
    min_completion_tokens: completion positions a prompt must leave (>= 1).
    max_prefill_len: longest prompt in tokens (>= 1) the prompt policy lets through, below the
      sequence budget (at most the sampler's max_seq_len - min_completion_tokens, checked where
      both are known); None (default) = max_seq_len - min_completion_tokens.
    reasoning_markers: the reasoning block graded around: "auto" (default: the tokenizer's
      `reasoning_markers`, none for the shipped tokenizer), "none" (grade the whole completion),
      or the open and close markers separated by one space, e.g. "<think> </think>".
    overlong_policy: "zero" (default), "keep", "mask" or "soft_penalty" for completions cut by
      the length limit.
    overlong_buffer_tokens: L_cache of the soft penalty (tokens, >= 1).
    overlong_max_tokens: L_max of the soft penalty (tokens, > overlong_buffer_tokens), or None
      for each sample's own completion budget.
    max_failure_fraction: the run stops when more than this share of the last `failure_window`
      verifier calls failed, in [0, 1]; 1.0 never stops.
    failure_window: verifier calls the failure share is measured over (>= 1).
    verifier_workers: verifier processes (>= 1).
  """

  prompt_policy: str = "filter"
  min_completion_tokens: int = 16
  max_prefill_len: int | None = None
  reasoning_markers: str = "auto"
  overlong_policy: str = "zero"
  overlong_buffer_tokens: int = 64
  overlong_max_tokens: int | None = None
  max_failure_fraction: float = 0.5
  failure_window: int = 64
  verifier_workers: int = 1

  def __post_init__(self):
    for name, choices in (("prompt_policy", PROMPT_POLICIES),
                          ("overlong_policy", OVERLONG_POLICIES)):
      if getattr(self, name) not in choices:
        raise ValueError(f"GradingConfig.{name}={getattr(self, name)!r}; choose one of "
                         f"{choices}.")
    for name in ("min_completion_tokens", "overlong_buffer_tokens", "failure_window",
                 "verifier_workers"):
      if getattr(self, name) < 1:
        raise ValueError(f"GradingConfig.{name}={getattr(self, name)} must be >= 1.")
    if (self.overlong_max_tokens is not None
        and self.overlong_max_tokens <= self.overlong_buffer_tokens):
      raise ValueError(f"GradingConfig.overlong_max_tokens={self.overlong_max_tokens} must be > "
                       f"overlong_buffer_tokens={self.overlong_buffer_tokens} (L_max > L_cache).")
    if not 0.0 <= self.max_failure_fraction <= 1.0:
      raise ValueError(f"GradingConfig.max_failure_fraction={self.max_failure_fraction} must be "
                       "in [0, 1].")
    if self.max_prefill_len is not None and (
        isinstance(self.max_prefill_len, bool) or not isinstance(self.max_prefill_len, int)
        or self.max_prefill_len < 1):
      raise ValueError(f"GradingConfig.max_prefill_len={self.max_prefill_len!r} must be an int "
                       ">= 1 (tokens) or None (the whole sequence budget).")
    if (not isinstance(self.reasoning_markers, str) or self.reasoning_markers not in (
        "auto", "none") and len(self.reasoning_markers.split()) != 2):
      raise ValueError(f"GradingConfig.reasoning_markers={self.reasoning_markers!r}; use "
                       "'auto', 'none', or the open and close markers separated by a space, "
                       "e.g. '<think> </think>'.")

  def prompt_budget(self, max_seq_len: int) -> int:
    """Longest prompt in tokens: min(max_prefill_len, max_seq_len - min_completion_tokens).

    Raises:
      ValueError: when max_seq_len leaves no prompt token once min_completion_tokens are
        reserved, or when max_prefill_len exceeds that (naming the settings and the fix).
    """
    budget = max_seq_len - self.min_completion_tokens
    if budget < 1:
      raise ValueError(f"max_seq_len={max_seq_len} leaves no prompt token once "
                       f"GradingConfig.min_completion_tokens={self.min_completion_tokens} are "
                       "reserved for the completion; raise max_seq_len or lower "
                       "min_completion_tokens.")
    if self.max_prefill_len is None:
      return budget
    if self.max_prefill_len > budget:
      raise ValueError(f"GradingConfig.max_prefill_len={self.max_prefill_len} exceeds "
                       f"max_seq_len={max_seq_len} - min_completion_tokens="
                       f"{self.min_completion_tokens} = {budget}: such prompts leave no room for "
                       "the completion; lower max_prefill_len (or leave it None), or raise "
                       "max_seq_len.")
    return self.max_prefill_len


# ---- prompts -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
  """Prompt ids ready for the sampler, or None when the prompt was filtered.

  Attributes:
    ids: int32[P] prompt ids with P <= max_seq_len - min_completion_tokens, or None (filtered).
    original_length: tokens of the full prompt.
    truncated: whether tokens were dropped ("truncate" policy).
  """

  ids: np.ndarray | None
  original_length: int
  truncated: bool = False


def generation_prompt_ids(tok: tokenizer_lib.Tokenizer) -> list[int]:
  """Ids the chat template appends for `add_generation_prompt` (e.g. "<|im_start|>assistant\\n"),
  [] for raw prompts or when they cannot be told apart."""
  if tok.prompt_format.kind != "chat":
    return []
  messages = [{"role": "user", "content": "x"}]
  kwargs = dict(tok.prompt_format.template_kwargs)
  with_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
  without = tok.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
  if not with_prompt.startswith(without) or with_prompt == without:
    return []
  return tok.encode_chat_text(with_prompt[len(without):])


def prepare_prompt(tok: tokenizer_lib.Tokenizer, prompt: str, max_seq_len: int,
                   cfg: GradingConfig) -> PreparedPrompt:
  """Encodes `prompt` (`tok.encode_prompt`) and applies `cfg.prompt_policy` against the prompt
  budget `cfg.prompt_budget(max_seq_len)` (module docstring).

  Raises:
    ValueError: as `GradingConfig.prompt_budget` (naming the settings).
  """
  budget = cfg.prompt_budget(max_seq_len)
  ids = tok.encode_prompt(prompt)
  if len(ids) <= budget:
    return PreparedPrompt(np.asarray(ids, np.int32), len(ids))
  if cfg.prompt_policy == "filter":
    return PreparedPrompt(None, len(ids))
  tail = generation_prompt_ids(tok)
  if not tail or ids[-len(tail):] != tail or len(tail) >= budget:
    tail = []
  kept = ids[:budget - len(tail)] + tail
  return PreparedPrompt(np.asarray(kept, np.int32), len(ids), truncated=True)


# ---- reasoning blocks ----------------------------------------------------------------------------
def resolve_reasoning_markers(tok: tokenizer_lib.Tokenizer,
                              cfg: GradingConfig) -> tuple[str, str] | None:
  """The (open, close) reasoning markers `cfg.reasoning_markers` names for `tok`, or None."""
  if cfg.reasoning_markers == "none":
    return None
  if cfg.reasoning_markers == "auto":
    return tok.reasoning_markers
  open_marker, close_marker = cfg.reasoning_markers.split()
  return open_marker, close_marker


def completion_for_grading(tok: tokenizer_lib.Tokenizer, prompt_ids, completion_ids,
                           markers: tuple[str, str] | None) -> str:
  """The text a task's `reward` grades: the decoded completion after its reasoning block.

  Args:
    tok: the tokenizer.
    prompt_ids: int[P] prompt ids (tells whether the completion starts inside a block).
    completion_ids: int[T] sampled ids.
    markers: (open, close) markers (`resolve_reasoning_markers`), or None: the whole completion.

  Returns:
    The text after the last closing marker; the whole text when it has no block; "" when a
    block is left open (no final answer: graded as the empty completion).
  """
  text = tok.decode(completion_ids)
  if markers is None:
    return text
  prompt = tok.decode(prompt_ids, stop_at_eos=False)
  starts_inside = prompt.rfind(markers[0]) > prompt.rfind(markers[1])
  after = answers.text_after_reasoning(text, markers, starts_inside)
  return "" if after is None else after


# ---- overlong completions ------------------------------------------------------------------------
def soft_overlong_penalty(length: int, max_tokens: int, buffer_tokens: int) -> float:
  """DAPO's soft overlong punishment R_length (Yu et al. 2025, Sec. 3.4, Eq. 13), in [-1, 0].

  Args:
    length: completion length |y| in tokens (>= 0).
    max_tokens: L_max in tokens.
    buffer_tokens: L_cache in tokens (>= 1, < max_tokens).

  Returns:
    0 for |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache up to L_max; -1 beyond.

  Raises:
    ValueError: when buffer_tokens < 1 or >= max_tokens, or length < 0.
  """
  if not 1 <= buffer_tokens < max_tokens or length < 0:
    raise ValueError(f"soft_overlong_penalty needs 1 <= L_cache={buffer_tokens} < L_max="
                     f"{max_tokens} and |y|={length} >= 0.")
  free = max_tokens - buffer_tokens
  if length <= free:
    return 0.0
  if length <= max_tokens:
    return (free - length) / buffer_tokens
  return -1.0


def is_cut(rollout: Rollout) -> bool:
  """Whether the completion was cut by the length limit (`CUT_FINISH_REASONS`)."""
  return rollout.finish_reason in CUT_FINISH_REASONS


def apply_overlong_policy(reward: float, rollout: Rollout, cfg: GradingConfig,
                          completion_budget: int) -> float:
  """The reward after `cfg.overlong_policy` (module docstring); NaN stays NaN.

  Args:
    reward: the verifier's reward (NaN = failed).
    rollout: the sample (its finish reason and completion length).
    cfg: the policy.
    completion_budget: the sample's completion budget in tokens (L_max when
      `cfg.overlong_max_tokens` is None). L_cache is capped at L_max - 1.
  """
  if math.isnan(reward) or cfg.overlong_policy == "keep":
    return reward
  if cfg.overlong_policy == "zero":
    return 0.0 if is_cut(rollout) else reward
  if cfg.overlong_policy == "mask":
    return math.nan if is_cut(rollout) else reward
  max_tokens = cfg.overlong_max_tokens or completion_budget
  buffer_tokens = min(cfg.overlong_buffer_tokens, max_tokens - 1)
  if buffer_tokens < 1:  # a 1-token budget leaves no buffer: only a cut is penalised
    return reward - 1.0 if is_cut(rollout) else reward
  return reward + soft_overlong_penalty(rollout.num_completion_tokens, max_tokens, buffer_tokens)


# ---- failures ------------------------------------------------------------------------------------
class FailureMonitor:
  """Raises `RewardFailureError` when the failure share of the last `window` calls is too high."""

  def __init__(self, max_failure_fraction: float, window: int):
    self.max_failure_fraction, self.window = max_failure_fraction, window
    self._recent: collections.deque[bool] = collections.deque(maxlen=window)
    self._first_failure: str | None = None

  def record(self, verdict: safe_reward.Verdict, sample_id: int, task_name: str) -> None:
    """Counts one verdict; raises once the window is full and the share exceeds the limit."""
    self._recent.append(verdict.failed)
    if verdict.failed and self._first_failure is None:
      self._first_failure = f"sample {sample_id}: {verdict.outcome}: {verdict.detail}"
    if len(self._recent) < self.window or self.max_failure_fraction >= 1.0:
      return
    failed = sum(self._recent)
    if failed > self.max_failure_fraction * self.window:
      raise RewardFailureError(
          f"{failed} of the last {self.window} reward calls of task {task_name!r} failed "
          f"(limit {self.max_failure_fraction:.0%}); first failure: {self._first_failure}. "
          "Fix the task's reward function, raise the reward timeout, or raise "
          "GradingConfig.max_failure_fraction (1.0 never stops).")


def batch_metrics(rollouts: Sequence[Rollout]) -> dict[str, float | int]:
  """Per-step metrics of the samples of the groups a learner step consumed.

  Returns:
    {"frac_length_cut": share of samples cut by the length limit, "samples_unrewarded": samples
    without a reward (failed verifier or masked; not trained), "frac_prompt_truncated": share of
    samples whose prompt was truncated}.
  """
  n = max(len(rollouts), 1)
  return {
      "frac_length_cut": sum(is_cut(r) for r in rollouts) / n,
      "samples_unrewarded": int(sum(math.isnan(r.reward) for r in rollouts)),
      "frac_prompt_truncated": sum(bool(r.prompt_truncated) for r in rollouts) / n,
  }
