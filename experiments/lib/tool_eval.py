"""Held-out accuracy of a model directory on the arithmetic task, with and without the calculator
tool, per number of terms, with 95% intervals (issue #23: "tool use measurably changes accuracy").

With the tool, every problem runs as an episode of the calculator environment
(`envs.CalculatorArithmeticTask`, `envs.evaluation_engine`): a turn ending in "<expr>=" gets the
calculator's value and the model answers in a second turn. Without it, the same problems run
single-turn on the plain arithmetic task: a turn ending in "<expr>=" is a final answer without
"A:", graded 0. Both are greedy on the same held-out problems (the first n of the "eval" split).

Intervals: Wilson score intervals of a binomial proportion (Wilson 1927, "Probable inference,
the law of succession, and statistical inference", JASA 22: 209-212; computed by
`scipy.stats.binomtest(...).proportion_ci(method="wilson")`), per bin of terms and overall.
"""

from __future__ import annotations

import json
import pathlib
from typing import Sequence

import jax
from scipy import stats

from rlax_pipe import envs
from rlax_pipe import evaluation
from rlax_pipe import model_dir
from rlax_pipe import sft
from rlax_pipe import tasks
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import Transformer, hf_io

# Bins of the number of terms: [lo, hi] inclusive.
TERM_BINS: tuple[tuple[int, int], ...] = ((3, 3), (4, 4), (5, 6), (7, 9), (10, 32))


def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
  """(low, high) Wilson score interval of k successes in n trials (see the module docstring).

  Raises:
    ValueError: on n < 1 or k outside [0, n].
  """
  if n < 1 or not 0 <= k <= n:
    raise ValueError(f"wilson(k={k}, n={n}): need n >= 1 and 0 <= k <= n.")
  ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence, method="wilson")
  return float(ci.low), float(ci.high)


def binned(result: evaluation.EvalResult,
           bins: Sequence[tuple[int, int]] = TERM_BINS) -> list[dict]:
  """Per bin of terms: problems n, correct k, accuracy with its Wilson interval, and the share
  of problems whose episode called the tool (None for single-turn evaluations)."""
  rows = []
  for lo, hi in bins:
    keys = [d for d in result.count_by_difficulty if lo <= d <= hi]
    n = sum(result.count_by_difficulty[d] for d in keys)
    if n == 0:
      continue
    k = round(sum(result.accuracy_by_difficulty[d] * result.count_by_difficulty[d] for d in keys))
    used = (sum(result.tool_use_by_difficulty[d] * result.count_by_difficulty[d] for d in keys)
            / n if result.tool_use_by_difficulty else None)
    rows.append({"terms": f"{lo}" if lo == hi else f"{lo}-{hi}", "n": n, "correct": k,
                 "accuracy": k / n, "ci95": wilson(k, n), "tool_use": used})
  return rows


def evaluate_dir(path: str, num_problems: int, with_tool: bool, slots: int = 32,
                 max_seq_len: int = 384) -> dict:
  """Greedy held-out evaluation of the model directory `path` (see the module docstring).

  Returns:
    {"accuracy", "ci95", "n", "per_terms": `binned` rows, "tool_calls", "tool_failures",
     "mean_turns", "mean_completion_tokens"}.

  Raises:
    FileNotFoundError / ValueError: from `hf_io.load_hf_checkpoint` / the tokenizer.
  """
  model_cfg, params = hf_io.load_hf_checkpoint(path)
  tok, _ = model_dir.tokenizer_for(path)
  name = "arithmetic_calculator" if with_tool else "arithmetic"
  task = tasks.make_task(name)
  engine = sft.eval_engine(Transformer(model_cfg), jax.device_put(params, jax.devices()[0]),
                           tok, slots=slots, max_seq_len=min(max_seq_len, model_cfg.max_seq_len),
                           sampling=SamplingConfig(greedy=True))
  if with_tool:
    engine = envs.evaluation_engine(engine, task, tok)
  try:
    res = evaluation.evaluate(engine, task, tok, evaluation.eval_problems(task, num_problems))
  finally:
    if with_tool:
      engine.close()
  k = round(res.accuracy * res.num_problems)
  return {"model": str(path), "with_tool": with_tool, "accuracy": res.accuracy,
          "ci95": wilson(k, res.num_problems), "n": res.num_problems,
          "per_terms": binned(res), "tool_calls": res.tool_calls,
          "tool_failures": res.tool_failures, "mean_turns": res.mean_turns,
          "mean_completion_tokens": res.mean_completion_tokens}


def markdown(rows: Sequence[dict]) -> str:
  """A table: one line per (model, tool) evaluation, accuracy [95% CI] per bin of terms."""
  bins = [b["terms"] for b in rows[0]["per_terms"]] if rows else []
  head = ("| model | tool | all | " + " | ".join(f"{b} terms" for b in bins)
          + " | tool calls |\n|" + "---|" * (len(bins) + 4) + "\n")
  lines = []
  for r in rows:
    cells = [f"{b['accuracy']:.2f} [{b['ci95'][0]:.2f}, {b['ci95'][1]:.2f}] (n={b['n']}"
             + (f", used {b['tool_use']:.2f})" if b["tool_use"] is not None else ")")
             for b in r["per_terms"]]
    lines.append(f"| {pathlib.Path(r['model']).parent.name}/{pathlib.Path(r['model']).name} | "
                 f"{'yes' if r['with_tool'] else 'no'} | {r['accuracy']:.3f} "
                 f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] | " + " | ".join(cells)
                 + f" | {r['tool_calls']} |")
  return head + "\n".join(lines)


def dumps(rows: Sequence[dict]) -> str:
  """The rows as JSON lines."""
  return "\n".join(json.dumps(r) for r in rows)
