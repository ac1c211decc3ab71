"""Reward models for the simulator: which simulated groups have learning signal.

The simulator needs rewards only for dynamic sampling (`pipeline.group_filter`): a group whose
rewards are all equal is dropped by the queue and replaced. Each model is a frozen dataclass with
`sample_groups(rng, num_groups, group_size, offset) -> float64[num_groups, group_size]`.

  * `SolveRate`: prompt difficulty varies; prompt i has solve rate q_i ~ Beta(alpha, beta) and
    each of its samples is right (reward 1) with probability q_i, independently. The chance that a
    group of S samples is all right or all wrong, i.e. zero-variance, is
    E[q^S + (1 - q)^S] = B(alpha + S, beta) / B(alpha, beta) + B(alpha, beta + S) / B(alpha, beta)
    (`zero_variance_probability`), which is what DAPO's dynamic sampling filters
    (arXiv 2503.14476, Sec. 3.2).
  * `RewardReplay`: the rewards of a recorded run, group by group (tests replay a real run).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from rlax_pipe.sim.distributions import replay_groups


@dataclasses.dataclass(frozen=True)
class SolveRate:
  """Bernoulli rewards with a Beta-distributed solve rate per prompt.

  Attributes:
    alpha, beta: Beta parameters of a prompt's solve rate q (> 0); E[q] = alpha / (alpha + beta).
  """

  alpha: float
  beta: float

  def __post_init__(self):
    if not (self.alpha > 0 and self.beta > 0):
      raise ValueError(f"SolveRate: alpha={self.alpha} and beta={self.beta} must be > 0.")

  def sample_groups(self, rng: np.random.Generator, num_groups: int, group_size: int,
                    offset: int = 0) -> np.ndarray:
    """float64[num_groups, group_size] rewards in {0, 1}: one q per group, S Bernoulli(q)."""
    del offset
    q = rng.beta(self.alpha, self.beta, size=(num_groups, 1))
    return (rng.random((num_groups, group_size)) < q).astype(np.float64)

  def zero_variance_probability(self, group_size: int) -> float:
    """P(a group of `group_size` samples has all rewards equal) =
    [B(a + S, b) + B(a, b + S)] / B(a, b), with B the Beta function (log-gamma form).

    Raises:
      ValueError: if group_size < 1.
    """
    if group_size < 1:
      raise ValueError(f"zero_variance_probability: group_size={group_size} must be >= 1.")
    a, b, s = self.alpha, self.beta, group_size

    def log_beta(x, y):
      return math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)

    base = log_beta(a, b)
    return math.exp(log_beta(a + s, b) - base) + math.exp(log_beta(a, b + s) - base)


@dataclasses.dataclass(frozen=True)
class RewardReplay:
  """Replays recorded rewards in order (group i of a run is groups[i mod len(groups)]).

  Attributes:
    groups: recorded groups of rewards (floats, NaN = missing), all of one size, in order.
  """

  groups: tuple[tuple[float, ...], ...]

  def __post_init__(self):
    if not self.groups or len({len(g) for g in self.groups}) != 1:
      raise ValueError("RewardReplay: groups must be a non-empty tuple of equal-size groups.")

  def sample_groups(self, rng: np.random.Generator, num_groups: int, group_size: int,
                    offset: int = 0) -> np.ndarray:
    """Groups offset .. offset + num_groups - 1 (cyclically).

    Raises:
      ValueError: if group_size differs from the recorded groups'.
    """
    del rng
    return replay_groups(self.groups, np.float64, num_groups, group_size, offset, "RewardReplay")
