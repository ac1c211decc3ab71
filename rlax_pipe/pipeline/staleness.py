"""Staleness bookkeeping and the four enforcement policies, as pure functions.

No threads, no JAX: the same code runs inside the real pipeline (`RolloutQueue`, drivers) and in
the discrete-event simulator in `sim/`, so the simulator simulates the policy that runs.

Definitions (DESIGN.md, "Staleness"): token t trained at learner version v has lag
v - policy_versions[t] >= 0 (`rules.token_lag`); ``max_lag = k`` means no token with lag > k is
ever in a gradient; a group is the admission / training / dropping unit (GRPO advantages need the
whole group). Every policy counts the work it wastes, by reason (`WasteCounters`).

Policies (`StalenessConfig.policy`):
  * ``block``: admission control (AReaL, arXiv 2505.24298, Sec. 5.1, Eq. 3, made per-token
    safe: `admission_headroom`); nothing needs dropping.
  * ``drop``: groups whose oldest token is already too stale for the version they would be
    trained at are discarded (prime-rl style), at put time, at batch time, and in flight
    (`RolloutWorker.abort_too_stale`).
  * ``learner-wait``: admission by AReaL Eq. 3 on the sampler's version (bounds the work ahead
    of the learner) plus the learner-side gate of `due_bound`. A straggler then stalls the
    learner instead of the sampler: higher slot occupancy and throughput when sampling is the
    bottleneck, more mean staleness.
  * ``queue-drop``: the queue holds at most `queue_capacity_groups` ready groups and drops the
    oldest ones beyond that (Applied Compute, "Predicting and Controlling Staleness in Fully
    Asynchronous RL Training", 2026). When `max_lag` is also set it stays a hard cap at batch time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable


POLICIES: tuple[str, ...] = ("block", "learner-wait", "drop", "queue-drop")
WASTE_REASONS: tuple[str, ...] = ("stale", "overflow", "aborted", "unscored", "lost",
                                  "filtered")


@dataclasses.dataclass(frozen=True)
class StalenessConfig:
  """How the staleness bound is enforced.

  The defaults are the run's (`PipelineConfig.staleness` is `StalenessConfig()`): learner-wait,
  max_lag 4, 8 groups per step.

  Attributes:
    policy: one of `POLICIES`.
    max_lag: k, the largest per-token lag (in optimizer steps) allowed in a gradient; >= 0, or
      None for unbounded (AReaL's eta = inf). `block` with k = 0 is synchronous RL.
    groups_per_step: learner batch size in prompt groups (>= 1).
    queue_capacity_groups: queue-drop only: ready groups kept, >= groups_per_step (the learner
      could never fill a batch otherwise). Applied Compute recommend q = capacity / batch = 1.
  """

  policy: str = "learner-wait"
  max_lag: int | None = 4
  groups_per_step: int = 8
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


def is_too_stale(oldest_version: int, learner_version: int, max_lag: int | None) -> bool:
  """True when a sample whose oldest token has `oldest_version` breaks the bound at version v.

  Because v only grows, a sample that is too stale now stays too stale: drop or abort it.
  Samples without tokens (oldest_version >= v) are never too stale.
  """
  return max_lag is not None and learner_version - oldest_version > max_lag


def queue_overflow(num_ready: int, capacity: int | None) -> int:
  """queue-drop: how many of the oldest ready groups to drop (0 when within capacity)."""
  return 0 if capacity is None else max(0, num_ready - capacity)


# --------------------------------------------------------------------------------------------
# Admission control (policies "block" and "learner-wait").


def admission_headroom(num_net: int, oldest_live_version: int | None, sampler_version: int,
                       config: StalenessConfig, next_train_version: int | None = None
                       ) -> int | None:
  """How many more groups `block` / `learner-wait` let the sampler start now (None = unlimited).

  Rule (policy `block`): headroom = B * (a_min + k + 1) - n, i.e. group number n (0-based,
  counting admitted groups that were not discarded) is admitted only while floor(n / B) <=
  a_min + k, where B = groups_per_step, k = max_lag and a_min is the smallest admission version
  among live (admitted, not yet trained or discarded) groups, the new one included (its
  admission version is `sampler_version`). This is AReaL Eq. 3 with the *oldest live* admission
  version in place of the current version.

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

  Policy `learner-wait` admits by AReaL Eq. 3 on the sampler's version v instead, headroom =
  B * (v + k + 1) - n, and 0 while v + k < `next_train_version` (a group admitted now would
  already be too stale for the learner's next batch); the per-token bound is the learner-side
  gate's (`due_bound`). Pure function of scalars; the bookkeeping that feeds it is
  `AdmissionLedger`.

  Args:
    num_net: n, admitted groups not discarded (live + trained).
    oldest_live_version: smallest admission version among live groups (None: none live).
    sampler_version: the version of the weights the sampler decodes with now (not the learner's
      version, which may be ahead of it).
    config: staleness config; `drop`, `queue-drop`, or max_lag None never limit admission.
    next_train_version: learner-wait only: the smallest version the learner's next batch can be
      trained at (None = not known, no check).
  """
  if config.policy not in ("block", "learner-wait") or config.max_lag is None:
    return None
  k, b = config.max_lag, config.groups_per_step
  if config.policy == "learner-wait":
    if next_train_version is not None and sampler_version + k < next_train_version:
      return 0
    return max(0, b * (sampler_version + k + 1) - num_net)
  a_min = sampler_version if oldest_live_version is None else min(oldest_live_version,
                                                                  sampler_version)
  return max(0, b * (a_min + k + 1) - num_net)


def due_bound(train_version: int, config: StalenessConfig) -> int | None:
  """learner-wait: live groups admitted at a version <= this bound must be in the batch trained
  at `train_version` (None: no group is ever due).

  A group admitted at version a has tokens of versions >= a; left out of the batch trained at
  v, it is trained at v + 1 or later, with lag >= v + 1 - a. So it is due when v + 1 - a >
  max_lag, i.e. a <= v - max_lag. The learner trains a batch only if every due group is ready
  and in it (`RolloutQueue` waits otherwise), hence every group is trained at a version <=
  a + max_lag: the first batch at version >= a + max_lag after the admission includes it, and
  admission (`admission_headroom`) guarantees a + max_lag >= the version of the next batch. The
  wait always ends: a due group is in flight and the sampler keeps decoding it. None for the
  other policies and for max_lag None.
  """
  if config.policy != "learner-wait" or config.max_lag is None:
    return None
  return train_version - config.max_lag


def batch_size(num_ready: int, num_due: int, groups_per_step: int) -> int | None:
  """The learner's batch rule: how many ready groups the next step takes, or None to wait.

  At least `groups_per_step`, and every due group (learner-wait; the caller checks that they are
  all ready): max(groups_per_step, num_due) when that many are ready.
  """
  take = max(groups_per_step, num_due)
  return take if num_ready >= take else None


class AdmissionLedger:
  """Groups admitted by the sampler and not yet retired (trained or discarded).

  Live groups are kept per admission version: an admission or a retirement is O(1) per group,
  and the oldest version is a min over the distinct live versions (few: a live group is at most
  about max_lag versions old under `block` and `learner-wait`), so no event walks the live set.

  Attributes:
    num_admitted: groups ever admitted.
    num_trained: groups retired by being handed to the learner.
    num_discarded: groups retired without training (dropped, aborted, lost).
  """

  def __init__(self, num_admitted: int = 0, num_trained: int = 0, num_discarded: int = 0,
               live: Iterable[tuple[int, int]] = ()):
    self.num_admitted, self.num_trained, self.num_discarded = (
        int(num_admitted), int(num_trained), int(num_discarded))
    self._version_of: dict[int, int] = {}
    self._by_version: dict[int, dict[int, None]] = {}
    for g, v in live:
      self._add(int(g), int(v))

  @property
  def num_net(self) -> int:
    """Admitted groups that are not discarded (live + trained)."""
    return self.num_admitted - self.num_discarded

  @property
  def num_live(self) -> int:
    """Groups admitted and not retired."""
    return len(self._version_of)

  def is_live(self, group_id: int) -> bool:
    """Whether `group_id` is admitted and not retired."""
    return group_id in self._version_of

  def oldest_version(self) -> int | None:
    """Smallest admission version among live groups (None when none is live)."""
    return min(self._by_version, default=None)

  def live(self) -> list[tuple[int, int]]:
    """(group_id, admission_version) of every live group, by version then admission (O(n))."""
    return [(g, v) for v in sorted(self._by_version) for g in self._by_version[v]]

  def can_admit(self, sampler_version: int, config: StalenessConfig,
                next_train_version: int | None = None) -> bool:
    """Whether the sampler may start one more group now: `admission_headroom` of this ledger is
    None (unlimited) or > 0."""
    headroom = admission_headroom(self.num_net, self.oldest_version(), sampler_version, config,
                                  next_train_version)
    return headroom is None or headroom > 0

  def admit(self, group_id: int, sampler_version: int, config: StalenessConfig,
            next_train_version: int | None = None) -> None:
    """Records the admission of `group_id` at `sampler_version`.

    Raises:
      ValueError: if `can_admit` is False, or `group_id` is already live.
    """
    if group_id in self._version_of:
      raise ValueError(f"AdmissionLedger.admit: group {group_id} is already live.")
    if not self.can_admit(sampler_version, config, next_train_version):
      oldest = self.oldest_version()
      raise ValueError(
          f"AdmissionLedger.admit: group {group_id} would break max_lag={config.max_lag} "
          f"({self.num_net} groups admitted net, oldest live admission version "
          f"{sampler_version if oldest is None else min(oldest, sampler_version)}, "
          f"groups_per_step={config.groups_per_step}); check can_admit first.")
    self.num_admitted += 1
    self._add(group_id, sampler_version)

  def retire(self, group_ids: Iterable[int], trained: bool) -> None:
    """Retires live groups: handed to the learner (`trained=True`) or discarded.

    Raises:
      KeyError: if a group is not live (nothing is retired then).
    """
    gone = list(dict.fromkeys(group_ids))
    unknown = sorted(g for g in gone if g not in self._version_of)
    if unknown:
      raise KeyError(f"AdmissionLedger.retire: groups {unknown} are not live.")
    for g in gone:
      v = self._version_of.pop(g)
      members = self._by_version[v]
      del members[g]
      if not members:
        del self._by_version[v]
    if trained:
      self.num_trained += len(gone)
    else:
      self.num_discarded += len(gone)

  def due(self, train_version: int, config: StalenessConfig) -> list[int]:
    """learner-wait: live groups that must be in the batch trained at `train_version`
    (`due_bound`), oldest admission first; O(due + distinct live versions)."""
    bound = due_bound(train_version, config)
    if bound is None:
      return []
    return [g for v in sorted(v for v in self._by_version if v <= bound)
            for g in self._by_version[v]]

  def _add(self, group_id: int, version: int) -> None:
    self._version_of[group_id] = version
    self._by_version.setdefault(version, {})[group_id] = None

  def to_dict(self) -> dict[str, Any]:
    """Plain-dict form (for resume)."""
    return {"num_admitted": self.num_admitted, "num_trained": self.num_trained,
            "num_discarded": self.num_discarded, "live": [list(x) for x in self.live()]}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> AdmissionLedger:
    """Inverse of `to_dict` (its keys are the constructor's arguments)."""
    return cls(**d)


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
    lost_groups, lost_samples, lost_tokens: groups given up because a sample never arrived
      (samples and tokens: those that did arrive).
    filtered_groups, filtered_samples, filtered_tokens: complete groups without learning signal
      dropped by dynamic sampling (`group_filter`, `PipelineConfig.filter_groups`).
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
  lost_groups: int = 0
  lost_samples: int = 0
  lost_tokens: int = 0
  filtered_groups: int = 0
  filtered_samples: int = 0
  filtered_tokens: int = 0

  @property
  def dropped_groups(self) -> int:
    """Groups discarded for any reason."""
    return sum(getattr(self, f"{r}_groups") for r in WASTE_REASONS)

  @property
  def wasted_tokens(self) -> int:
    """Generated tokens discarded for any reason."""
    return sum(getattr(self, f"{r}_tokens") for r in WASTE_REASONS)


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
