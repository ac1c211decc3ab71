"""Group-relative advantage estimators, computed on host (numpy) by the rollout queue.

Every estimator has the signature

  fn(rewards, group_ids=None, **options) -> float32 advantages of the same shape as rewards

and accepts either a float[G, S] array (G groups of S samples; `group_ids` None) or a flat
float[N] vector with int[N] `group_ids` (groups may then have different sizes). The result is
one advantage per sample; the queue broadcasts it over the sample's tokens.

Missing rewards (NaN, e.g. an aborted or ungraded sample) follow one rule everywhere: such a
sample gets advantage 0.0 and is excluded from its group's baseline and spread; a group with
fewer than 2 valid rewards gets all zeros (no baseline can be formed from the others).

Exactness: a group whose valid rewards are all equal gets exactly 0.0 for every sample. Means are
taken of the deviations from the group minimum, r - min(r), which are exact zeros for equal
values, and the baseline is min + mean(r - min); a naive float mean of, e.g., three copies of
0.1 is not exactly 0.1.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def _as_groups(rewards, group_ids):
  """Validates the input and returns (flat float64 rewards, flat group index, output shape)."""
  rewards = np.asarray(rewards)
  if not np.issubdtype(rewards.dtype, np.floating) and not np.issubdtype(rewards.dtype,
                                                                          np.integer):
    raise TypeError(f"rewards must be a real-valued array; got dtype {rewards.dtype}.")
  if group_ids is None:
    if rewards.ndim != 2:
      raise ValueError(f"rewards must be float[G, S] when group_ids is None; got shape "
                       f"{rewards.shape}.")
    g, s = rewards.shape
    index = np.repeat(np.arange(g), s)
    return rewards.astype(np.float64).reshape(-1), index, rewards.shape
  group_ids = np.asarray(group_ids)
  if rewards.ndim != 1 or group_ids.shape != rewards.shape:
    raise ValueError(f"With group_ids, rewards and group_ids must both be [N]; got shapes "
                     f"{rewards.shape} and {group_ids.shape}.")
  if not np.issubdtype(group_ids.dtype, np.integer):
    raise TypeError(f"group_ids must be integer; got dtype {group_ids.dtype}.")
  _, index = np.unique(group_ids, return_inverse=True)
  return rewards.astype(np.float64), index.reshape(-1), rewards.shape


def _group_sum(x, index):
  """Sum of x over each sample's group, broadcast back to the samples: float64[N]."""
  num_groups = int(index.max()) + 1 if index.size else 0
  return np.bincount(index, weights=x, minlength=num_groups)[index]


def _group_stats(r, index):
  """Per-sample group statistics of the valid (non-NaN) rewards.

  Returns (valid, n, shifted, total): valid bool[N]; n = valid count of the sample's group;
  shifted = r - group min of valid rewards (0 where invalid); total = group sum of `shifted`.
  """
  valid = ~np.isnan(r)
  group_min = np.full(int(index.max()) + 1 if index.size else 0, np.inf)
  np.minimum.at(group_min, index[valid], r[valid])
  shifted = np.where(valid, r - np.where(valid, group_min[index], 0.0), 0.0)
  return valid, _group_sum(valid.astype(np.float64), index), shifted, _group_sum(shifted, index)


def _finalize(adv, valid, n, shape):
  """Zeroes invalid samples and groups with < 2 valid rewards; returns float32 in `shape`."""
  adv = np.where(valid & (n >= 2), adv, 0.0)
  return adv.astype(np.float32).reshape(shape)


