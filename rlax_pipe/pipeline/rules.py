"""The pipeline's host rules as pure functions (numpy only, no JAX): one copy, two users.

The real pipeline (`RolloutWorker`, `Trainer`, the drivers, the step hooks) and the simulator
(`rlax_pipe.sim`) call these functions for a token's and a sample's lag, the learner's batch
shape (with `micro_batch_plan` and the engine's refill point `refill_at`, re-exported from
`rlax_pipe.host_rules`, where the sampler and the learner, lower layers, call them), when a
prompt group may start, when new weights may be installed and which side of the virtual-clock
interleaving moves next; the staleness admission and the learner's batch rule are in
`staleness.py`. So the simulator cannot drift from what runs (tests/sim/test_same_schedule.py
compares both schedules on the same lengths and costs), and it imports no JAX
(tests/sim/test_sim_api.py).

Drivers (DESIGN.md, "Drivers"): "pipeline" keeps every decode slot busy (`may_start_group`) and
installs weights at any step boundary; "async-batch" runs rounds of `groups_per_step` groups,
each started on an empty engine, and installs weights only between rounds; "sync" is async-batch
whose round r also waits for the weights of version r, so every token has lag 0. Groups dropped
by dynamic sampling are replaced: `reopen_filtered`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rlax_pipe.host_rules import micro_batch_plan, refill_at  # pylint: disable=unused-import

# The drivers (DESIGN.md, "Drivers"); PipelineConfig.driver and SimConfig.driver choose one.
DRIVERS: tuple[str, ...] = ("sync", "async-batch", "pipeline")

# ---- staleness: the lag formula ------------------------------------------------------------


def token_lag(policy_versions: np.ndarray, learner_version: int) -> np.ndarray:
  """Per-token lag, lag_t = v - policy_versions[t].

  Args:
    policy_versions: int[...] version that produced each token.
    learner_version: v, the version whose gradient the tokens enter.

  Returns:
    int32[...] lags (>= 0).

  Raises:
    ValueError: if a token is newer than `learner_version` (the caller passed the wrong v).
  """
  lag = np.int64(learner_version) - np.asarray(policy_versions, dtype=np.int64)
  if lag.size and lag.min() < 0:
    raise ValueError(
        f"token_lag: a token has policy version {int(np.max(policy_versions))} > learner "
        f"version {learner_version}; pass the version the batch will be trained at.")
  return lag.astype(np.int32)


def sample_lag(policy_versions: np.ndarray, learner_version: int) -> int:
  """A sample's staleness: the lag of its oldest token, v - min(policy_versions) (the Applied
  Compute definition; DESIGN.md "Staleness").

  Raises:
    ValueError: as `token_lag`, or if the sample has no token.
  """
  if np.size(policy_versions) == 0:
    raise ValueError("sample_lag: a sample without tokens has no staleness.")
  return int(token_lag(policy_versions, learner_version).max())


# ---- the learner's batch shape -------------------------------------------------------------


def packing_plan(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
  """First-fit-decreasing assignment of items to rows of capacity `seq_len`.

  O(n log n): the first row with room is found in a max-tree over the rows' free space (rows not
  yet opened count as empty, and come after every opened row, so the leftmost row with room is
  exactly first fit's choice).

  Args:
    lengths: token count of each item (>= 1).
    seq_len: row capacity L.

  Returns:
    rows: lists of item indices; row order = order of creation, items in a row in placement
      order (longest first). Deterministic (ties broken by index).

  Raises:
    ValueError: if an item is longer than `seq_len` or shorter than 1 (naming both lengths).
  """
  lengths = [int(n) for n in lengths]
  for i, n in enumerate(lengths):
    if n > seq_len or n < 1:
      raise ValueError(
          f"packing_plan: item {i} has {n} tokens; it must be between 1 and seq_len={seq_len}.")
  if not lengths:
    return []
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  size = 1 << (len(lengths) - 1).bit_length()
  tree = [seq_len] * (2 * size)  # tree[k] = max free space of the rows under node k
  rows: list[list[int]] = []
  for i in order:
    n, k = lengths[i], 1
    while k < size:  # leftmost leaf with room
      k = 2 * k if tree[2 * k] >= n else 2 * k + 1
    r = k - size
    if r == len(rows):
      rows.append([])
    rows[r].append(i)
    tree[k] -= n
    k //= 2
    while k:
      tree[k] = max(tree[2 * k], tree[2 * k + 1])
      k //= 2
  return rows


def packed_order(lengths: Sequence[int], seq_len: int) -> list[int]:
  """Item indices in the order `pack_rollouts` lays them out: row by row, and within a row by
  segment id (1, 2, ...); the order `unpack_batch` reads segments back. A permutation of
  range(len(lengths)); first-fit decreasing puts longer items first, so it differs from the input
  order whenever lengths differ.

  Raises:
    ValueError: as `packing_plan`.
  """
  return [i for row in packing_plan(lengths, seq_len) for i in row]


def batch_rows(lengths: Sequence[int], seq_len: int) -> int:
  """Rows of the learner batch holding samples of these lengths (prompt + completion): the
  first-fit-decreasing plan's row count rounded up to a power of two, so batch shapes (and
  compiles) stay few (the learner's batch shape rule, shared with the simulator)."""
  return 1 << max(0, (len(packing_plan(lengths, seq_len)) - 1).bit_length())


# ---- the drivers' scheduling rules ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RoundState:
  """Round bookkeeping of the round-based drivers.

  Attributes:
    rounds_started: generation rounds started so far.
    round_open: groups of the current round still to start.
  """

  rounds_started: int = 0
  round_open: int = 0


def begin_top_up(driver: str, state: RoundState, *, has_work: bool, weights_version: int,
                 groups_per_step: int) -> tuple[RoundState, bool]:
  """Start of a top-up: opens a new round when the driver's rule allows one.

  Args:
    driver: "sync", "async-batch" or "pipeline".
    state: round state before the top-up.
    has_work: the engine holds unfinished requests.
    weights_version: version of the weights the sampler decodes with (newest handed over).
    groups_per_step: groups per round (the learner batch).

  Returns:
    (new state, whether groups may be started now).
  """
  if driver == "pipeline":
    return state, True
  if state.round_open == 0:
    if has_work:
      return state, False
    if driver == "sync" and weights_version < state.rounds_started:
      return state, False  # wait for the weights trained on the previous round
    state = RoundState(state.rounds_started + 1, groups_per_step)
  return state, True


def reopen_filtered(driver: str, state: RoundState, num_filtered: int) -> RoundState:
  """Round state after the queue dropped `num_filtered` more groups (dynamic sampling).

  Round-based drivers owe the learner `groups_per_step` groups per round: each dropped group
  re-opens one slot of the current round, so `begin_top_up` lets it start without waiting for
  a new round (a new round would wait for an empty engine and, under sync, for weights that the
  learner cannot produce before the batch is full). Pipeline: unchanged (the drop freed an
  admission, so the sampler keeps admitting).

  Args:
    driver: the driver.
    state: round state.
    num_filtered: groups dropped since the last call (>= 0).

  Raises:
    ValueError: if num_filtered < 0.
  """
  if num_filtered < 0:
    raise ValueError(f"reopen_filtered: num_filtered={num_filtered} must be >= 0.")
  if driver == "pipeline" or num_filtered == 0:
    return state
  return dataclasses.replace(state, round_open=state.round_open + num_filtered)


def may_start_group(driver: str, state: RoundState, free_slots: int) -> bool:
  """Whether one more group may start now (before asking the staleness admission).

  Pipeline: while the engine's free slots are >= 0, i.e. at most one group's worth of requests
  waits beyond the slots, so a freed slot refills at the next step. Round-based drivers: while
  the current round has groups to start.

  Args:
    driver: the driver.
    state: round state.
    free_slots: slots - active - waiting of the engine (negative while requests wait).
  """
  if driver == "pipeline":
    return free_slots >= 0
  return state.round_open > 0


def group_started(driver: str, state: RoundState) -> RoundState:
  """Round state after a group started."""
  if driver == "pipeline":
    return state
  return dataclasses.replace(state, round_open=state.round_open - 1)


def deadlocked(sampler_stuck: bool, filtered_before: int, filtered_after: int) -> bool:
  """Virtual-clock deadlock test when the learner found no batch: the sampler was stuck (it could
  do nothing before the learner acted) and the learner's move dropped no group by the filter
  (dynamic sampling: a drop releases an admission, so the sampler may start a replacement and
  moves again; without the filter the counts never change and this is `sampler_stuck`).

  Args:
    sampler_stuck: the sampler has nothing to do before the learner acts.
    filtered_before, filtered_after: `RolloutQueue.filtered_groups()` before and after the
      learner's move put the samples that reached it.
  """
  return sampler_stuck and filtered_after == filtered_before


def may_update_weights(driver: str, has_work: bool) -> bool:
  """Whether the sampler may receive new weights now (pipeline: always; rounds: between
  rounds)."""
  return driver == "pipeline" or not has_work


def sampler_moves_next(t_sampler: float, t_learner: float, learner_must_act: bool) -> bool:
  """Virtual-clock interleaving: the side with the smaller clock moves; on a tie the sampler,
  unless it is stuck (it has nothing to do before the learner acts)."""
  return t_sampler < t_learner or (t_sampler == t_learner and not learner_must_act)


def weights_deliverable(pending_arrival: float | None, now: float, may_update: bool) -> bool:
  """Whether a pushed version that arrives at `pending_arrival` is installed at sampler time
  `now` (a push becomes visible at the first step boundary at or after its arrival)."""
  return pending_arrival is not None and pending_arrival <= now and may_update
