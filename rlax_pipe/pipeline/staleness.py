"""Staleness bookkeeping and the three enforcement policies, as pure functions.

No threads, no JAX: the same code runs inside the real pipeline (`RolloutQueue`, drivers) and in
the discrete-event simulator in `sim/`, so the simulator simulates the policy that runs.

Definitions (DESIGN.md, "Staleness"):
  * token t of a sample trained at learner version v has lag_t = v - policy_versions[t] >= 0;
  * ``max_lag = k`` means no token with lag > k is ever in a gradient;
  * a group is the admission / training / dropping unit (GRPO advantages need the whole group).

Policies (`StalenessConfig.policy`):
  * ``block``: admission control (AReaL, arXiv 2505.24298, Sec. 5.1, Eq. 3, made per-token
    safe, see `can_admit`): the sampler does not start a group that could break the bound.
    Nothing needs dropping.
  * ``drop``: groups whose oldest token is already too stale for the version they would be
    trained at are discarded (prime-rl style), at put time, at batch time, and in flight
    (`is_too_stale` tells the sampler to abort them).
  * ``learner-wait``: admission by AReaL Eq. 3 on the sampler's version (bounds the work
    ahead of the learner) plus a learner-side gate: the learner never takes a step that would
    leave behind a live group whose tokens would then exceed max_lag; it waits for such a
    *due* group and trains every due group (so a batch may hold more than groups_per_step
    groups). A straggler then stalls the learner instead of the sampler: higher slot occupancy
    and throughput when sampling is the bottleneck, more mean staleness (see `due_groups`).
  * ``queue-drop``: the queue holds at most `queue_capacity_groups` ready groups and drops the
    oldest ones beyond that (Applied Compute, "Predicting and Controlling Staleness in Fully
    Asynchronous RL Training", 2026). When `max_lag` is also set it stays a hard cap at batch time.

Every policy counts wasted tokens (generated completion tokens that are never trained), split by
reason: ``stale`` (too old), ``overflow`` (queue-drop), ``aborted`` (a sample in the group was
aborted), ``unscored`` (no sample of the group has a reward: every verifier call failed, or the
overlong policy masked every sample).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import numpy as np

POLICIES: tuple[str, ...] = ("block", "learner-wait", "drop", "queue-drop")
WASTE_REASONS: tuple[str, ...] = ("stale", "overflow", "aborted", "unscored")


@dataclasses.dataclass(frozen=True)
class StalenessConfig:
  """How the staleness bound is enforced.

  Attributes:
    policy: one of `POLICIES`.
    max_lag: k, the largest per-token lag (in optimizer steps) allowed in a gradient; >= 0, or
      None for unbounded (AReaL's eta = inf). `block` with k = 0 is synchronous RL.
    groups_per_step: learner batch size in prompt groups (>= 1).
    queue_capacity_groups: queue-drop only: ready groups kept, >= groups_per_step (the learner
      could never fill a batch otherwise). Applied Compute recommend q = capacity / batch = 1.
  """

  policy: str = "block"
  max_lag: int | None = 1
  groups_per_step: int = 1
  queue_capacity_groups: int | None = None

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ValueError(f"StalenessConfig.policy={self.policy!r}; choose one of {POLICIES}.")
    if self.max_lag is not None and self.max_lag < 0:
      raise ValueError(f"StalenessConfig.max_lag={self.max_lag} must be >= 0 or None.")
    if self.groups_per_step < 1:
      raise ValueError(f"StalenessConfig.groups_per_step={self.groups_per_step} must be >= 1.")
    if self.policy == "queue-drop":
      if self.queue_capacity_groups is None or self.queue_capacity_groups < self.groups_per_step:
        raise ValueError(
            f"StalenessConfig.queue_capacity_groups={self.queue_capacity_groups} must be set "
            f"and >= groups_per_step={self.groups_per_step} for policy 'queue-drop'.")
    elif self.queue_capacity_groups is not None:
      raise ValueError(
          "StalenessConfig.queue_capacity_groups is only used by policy 'queue-drop'; leave it "
          f"None for policy {self.policy!r}.")


# --------------------------------------------------------------------------------------------
# Per-token lag.


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


def is_too_stale(oldest_version: int, learner_version: int, max_lag: int | None) -> bool:
  """True when a sample whose oldest token has `oldest_version` breaks the bound at version v.

  Because v only grows, a sample that is too stale now stays too stale: drop or abort it.
  Samples without tokens (oldest_version >= v) are never too stale.
  """
  return max_lag is not None and learner_version - oldest_version > max_lag


def partition_by_staleness(oldest_versions: Sequence[int], learner_version: int,
                           max_lag: int | None) -> tuple[list[int], list[int]]:
  """Splits candidates into (fresh, stale) index lists, preserving order."""
  fresh, stale = [], []
  for i, o in enumerate(oldest_versions):
    (stale if is_too_stale(o, learner_version, max_lag) else fresh).append(i)
  return fresh, stale


def queue_overflow(num_ready: int, capacity: int | None) -> int:
  """queue-drop: how many of the oldest ready groups to drop (0 when within capacity)."""
  return 0 if capacity is None else max(0, num_ready - capacity)


# --------------------------------------------------------------------------------------------
# Admission control (policy "block").


def areal_admission_allowed(num_admitted: int, version: int, groups_per_step: int,
                            max_lag: int | None) -> bool:
  """AReaL Eq. 3 as published: admit while floor(num_admitted / B) <= version + eta.

  (AReaL writes floor((N_r - 1) / B) <= i + eta with N_r counting the new trajectory.) This
  bounds the lag only when the learner trains groups strictly in admission order. With
  out-of-order completion it does not bound per-token lag: B = 1, k = 1, group 0 is long; groups
  1 and 2 are short and trained at versions 0 and 1; group 0's first tokens (version 0) are then
  trained at version >= 2. Kept for comparison; `block` uses `can_admit`.
  """
  return max_lag is None or num_admitted // groups_per_step <= version + max_lag


@dataclasses.dataclass(frozen=True)
class AdmissionState:
  """Groups admitted by the sampler and not yet retired (trained or discarded).

  Attributes:
    num_admitted: groups ever admitted.
    num_trained: groups retired by being handed to the learner.
    num_discarded: groups retired without training (dropped, aborted).
    live: (group_id, admission_version) of the groups in flight or waiting in the queue, in
      admission order. admission_version is the sampler's weights version when the group was
      admitted: all of its tokens carry versions >= it.
  """

  num_admitted: int = 0
  num_trained: int = 0
  num_discarded: int = 0
  live: tuple[tuple[int, int], ...] = ()

  @property
  def num_net(self) -> int:
    """Admitted groups that are not discarded (live + trained)."""
    return self.num_admitted - self.num_discarded


def admission_init() -> AdmissionState:
  """Empty admission state."""
  return AdmissionState()


def admission_headroom(state: AdmissionState, sampler_version: int, config: StalenessConfig,
                       next_train_version: int | None = None) -> int | None:
  """How many more groups `block` / `learner-wait` let the sampler start now (None = unlimited).

  block: headroom = B * (a_min + k + 1) - n, where n = `state.num_net`, B = groups_per_step,
  k = max_lag and a_min = the smallest admission version among live groups (or
  `sampler_version` when none is live). See `can_admit` for why.
  learner-wait: headroom = B * (v + k + 1) - n with v = `sampler_version` (AReaL Eq. 3), and 0
  while v + k < `next_train_version` (a group admitted now would already be too stale for the
  learner's next batch). Policies `drop` and `queue-drop` never limit admission.
  """
  if config.policy not in ("block", "learner-wait") or config.max_lag is None:
    return None
  k, b = config.max_lag, config.groups_per_step
  if config.policy == "learner-wait":
    if next_train_version is not None and sampler_version + k < next_train_version:
      return 0
    return max(0, b * (sampler_version + k + 1) - state.num_net)
  a_min = min([v for _, v in state.live] + [sampler_version])
  return max(0, b * (a_min + k + 1) - state.num_net)


def due_groups(state: AdmissionState, train_version: int, config: StalenessConfig
               ) -> list[int]:
  """learner-wait: live groups that must be in the batch trained at `train_version`.

  A group admitted at version a has tokens of versions >= a; left out of the batch trained at
  v, it is trained at v + 1 or later, with lag >= v + 1 - a. So it is due when
  v + 1 - a > max_lag. The learner trains a batch only if every due group is ready and in it
  (`RolloutQueue` waits otherwise), hence every group is trained at a version <= a + max_lag:
  the first batch at version >= a + max_lag after the admission includes it, and admission
  (`admission_headroom`) guarantees a + max_lag >= the version of the next batch. The wait
  always ends: a due group is in flight and the sampler keeps decoding it. Empty for the other
  policies and for max_lag None.

  Returns:
    Group ids in admission order.
  """
  if config.policy != "learner-wait" or config.max_lag is None:
    return []
  return [g for g, a in state.live if train_version + 1 - a > config.max_lag]


def can_admit(state: AdmissionState, sampler_version: int, config: StalenessConfig,
              next_train_version: int | None = None) -> bool:
  """Whether the sampler may start one more prompt group now (policy `block`).

  Rule: admit group number n (0-based, counting admitted groups that were not discarded) only
  while floor(n / B) <= a_min + k, where a_min is the smallest admission version among live
  (admitted, not yet trained or discarded) groups, the new one included (its admission version is
  `sampler_version`). This is AReaL Eq. 3 with the *oldest live* admission version in place of
  the current version.

  Proof sketch that no token with lag > k is trained, whatever order the learner trains ready
  groups in: take a group m admitted at version a_m; its tokens have versions >= a_m because the
  sampler's weights version never decreases. Suppose the learner trains m at version s > a_m + k.
  It has then finished step a_m + k, i.e. trained (a_m + k + 1) * B groups other than m, all
  admitted and never discarded. Look at the last admission among these groups and m: at that
  moment m was admitted and untrained, so a_min <= a_m, and the admitted group got number
  n >= (a_m + k + 1) * B, i.e. floor(n / B) >= a_m + k + 1 > a_min + k: the rule refused it.
  Contradiction, so s <= a_m + k and every token's lag is <= s - a_m <= k. (Discarded groups are
  not counted in n: they never feed the learner, and counting them would deadlock admission.)
  Training oldest-first is not needed for the bound, but it retires a_min sooner and so keeps
  the sampler admitting. Assumes every learner step trains at least B groups (fewer would let
  the version run ahead of the admission count).

  Policy `learner-wait` admits by AReaL Eq. 3 on `sampler_version` instead and leaves the
  per-token bound to the learner-side gate (`due_groups`).

  Args:
    state: current admission state.
    sampler_version: the version of the weights the sampler decodes with now (not the learner's
      version, which may be ahead of it).
    config: staleness config; `drop`, `queue-drop`, or max_lag None always admit.
    next_train_version: learner-wait only: the smallest version the learner's next batch can be
      trained at (None = not known, no check).

  Returns:
    True when one more group may be admitted.
  """
  headroom = admission_headroom(state, sampler_version, config, next_train_version)
  return headroom is None or headroom > 0


def admission_admit(state: AdmissionState, group_id: int, sampler_version: int,
                    config: StalenessConfig, next_train_version: int | None = None
                    ) -> AdmissionState:
  """Records the admission of `group_id` at `sampler_version`.

  Raises:
    ValueError: if `can_admit` is False, or `group_id` is already live.
  """
  if any(g == group_id for g, _ in state.live):
    raise ValueError(f"admission_admit: group {group_id} is already live.")
  if not can_admit(state, sampler_version, config, next_train_version):
    raise ValueError(
        f"admission_admit: group {group_id} would break max_lag={config.max_lag} "
        f"({state.num_net} groups admitted net, oldest live admission version "
        f"{min([v for _, v in state.live] + [sampler_version])}, groups_per_step="
        f"{config.groups_per_step}); check can_admit first.")
  return dataclasses.replace(state, num_admitted=state.num_admitted + 1,
                             live=state.live + ((group_id, sampler_version),))


def admission_retire(state: AdmissionState, group_ids: Iterable[int], trained: bool
                     ) -> AdmissionState:
  """Retires live groups: handed to the learner (`trained=True`) or discarded.

  Raises:
    KeyError: if a group is not live.
  """
  gone = set(group_ids)
  live_ids = {g for g, _ in state.live}
  unknown = sorted(gone - live_ids)
  if unknown:
    raise KeyError(f"admission_retire: groups {unknown} are not live.")
  live = tuple((g, v) for g, v in state.live if g not in gone)
  if trained:
    return dataclasses.replace(state, num_trained=state.num_trained + len(gone), live=live)
  return dataclasses.replace(state, num_discarded=state.num_discarded + len(gone), live=live)


def admission_to_dict(state: AdmissionState) -> dict[str, Any]:
  """Plain-dict form of an `AdmissionState` (for resume)."""
  return {"num_admitted": state.num_admitted, "num_trained": state.num_trained,
          "num_discarded": state.num_discarded, "live": [list(x) for x in state.live]}


def admission_from_dict(d: dict[str, Any]) -> AdmissionState:
  """Inverse of `admission_to_dict`."""
  return AdmissionState(int(d["num_admitted"]), int(d["num_trained"]), int(d["num_discarded"]),
                        tuple((int(g), int(v)) for g, v in d["live"]))


# --------------------------------------------------------------------------------------------
# Wasted-work counters.


@dataclasses.dataclass(frozen=True)
class WasteCounters:
  """Groups, samples and generated (completion) tokens discarded, by reason.

  Attributes:
    stale_groups, stale_samples, stale_tokens: dropped for lag > max_lag.
    overflow_groups, overflow_samples, overflow_tokens: dropped by queue-drop's capacity.
    aborted_groups, aborted_samples, aborted_tokens: groups with an aborted sample.
    unscored_groups, unscored_samples, unscored_tokens: groups without any reward (NaN rewards
      only: failed verifiers, or samples masked by the overlong policy).
  """

  stale_groups: int = 0
  stale_samples: int = 0
  stale_tokens: int = 0
  overflow_groups: int = 0
  overflow_samples: int = 0
  overflow_tokens: int = 0
  aborted_groups: int = 0
  aborted_samples: int = 0
  aborted_tokens: int = 0
  unscored_groups: int = 0
  unscored_samples: int = 0
  unscored_tokens: int = 0

  @property
  def dropped_groups(self) -> int:
    """Groups discarded for any reason."""
    return self.stale_groups + self.overflow_groups + self.aborted_groups + self.unscored_groups

  @property
  def wasted_tokens(self) -> int:
    """Generated tokens discarded for any reason."""
    return (self.stale_tokens + self.overflow_tokens + self.aborted_tokens
            + self.unscored_tokens)


def count_waste(counters: WasteCounters, reason: str, groups: int, samples: int, tokens: int
                ) -> WasteCounters:
  """Adds a discard to the counters.

  Raises:
    ValueError: if `reason` is not in `WASTE_REASONS`.
  """
  if reason not in WASTE_REASONS:
    raise ValueError(f"count_waste: reason {reason!r} not in {WASTE_REASONS}.")
  return dataclasses.replace(
      counters, **{f"{reason}_groups": getattr(counters, f"{reason}_groups") + groups,
                   f"{reason}_samples": getattr(counters, f"{reason}_samples") + samples,
                   f"{reason}_tokens": getattr(counters, f"{reason}_tokens") + tokens})