def grpo(rewards, group_ids=None, *, normalize_std: bool = True, eps: float = 1e-6,
         std_ddof: int = 0) -> np.ndarray:
  """Group-relative advantage of GRPO: (r_i - mean_group(r)) / (std_group(r) + eps).

  Shao et al. 2024 (DeepSeekMath) Sec. 4.1.2, outcome supervision: A_i = (r_i - mean(r)) /
  std(r), applied to every token of sample i. With normalize_std=False this is the baseline
  of `dr_grpo`.

  Args:
    rewards: float[G, S] rewards (G groups of S samples), or float[N] with `group_ids`;
      NaN marks a missing reward.
    group_ids: optional int[N] group of each flat reward.
    normalize_std: divide by the group's standard deviation + eps.
    eps: positive float added to the standard deviation.
    std_ddof: delta degrees of freedom of the standard deviation (0 population, 1 sample).

  Returns:
    float32 advantages with the shape of `rewards`; exactly 0 for invalid samples, groups with
    < 2 valid rewards and groups of equal rewards.

  Raises:
    ValueError: on bad shapes, eps <= 0 or std_ddof not in {0, 1}.
    TypeError: on non-numeric rewards or non-integer group ids.
  """
  if not eps > 0:
    raise ValueError(f"eps={eps} must be > 0.")
  if std_ddof not in (0, 1):
    raise ValueError(f"std_ddof={std_ddof} must be 0 or 1.")
  r, index, shape = _as_groups(rewards, group_ids)
  valid, n, shifted, total = _group_stats(r, index)
  safe_n = np.maximum(n, 2)
  centered = np.where(valid, shifted - total / safe_n, 0.0)
  if normalize_std:
    std = np.sqrt(_group_sum(centered * centered, index) / (safe_n - std_ddof))
    centered = centered / (std + eps)
  return _finalize(centered, valid, n, shape)


def dr_grpo(rewards, group_ids=None) -> np.ndarray:
  """Dr. GRPO advantage: r_i - mean_group(r), without the std division.

  Liu et al. 2025 ("Understanding R1-Zero-Like Training: A Critical Perspective") Sec. 3.2,
  which removes GRPO's question-level difficulty bias from dividing by std(r).

  Args:
    rewards: float[G, S] or float[N] with `group_ids`; NaN marks a missing reward.
    group_ids: optional int[N] group of each flat reward.

  Returns:
    float32 advantages with the shape of `rewards` (missing-reward rule in the module doc).

  Raises:
    ValueError, TypeError: on bad shapes or dtypes.
  """
  return grpo(rewards, group_ids, normalize_std=False)


def rloo(rewards, group_ids=None) -> np.ndarray:
  """REINFORCE leave-one-out advantage: r_i - mean_{j != i} r_j over the valid group members.

  Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free!") eq. 9; Ahmadian et
  al. 2024 eq. 6. Equals n/(n-1) * (r_i - mean(r)) for n valid rewards.

  Args:
    rewards: float[G, S] or float[N] with `group_ids`; NaN marks a missing reward.
    group_ids: optional int[N] group of each flat reward.

  Returns:
    float32 advantages with the shape of `rewards` (missing-reward rule in the module doc).

  Raises:
    ValueError, TypeError: on bad shapes or dtypes.
  """
  r, index, shape = _as_groups(rewards, group_ids)
  valid, n, shifted, total = _group_stats(r, index)
  leave_one_out = (total - shifted) / np.maximum(n - 1, 1)
  return _finalize(np.where(valid, shifted - leave_one_out, 0.0), valid, n, shape)


AdvantageFn = Callable[..., np.ndarray]

ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
}


# Smallest group size G at which each estimator can give a non-zero advantage. Every estimator here
# is group-relative: its baseline is formed from the other samples of the group, so a group with
# fewer than 2 valid rewards gets all zeros (`_finalize`) and trains nothing.
MIN_GROUP_SIZE: dict[str, int] = {"grpo": 2, "dr_grpo": 2, "rloo": 2}


def get_advantage_fn(name: str) -> AdvantageFn:
  """Looks up an advantage estimator by registry name.

  Args:
    name: a key of ADVANTAGES ("grpo", "dr_grpo", "rloo").

  Returns:
    The estimator (signature in the module docstring).

  Raises:
    ValueError: if the name is unknown; the message lists the valid names.
  """
  try:
    return ADVANTAGES[name]
  except KeyError:
    raise ValueError(f"Unknown advantage estimator {name!r}; choose one of "
                     f"{tuple(ADVANTAGES)}.") from None
