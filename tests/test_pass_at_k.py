"""Unbiased pass@k (Chen et al. 2021) against exact binomials, and its config validation."""

import itertools
import math
from fractions import Fraction

import pytest

from rlax_pipe import evaluation
from rlax_pipe.pipeline import config as pconfig


@pytest.mark.parametrize("n", [1, 2, 5, 16, 200])
def test_pass_at_k_matches_exact_binomial_ratio(n):
  for c in sorted({0, 1, n // 3, n // 2, n - 1, n}):
    for k in sorted({1, 2, n // 2, n} - {0}):
      if k > n or c < 0:
        continue
      exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
      assert evaluation.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


def test_pass_at_k_is_the_probability_that_a_random_k_subset_holds_a_pass():
  """Definition by enumeration: the fraction of k-subsets of the n samples with a correct one."""
  n, c = 6, 2
  samples = [1] * c + [0] * (n - c)
  for k in range(1, n + 1):
    subsets = list(itertools.combinations(samples, k))
    want = sum(any(s) for s in subsets) / len(subsets)
    assert evaluation.pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12)
  assert evaluation.pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 = mean@n for 0/1


def test_pass_at_k_rejects_bad_arguments_and_config_validates_k():
  for args in ((0, 0, 1), (4, 5, 1), (4, 1, 5), (4, 1, 0)):
    with pytest.raises(ValueError, match="pass_at_k"):
      evaluation.pass_at_k(*args)
  assert pconfig.PipelineConfig().pass_ks == ()
  assert pconfig.PipelineConfig(eval_samples=8).pass_ks == (1, 8)
  assert pconfig.PipelineConfig(eval_samples=8, eval_pass_k=(4, 1)).pass_ks == (1, 4)
  with pytest.raises(ValueError, match="eval_pass_k"):
    pconfig.PipelineConfig(eval_samples=2, eval_pass_k=(4,))
  with pytest.raises(ValueError, match="eval_samples=0"):
    pconfig.PipelineConfig(eval_pass_k=(1,))
  with pytest.raises(ValueError, match="eval_samples"):
    pconfig.PipelineConfig(eval_samples=-1)


def test_plot_keys_of_sampled_eval_rows():
  from rlax_pipe import plots  # pylint: disable=import-outside-toplevel
  rows = [{"heldout_accuracy": 0.5, "heldout_pass_at_16": 0.9, "heldout_pass_at_2": 0.7,
           "heldout_mean_at_16": 0.4}, {"heldout_accuracy": 0.6}]
  assert plots.sampled_eval_keys(rows) == ["heldout_mean_at_16", "heldout_pass_at_2",
                                           "heldout_pass_at_16"]
  assert plots.sampled_eval_keys([{"heldout_accuracy": 0.5}]) == []
