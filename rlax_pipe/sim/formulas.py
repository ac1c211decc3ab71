"""Closed-form models of staleness, lag and throughput in asynchronous RL (pure Python + numpy).

Every function states its source and equation. Units: lengths in tokens, times in seconds, rates
in samples per second, staleness in optimizer steps.

Terms used throughout (Applied Compute, "Predicting and Controlling Staleness in Fully
Asynchronous RL Training", 2026; /work/shared/reference/papers.md, section 1b):
  C        concurrency: samples being generated at once (decode slots over all sampler engines).
  B        learner batch in samples (groups_per_step * group_size).
  S        samples per prompt group (group_size); a group is queued when its last sample ends.
  M_tail   tailness E[max of the S lengths of a group] / E[L] (>= 1; 1 for constant lengths).
  v_rollout  samples/s the sampler side produces when never stalled (C / E[group time] * S in
           steady state); v_train = samples/s the learner consumes when never starved (B / step
           time).
  rho      utilization v_rollout / v_train; rho < 1 rollout-bound, rho > 1 train-bound.
  q        queue factor: queue capacity / B (queue-drop), 1 is the authors' recommendation.
Staleness of a sample = learner updates between the start of its generation and the step that
trains it, i.e. the lag of its oldest token (`rlax_pipe.pipeline.rules.sample_lag`).
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np


def _lengths_1d(lengths: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
  x = np.asarray(lengths, dtype=np.float64)
  if x.ndim != 1 or x.size == 0:
    raise ValueError(f"{name}: lengths must be a non-empty 1-D sequence, got shape {x.shape}.")
  if np.any(x <= 0) or not np.all(np.isfinite(x)):
    raise ValueError(f"{name}: lengths must be finite and > 0.")
  return x


def expected_max_of_k(lengths: Sequence[float] | np.ndarray, k: int) -> float:
  """E[max of k i.i.d. draws] from the empirical distribution of `lengths` (exact, no sampling).

  With the sample sorted, x_(1) <= ... <= x_(n), P(max <= x_(i)) = (i/n)^k, so
  E[max] = sum_i x_(i) * ((i/n)^k - ((i-1)/n)^k) (order statistics of a discrete uniform draw).

  Args:
    lengths: float[n] sample of lengths (tokens or seconds), n >= 1, all > 0.
    k: draws per maximum (>= 1).

  Returns:
    The expected maximum (same unit as `lengths`).

  Raises:
    ValueError: on an empty or non-positive sample or k < 1.
  """
  if k < 1:
    raise ValueError(f"expected_max_of_k: k={k} must be >= 1.")
  x = np.sort(_lengths_1d(lengths, "expected_max_of_k"))
  n = x.shape[0]
  cdf = (np.arange(1, n + 1, dtype=np.float64) / n) ** k
  weights = np.diff(np.concatenate([[0.0], cdf]))
  return float(np.dot(weights, x))


def tailness(lengths: Sequence[float] | np.ndarray, group_size: int) -> float:
  """Applied Compute's tailness M_tail = E[max of the S lengths in a group] / E[L].

  Estimated from an i.i.d. length sample with `expected_max_of_k` (a group's S lengths are
  treated as independent draws; correlated lengths within a prompt make the true value smaller).

  Args:
    lengths: float[n] completion lengths (tokens), all > 0.
    group_size: S (>= 1); S = 1 gives exactly 1.

  Returns:
    M_tail >= 1.
  """
  x = _lengths_1d(lengths, "tailness")
  return expected_max_of_k(x, group_size) / float(x.mean())


def tailness_from_groups(lengths_GS: np.ndarray) -> float:
  """M_tail from observed groups: mean over groups of max length / mean length.

  Args:
    lengths_GS: float[G, S] lengths of G groups of S samples each.

  Returns:
    M_tail >= 1.

  Raises:
    ValueError: if the array is not 2-D and non-empty, or has a non-positive length.
  """
  x = np.asarray(lengths_GS, np.float64)
  if x.ndim != 2 or x.size == 0:
    raise ValueError(f"tailness_from_groups: want float[G, S], got shape {x.shape}.")
  _lengths_1d(x.ravel(), "tailness_from_groups")
  return float(x.max(axis=1).mean() / x.mean())


def applied_compute_staleness(concurrency: float, batch_size: float, rho: float,
                              tail: float, queue_factor: float = 1.0) -> float:
  """Mean staleness of a fully asynchronous run, Applied Compute (2026), closed form.

  staleness = PQS + IQS (pre-queue: updates while the sample is generated; in-queue: updates
  while it waits):
    rollout-bound, rho <= 1:  C * M_tail / B + rho
    train-bound,   rho >  1:  C * M_tail / (rho * B) + (2q + rho - 1) / (2 rho)
  (The two branches agree at rho = 1 when q = 1.) Mean response length cancels out: only its
  tail shape enters.

  Args:
    concurrency: C, samples in flight (> 0).
    batch_size: B, samples per learner step (> 0).
    rho: v_rollout / v_train (> 0).
    tail: M_tail (>= 1), see `tailness`.
    queue_factor: q = queue capacity / B (>= 1); only the train-bound branch uses it.

  Returns:
    Mean staleness in optimizer steps.

  Raises:
    ValueError: on out-of-range arguments.
  """
  if concurrency <= 0 or batch_size <= 0 or rho <= 0:
    raise ValueError(f"applied_compute_staleness: C={concurrency}, B={batch_size}, rho={rho} "
                     "must all be > 0.")
  if tail < 1 or queue_factor < 1:
    raise ValueError(f"applied_compute_staleness: M_tail={tail} and q={queue_factor} must be "
                     ">= 1.")
  if rho <= 1:
    return concurrency * tail / batch_size + rho
  return (concurrency * tail / (rho * batch_size)
          + (2 * queue_factor + rho - 1) / (2 * rho))


def pipeline_max_lag(t_gen: float, t_train: float) -> int:
  """PipelineRL's bound on token lag: g_max = ceil(t_gen / t_train).

  Piche et al., "PipelineRL" (arXiv 2509.19128), Sec. 4: a sequence generated for t_gen seconds
  while the learner finishes a step every t_train seconds sees at most ceil(t_gen / t_train)
  weight updates, so its first tokens lag by that many steps.

  Args:
    t_gen: generation time of the longest sequence (seconds, >= 0).
    t_train: time of one optimizer step including the weight push (seconds, > 0).

  Returns:
    g_max in optimizer steps.
  """
  if t_gen < 0 or t_train <= 0:
    raise ValueError(f"pipeline_max_lag: t_gen={t_gen} must be >= 0, t_train={t_train} > 0.")
  return int(math.ceil(t_gen / t_train - 1e-12))


def split_for_rho(num_devices: float, rho: float, c_train: float,
                  c_rollout: float) -> tuple[float, float]:
  """Devices (n_T, n_R) on the learner and sampler sides that give utilization rho.

  With per-device rates v_train = c_T n_T and v_rollout = c_R n_R and n_T + n_R = N:
  rho = c_R n_R / (c_T n_T)  =>  n_T = N / (1 + rho c_T / c_R),  n_R = N - n_T.
  (Applied Compute's talk, papers.md section 1a: the "cast of characters" of the GPU split.)

  Args:
    num_devices: N (> 0).
    rho: target utilization (> 0).
    c_train: c_T, samples/s one learner device consumes (> 0).
    c_rollout: c_R, samples/s one sampler device produces (> 0).

  Returns:
    (n_T, n_R), real numbers summing to N.
  """
  if min(num_devices, rho, c_train, c_rollout) <= 0:
    raise ValueError("split_for_rho: every argument must be > 0.")
  n_t = num_devices / (1.0 + rho * c_train / c_rollout)
  return n_t, num_devices - n_t


def step_period(batch_size: float, num_devices: float, rho: float, c_train: float,
                c_rollout: float) -> float:
  """Seconds per learner step for a fixed device budget split to give utilization rho.

  Applied Compute (2026): period ~ (1 / min(1, rho)) * (1/c_T + rho/c_R). Written out: the
  learner steps once per B samples at rate min(v_train, v_rollout) = v_train * min(1, rho), and
  with `split_for_rho`, v_train = c_T n_T = N / (1/c_T + rho/c_R), so
      period = (B / N) * (1 / min(1, rho)) * (1/c_T + rho/c_R).
  It is minimal at rho = 1 (decreasing in rho below 1, increasing above).

  Args:
    batch_size: B, samples per step (> 0).
    num_devices: N devices shared by learner and sampler (> 0).
    rho: utilization v_rollout / v_train (> 0).
    c_train: c_T, samples/s per learner device (> 0).
    c_rollout: c_R, samples/s per sampler device (> 0).

  Returns:
    Step period in seconds.
  """
  if min(batch_size, num_devices, rho, c_train, c_rollout) <= 0:
    raise ValueError("step_period: every argument must be > 0.")
  return batch_size / num_devices / min(1.0, rho) * (1.0 / c_train + rho / c_rollout)


def sync_idle_fraction(lengths: Sequence[int] | np.ndarray, slots: int) -> float:
  """Idle slot fraction of one synchronous generation round (the sampler waits for the longest).

  The round's samples are started in order into `slots` decode slots (continuous batching: a slot
  takes the next waiting sample as soon as its sample ends); every decode step advances each
  active slot by one token; the round ends with its last sample. Then
      idle = 1 - mean over decode steps of (active slots / slots) = 1 - sum(L) / (slots * T)
  with T the round's length in decode steps. For B <= slots, T = max(L): the straggler effect
  (PipelineRL, arXiv 2509.19128, Fig. 2b; Applied Compute's talk, papers.md section 1a).

  Args:
    lengths: int[B] completion lengths (tokens, >= 1) of the round's samples, start order.
    slots: decode slots (>= 1).

  Returns:
    Idle fraction in [0, 1).
  """
  if slots < 1:
    raise ValueError(f"sync_idle_fraction: slots={slots} must be >= 1.")
  x = _lengths_1d(lengths, "sync_idle_fraction")
  free = [0.0] * min(slots, x.shape[0])  # end times (decode steps) of the busy slots
  heapq.heapify(free)
  for length in x:
    heapq.heappush(free, heapq.heappop(free) + float(length))
  return 1.0 - float(x.sum()) / (slots * max(free))


def lognormal_expected_max(mean: float, sigma: float, k: int) -> float:
  """Extreme-value approximation of E[max of k log-normal lengths].

  For L = exp(m + s Z), Z ~ N(0, 1) with mean mu = exp(m + s^2/2), the maximum of k normals is
  ~ sqrt(2 ln k) for large k (Gumbel domain; e.g. David & Nagaraja, "Order Statistics", 3rd ed.,
  2003, Sec. 10.5, leading term), so
      E[max_k L] ~ exp(m + s sqrt(2 ln k)) = mu exp(s sqrt(2 ln k) - s^2 / 2).
  Leading term only: sqrt(2 ln k) exceeds E[max of k standard normals] at practical k (3.33 vs
  ~2.9 at k = 256), so this overestimates (by ~25% at s = 0.5, k = 256, more for larger s); at
  k = 1 it returns the median, not the mean.

  Args:
    mean: mu = E[L] (> 0).
    sigma: s, standard deviation of ln L (>= 0).
    k: number of draws (>= 1).

  Returns:
    The approximate expected maximum (unit of `mean`).
  """
  if mean <= 0 or sigma < 0 or k < 1:
    raise ValueError(f"lognormal_expected_max: mean={mean} > 0, sigma={sigma} >= 0, k={k} >= 1.")
  return mean * math.exp(sigma * math.sqrt(2.0 * math.log(k)) - sigma * sigma / 2.0)


def lognormal_tailness(sigma: float, group_size: int) -> float:
  """M_tail of log-normal lengths by `lognormal_expected_max`: exp(s sqrt(2 ln S) - s^2 / 2).

  Asymptotic in S; clipped below at 1 (a maximum is never below the mean on average).
  """
  return max(1.0, lognormal_expected_max(1.0, sigma, group_size))
