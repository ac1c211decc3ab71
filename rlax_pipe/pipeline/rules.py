"""The drivers' scheduling rules as pure functions: one copy, two users.

The real pipeline (`RolloutWorker`, `driver.run_reproducible`) and the simulator (`rlax_pipe.sim`)
call these functions and nothing else to decide when a prompt group may start, when new weights
may be installed and which side of the virtual-clock interleaving moves next; the staleness
admission and the learner's batch rule are the pure functions of `staleness.py`. So the simulator
cannot drift from what runs (tests/sim/test_same_schedule.py runs both on the same lengths and
costs and compares the schedules).

Drivers (DESIGN.md, "Drivers"):
  * "pipeline": keep every decode slot busy: a new group may start while the engine's free slots
    (slots - active - waiting) are >= 0, i.e. at most one group's worth of requests waits beyond
    the slots, so a freed slot refills at the next step; weights install at any step boundary.
  * "async-batch": rounds of `groups_per_step` groups; a round starts when the engine is empty;
    weights install only when the engine is empty (no sample mixes versions).
  * "sync": like async-batch, and round r starts only once the weights of version r (trained on
    rounds 0..r-1) are installed, so every token has lag 0.

Dynamic sampling (`group_filter`): a group the queue drops for lack of learning signal is
replaced. Pipeline: nothing to do (the drop releases its admission and the sampler keeps
admitting). Round-based drivers: `reopen_filtered` re-opens one group of the current round per
dropped group, started at once with the weights the sampler holds (no new round, so sync keeps
lag 0: its learner cannot step before the replacements finish).
"""

from __future__ import annotations

import dataclasses


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
  learner cannot produce before the batch is full). Pipeline: unchanged.

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


def may_install_weights(driver: str, has_work: bool) -> bool:
  """Whether new weights may be installed now (pipeline: always; rounds: between rounds)."""
  return driver == "pipeline" or not has_work


def sampler_moves_next(t_sampler: float, t_learner: float, learner_must_act: bool) -> bool:
  """Virtual-clock interleaving: the side with the smaller clock moves; on a tie the sampler,
  unless it is stuck (it has nothing to do before the learner acts)."""
  return t_sampler < t_learner or (t_sampler == t_learner and not learner_must_act)


def weights_deliverable(pending_arrival: float | None, now: float, may_install: bool) -> bool:
  """Whether a pushed version that arrives at `pending_arrival` is installed at sampler time
  `now` (a push becomes visible at the first step boundary at or after its arrival)."""
  return pending_arrival is not None and pending_arrival <= now and may_install
