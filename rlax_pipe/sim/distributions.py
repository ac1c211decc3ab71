"""Completion-length distributions for the simulator: empirical, log-normal, Pareto, constant.

Each is a frozen dataclass with `sample(rng, n) -> int64[n]` (lengths in tokens, in
[1, max_len]) and `mean()`. The simulator draws the lengths of a prompt group at once with
`sample_groups`: i.i.d. draws for every distribution except `GroupedEmpirical`, which resamples
whole observed groups and so keeps the correlation of lengths within a prompt's group (samples of
one prompt share its difficulty and its completion budget, which shortens stragglers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, Sequence

import numpy as np


class LengthDist(Protocol):
  """A completion-length distribution (tokens)."""

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    """int64[n] lengths, each in [1, max_len]."""

  def mean(self) -> float:
    """E[L] in tokens (after capping)."""


def sample_groups(dist, rng: np.random.Generator, num_groups: int, group_size: int,
                  offset: int = 0) -> np.ndarray:
  """int64[num_groups, group_size] lengths: `dist.sample_groups` if it has one, else i.i.d.

  Args:
    dist: the distribution.
    rng: random generator.
    num_groups, group_size: shape of the draw.
    offset: groups drawn before this call (only `Replay` uses it).
  """
  if isinstance(dist, Replay):
    return dist.sample_groups(rng, num_groups, group_size, offset)
  if hasattr(dist, "sample_groups"):
    return dist.sample_groups(rng, num_groups, group_size)
  return np.asarray(dist.sample(rng, num_groups * group_size), np.int64).reshape(
      num_groups, group_size)


def replay_groups(groups, dtype, num_groups: int, group_size: int, offset: int,
                  owner: str) -> np.ndarray:
  """Recorded groups offset .. offset + num_groups - 1, cycling through the record.

  Args:
    groups: [G][group_size] recorded values (lengths, rewards), G >= 1.
    dtype: numpy dtype of the result.
    owner: the replaying class's name, for the error message.

  Returns:
    [num_groups, group_size] array of `dtype`.

  Raises:
    ValueError: if group_size differs from the recorded groups'.
  """
  arr = np.asarray(groups, dtype)
  if group_size != arr.shape[1]:
    raise ValueError(f"{owner}: recorded groups have {arr.shape[1]} samples, not {group_size}.")
  return arr[(offset + np.arange(num_groups)) % arr.shape[0]]


def _cap(x: np.ndarray, max_len: int | None) -> np.ndarray:
  x = np.maximum(1, np.rint(x)).astype(np.int64)
  return x if max_len is None else np.minimum(x, max_len)


@dataclasses.dataclass(frozen=True)
class Constant:
  """Every completion has `length` tokens (>= 1)."""

  length: int

  def __post_init__(self):
    if self.length < 1:
      raise ValueError(f"Constant.length={self.length} must be >= 1.")

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    del rng
    return np.full(n, self.length, np.int64)

  def mean(self) -> float:
    return float(self.length)


@dataclasses.dataclass(frozen=True)
class Empirical:
  """Resamples (with replacement) the lengths observed in a run.

  Attributes:
    values: observed completion lengths (tokens, each >= 1), e.g. from
      `rlax_pipe.sim.calibration.lengths_from_run`.
  """

  values: tuple[int, ...]

  def __post_init__(self):
    if not self.values or min(self.values) < 1:
      raise ValueError("Empirical.values must be non-empty and >= 1.")

  @classmethod
  def of(cls, values: Sequence[int] | np.ndarray) -> Empirical:
    """From any integer sequence."""
    return cls(tuple(int(v) for v in np.asarray(values).ravel()))

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    return np.asarray(self.values, np.int64)[rng.integers(0, len(self.values), n)]

  def mean(self) -> float:
    return float(np.mean(self.values))


@dataclasses.dataclass(frozen=True)
class GroupedEmpirical:
  """Resamples whole observed prompt groups (with replacement).

  Attributes:
    groups: observed groups, each a tuple of the completion lengths (tokens, >= 1) of one
      prompt's samples; all groups have the same size.
  """

  groups: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    if not self.groups or len({len(g) for g in self.groups}) != 1 or not self.groups[0]:
      raise ValueError("GroupedEmpirical.groups must be non-empty groups of one size.")
    if min(min(g) for g in self.groups) < 1:
      raise ValueError("GroupedEmpirical: lengths must be >= 1.")

  @classmethod
  def of(cls, lengths: Sequence[int] | np.ndarray, group_size: int) -> GroupedEmpirical:
    """From lengths listed group by group (consecutive runs of `group_size`).

    Raises:
      ValueError: if the count is not a multiple of group_size.
    """
    x = np.asarray(lengths, np.int64).ravel()
    if group_size < 1 or x.size == 0 or x.size % group_size:
      raise ValueError(f"GroupedEmpirical.of: {x.size} lengths are not whole groups of "
                       f"{group_size}.")
    return cls(tuple(tuple(int(v) for v in row) for row in x.reshape(-1, group_size)))

  def sample_groups(self, rng: np.random.Generator, num_groups: int, group_size: int
                    ) -> np.ndarray:
    """Whole observed groups when the sizes match; else i.i.d. draws of observed lengths."""
    arr = np.asarray(self.groups, np.int64)
    if group_size != arr.shape[1]:
      return self.sample(rng, num_groups * group_size).reshape(num_groups, group_size)
    return arr[rng.integers(0, arr.shape[0], num_groups)]

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    flat = np.asarray(self.groups, np.int64).ravel()
    return flat[rng.integers(0, flat.size, n)]

  def mean(self) -> float:
    return float(np.mean(self.groups))


@dataclasses.dataclass(frozen=True)
class Replay:
  """Replays observed groups in order (group i of a run is groups[i mod len(groups)]).

  Deterministic: with the lengths of a round-based run in training order, the simulator
  reproduces that run's timeline (the check behind the "replay" column of
  experiments/lib/sim_validation.py).

  Attributes:
    groups: observed groups (tuples of lengths, tokens >= 1), all of one size, in order.
  """

  groups: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    GroupedEmpirical(self.groups)  # same validation

  @classmethod
  def of(cls, lengths: Sequence[int] | np.ndarray, group_size: int) -> Replay:
    """From lengths listed group by group."""
    return cls(GroupedEmpirical.of(lengths, group_size).groups)

  def sample_groups(self, rng: np.random.Generator, num_groups: int, group_size: int,
                    offset: int = 0) -> np.ndarray:
    """Groups offset .. offset + num_groups - 1 (cyclically).

    Raises:
      ValueError: if group_size differs from the recorded groups'.
    """
    del rng
    return replay_groups(self.groups, np.int64, num_groups, group_size, offset, "Replay")

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    del rng
    flat = np.asarray(self.groups, np.int64).ravel()
    return flat[np.arange(n) % flat.size]

  def mean(self) -> float:
    return float(np.mean(self.groups))


@dataclasses.dataclass(frozen=True)
class LogNormal:
  """L = round(exp(m + sigma Z)) capped to [1, max_len], with m set so that E[exp(m + sigma Z)]
  = `mean_tokens` (m = ln(mean) - sigma^2 / 2).

  Attributes:
    mean_tokens: mean before rounding and capping (> 0).
    sigma: standard deviation of ln L (>= 0); ~0.5-1 is typical of reasoning traces.
    max_len: cap (the sampler's max_new_tokens), or None.
  """

  mean_tokens: float
  sigma: float
  max_len: int | None = None

  def __post_init__(self):
    if self.mean_tokens <= 0 or self.sigma < 0:
      raise ValueError(f"LogNormal: mean_tokens={self.mean_tokens} > 0 and sigma={self.sigma} "
                       ">= 0 required.")
    if self.max_len is not None and self.max_len < 1:
      raise ValueError(f"LogNormal.max_len={self.max_len} must be >= 1.")

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    m = math.log(self.mean_tokens) - self.sigma ** 2 / 2
    return _cap(np.exp(m + self.sigma * rng.standard_normal(n)), self.max_len)

  def mean(self) -> float:
    return float(self.sample(np.random.default_rng(0), 200_000).mean())


@dataclasses.dataclass(frozen=True)
class Pareto:
  """Pareto I lengths, L = round(x_min * U^(-1/alpha)) capped to max_len (inverse CDF of
  F(x) = 1 - (x_min / x)^alpha, x >= x_min).

  Attributes:
    x_min: scale, the shortest length (tokens, >= 1).
    alpha: tail index (> 0); the mean is finite for alpha > 1, the variance for alpha > 2.
    max_len: cap (tokens), or None (then alpha must be > 1).
  """

  x_min: float
  alpha: float
  max_len: int | None = None

  def __post_init__(self):
    if self.x_min < 1 or self.alpha <= 0:
      raise ValueError(f"Pareto: x_min={self.x_min} >= 1 and alpha={self.alpha} > 0 required.")
    if self.max_len is None and self.alpha <= 1:
      raise ValueError("Pareto: alpha <= 1 has an infinite mean; set max_len.")

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    u = 1.0 - rng.random(n)  # in (0, 1]
    return _cap(self.x_min * u ** (-1.0 / self.alpha), self.max_len)

  def mean(self) -> float:
    return float(self.sample(np.random.default_rng(0), 200_000).mean())


@dataclasses.dataclass(frozen=True)
class BodyTail:
  """A long-tailed workload stated by its tail: a share `1 - tail_fraction` of the samples
  drawn from `body`, the rest uniform in [tail_low, tail_high] tokens (the stragglers), each
  sample independently.

  E.g. the founding talk's workload, "99% of samples finish in ~40 s, the last 1% take ~80 s
  more": tail_fraction 0.01, body capped where a sample takes ~40 s, tail up to ~3x that length.

  Attributes:
    body: the distribution of the bulk (a `LengthDist`).
    tail_fraction: share of stragglers, in [0, 1).
    tail_low, tail_high: straggler lengths (tokens, 1 <= low <= high).
  """

  body: Any
  tail_fraction: float
  tail_low: int
  tail_high: int

  def __post_init__(self):
    if not 0 <= self.tail_fraction < 1 or not 1 <= self.tail_low <= self.tail_high:
      raise ValueError(f"BodyTail: tail_fraction={self.tail_fraction} must be in [0, 1) and "
                       f"1 <= tail_low={self.tail_low} <= tail_high={self.tail_high}.")

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    out = np.asarray(self.body.sample(rng, n), np.int64)
    tail = rng.random(n) < self.tail_fraction
    out[tail] = rng.integers(self.tail_low, self.tail_high + 1, int(tail.sum()))
    return out

  def mean(self) -> float:
    return ((1 - self.tail_fraction) * float(self.body.mean())
            + self.tail_fraction * (self.tail_low + self.tail_high) / 2)
