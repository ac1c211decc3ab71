"""The tool evaluation's statistics (experiments/lib/tool_eval.py): Wilson intervals against the
closed form, and binning of an EvalResult by number of terms."""

import math

import pytest

from lib import tool_eval
from rlax_pipe import evaluation


def _wilson_closed_form(k, n, z=1.959963984540054):
  """Wilson (1927): (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)."""
  p = k / n
  centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
  return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


@pytest.mark.parametrize("k,n", [(0, 5), (3, 10), (47, 47), (60, 128)])
def test_wilson_matches_the_closed_form(k, n):
  assert tool_eval.wilson(k, n) == pytest.approx(_wilson_closed_form(k, n), abs=1e-9)
  with pytest.raises(ValueError):
    tool_eval.wilson(3, 0)


def test_binned_counts_correct_problems_and_tool_use_per_bin():
  res = evaluation.EvalResult(
      accuracy=0.5, num_problems=8, mean_completion_tokens=10.0,
      accuracy_by_difficulty={3.0: 0.75, 5.0: 0.5, 6.0: 0.0, 12.0: 0.0},
      count_by_difficulty={3.0: 4, 5.0: 2, 6.0: 1, 12.0: 1},
      tool_use_by_difficulty={3.0: 0.5, 5.0: 1.0, 6.0: 0.0, 12.0: 1.0})
  rows = {r["terms"]: r for r in tool_eval.binned(res)}
  assert sorted(rows) == ["10-32", "3", "5-6"]  # empty bins are left out
  assert (rows["3"]["n"], rows["3"]["correct"], rows["3"]["tool_use"]) == (4, 3, 0.5)
  assert (rows["5-6"]["n"], rows["5-6"]["correct"]) == (3, 1)
  assert rows["5-6"]["tool_use"] == pytest.approx(2 / 3)
  assert rows["10-32"]["ci95"] == pytest.approx(_wilson_closed_form(0, 1))
  single = evaluation.EvalResult(accuracy=1.0, num_problems=1, mean_completion_tokens=3.0,
                                 accuracy_by_difficulty={4.0: 1.0}, count_by_difficulty={4.0: 1})
  assert tool_eval.binned(single)[0]["tool_use"] is None  # single-turn: no tool use to report
  assert "| yes |" in tool_eval.markdown([{"model": "/r/a/hf", "with_tool": True,
                                           "accuracy": 0.5, "ci95": (0.2, 0.8),
                                           "per_terms": tool_eval.binned(res),
                                           "tool_calls": 3}])
