"""Discrete-event simulator of the three drivers (sync, async-batch, pipeline), no JAX.

It replays the reproducible driver (`rlax_pipe.pipeline.driver.run_reproducible`) with modelled
instead of real compute, and it decides admission, queueing, dropping and batching with THE SAME
code as the real pipeline: a real `RolloutQueue` (hence `staleness.can_admit`,
`admission_admit` / `admission_retire`, `partition_by_staleness`, `queue_overflow`, waste
counters) fed with synthetic `Rollout`s whose `policy_versions` are stamped per token.

Model (what is simulated, what is assumed):
  * Sampler: `num_engines` engines of `slots_per_engine` decode slots each (the KV / slot limit).
    Engines are modelled as one lock-step engine with C = num_engines * slots_per_engine slots
    and balanced load: a decode step advances every active slot by one token and lasts
    `DecodeCurve.latency(ceil(active / num_engines))` (latency of one engine vs its batch, fitted
    from decode spans by `calibration.fit_decode`). Admitted samples cost
    `prefill_per_sample_s` each (ceil(admitted / num_engines) in parallel) before the decode
    step. KV pages never run out (no preemption).
  * Driver rules (`rlax_pipe.pipeline.rollout_worker`): pipeline starts a group whenever
    group_size slots are free and admission allows, installs weights at any decode-step
    boundary; async-batch / sync generate rounds of groups_per_step groups, install weights only
    when the sampler is empty, and sync starts round r only with weights version r.
  * Learner: one step on the B oldest ready groups takes train_base_s + train_per_token_s *
    (completion tokens); the push then takes push_s; the sampler sees the new version at its
    first decode-step boundary at or after the push's end (newest version only).
  * Interleaving: the two virtual clocks advance exactly as in `run_reproducible` (the actor with
    the smaller clock moves; samples finished at sampler time t reach the queue at learner time
    >= t). Runs of decode steps during which nothing can change are advanced in one chunk, so a
    run costs O(finished samples + learner steps) Python operations, not O(decode steps).
Completion lengths come from a `distributions.LengthDist`, drawn a prompt group at a time.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import math
from typing import Any

import numpy as np

from rlax_pipe.pipeline import staleness as staleness_lib
from rlax_pipe.pipeline.config import DRIVERS
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.sim import distributions
# DecodeCurve is re-exported for callers that build a SimConfig from this module alone.
from rlax_pipe.sim.costs import DecodeCurve, SimCosts  # pylint: disable=unused-import
from rlax_pipe.types import Rollout


class SimDeadlock(RuntimeError):
  """Neither simulated side can make progress (a configuration that can never fill a batch)."""


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """One simulated run.

  Attributes:
    driver: "sync", "async-batch" or "pipeline" (see `rlax_pipe.pipeline.config.PipelineConfig`).
    staleness: the staleness policy (its groups_per_step is the learner batch in groups).
    group_size: samples per prompt group S (>= 1).
    num_steps: learner steps to simulate (>= 1).
    slots_per_engine: decode slots of one sampler engine (>= 1).
    num_engines: sampler engines (>= 1); concurrency C = num_engines * slots_per_engine.
    lengths: completion-length distribution (tokens).
    costs: modelled durations.
    warmup_steps: learner steps excluded from the reported rates, idle fractions and lags
      (0 <= warmup_steps < num_steps); the window starts when step warmup_steps ends.
    seed: seed of the length draws.
  """

  driver: str
  staleness: staleness_lib.StalenessConfig
  group_size: int
  num_steps: int
  slots_per_engine: int
  lengths: Any
  costs: SimCosts
  num_engines: int = 1
  warmup_steps: int = 0
  seed: int = 0

  def __post_init__(self):
    if self.driver not in DRIVERS:
      raise ValueError(f"SimConfig.driver={self.driver!r}; choose one of {DRIVERS}.")
    for name in ("group_size", "num_steps", "slots_per_engine", "num_engines"):
      if getattr(self, name) < 1:
        raise ValueError(f"SimConfig.{name}={getattr(self, name)} must be >= 1.")
    if not 0 <= self.warmup_steps < self.num_steps:
      raise ValueError(f"SimConfig.warmup_steps={self.warmup_steps} must be in [0, num_steps).")
    if self.driver == "pipeline" and self.concurrency < self.group_size:
      raise ValueError(f"SimConfig: pipeline needs slots ({self.concurrency}) >= group_size "
                       f"({self.group_size}) to ever start a group.")

  @property
  def groups_per_step(self) -> int:
    """Learner batch in groups."""
    return self.staleness.groups_per_step

  @property
  def batch_samples(self) -> int:
    """Learner batch in samples, B = groups_per_step * group_size."""
    return self.groups_per_step * self.group_size

  @property
  def concurrency(self) -> int:
    """C = num_engines * slots_per_engine."""
    return self.num_engines * self.slots_per_engine


@dataclasses.dataclass(frozen=True)
class SimResult:
  """What a simulated run measured over its window (see `SimConfig.warmup_steps`).

  Attributes:
    steps: learner steps simulated.
    end_time_s: virtual time at which the last step's push ended.
    window_s: (t0, t1) of the measurement window, seconds.
    samples_per_s, tokens_per_s: trained samples / completion tokens per second in the window.
    step_period_s: mean seconds between learner step ends in the window.
    idle_sampler, idle_learner: 1 - busy fraction over the window (sampler: prefill + decode;
      learner: train steps; pushes are the channel's).
    slot_occupancy: time-weighted active slots / C over decode time in the window.
    slot_idle: 1 - (active slot-seconds) / (C * window): unused slot time, waits included (the
      hardware idleness of a memory-bound sampler, whose step costs about the same at any batch).
    lag_hist: per-token lag histogram of trained tokens (index = lag in steps).
    lag_mean, lag_max: per-token lag mean / max of trained tokens.
    sample_lag_mean: mean over trained samples of their oldest token's lag (Applied Compute's
      staleness, `formulas.applied_compute_staleness`).
    mean_active_slots: time-weighted mean active slots over decode time.
    sync_t99_s, sync_t100_s: round-based drivers: mean seconds from a round's start until 99% /
      100% of its samples finished (None for pipeline).
    waste: discarded work by reason (from the queue), whole run.
    wasted_token_fraction: wasted / (wasted + trained) completion tokens, whole run.
  """

  steps: int
  end_time_s: float
  window_s: tuple[float, float]
  samples_per_s: float
  tokens_per_s: float
  step_period_s: float
  idle_sampler: float
  idle_learner: float
  slot_occupancy: float
  slot_idle: float
  lag_hist: tuple[int, ...]
  lag_mean: float
  lag_max: int
  sample_lag_mean: float
  mean_active_slots: float
  sync_t99_s: float | None
  sync_t100_s: float | None
  waste: staleness_lib.WasteCounters
  wasted_token_fraction: float

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready dict."""
    d = dataclasses.asdict(self)
    d["lag_hist"] = list(self.lag_hist)
    d["window_s"] = list(self.window_s)
    return d


class _Run:
  """Mutable state of one simulation (see module docstring); use `simulate`."""

  def __init__(self, cfg: SimConfig):
    self.cfg, self.costs = cfg, cfg.costs
    self.rng = np.random.default_rng(cfg.seed)
    self.queue = RolloutQueue(cfg.staleness, cfg.group_size)
    self.t_s = self.t_l = 0.0
    self.transit: list[tuple[float, int, Rollout]] = []
    self.seq = itertools.count()
    self.pending: tuple[float, int] | None = None  # (arrival time, version) in the channel
    self.must_act = False
    self.learner_waiting = False
    # Exact shortcuts: skip `try_admit` / `try_get_batch` calls whose inputs have not changed
    # since they last failed (admission state, sampler version; queue contents).
    self.admission_blocked = False
    self.unfinished: dict[int, int] = {}  # group id -> samples not yet put into the queue
    self.learner_version = 0
    # Sampler.
    self.version = 0  # weights version installed on the sampler
    self.change_steps, self.change_versions = [0], [0]  # decode step where each version began
    self.step_idx = 0
    self.active: list[tuple[int, int, int, int, float]] = []  # (finish step, sid, gid, start, t)
    self.waiting: collections.deque[tuple[int, int, int]] = collections.deque()  # sid, gid, len
    self.next_group = self.next_sample = 0
    self.rounds_started, self.round_open = 0, 0
    self.round_of_group: dict[int, int] = {}
    self.round_start: dict[int, float] = {}
    self.round_finishes: dict[int, list[float]] = collections.defaultdict(list)
    self.lengths = np.zeros((0, cfg.group_size), np.int64)  # lengths of the current 1024 groups
    self._zeros_i = np.zeros(1, np.int32)
    self._zeros_f = np.zeros(1, np.float32)
    # Records.
    self.sampler_spans: list[tuple[float, float, float]] = []  # (start, end, active)
    self.train_spans: list[tuple[float, float]] = []
    self.step_ends: list[float] = []
    self.step_tokens: list[int] = []
    self.step_samples: list[int] = []
    self.lag_counts = np.zeros(1, np.int64)
    self.sample_lag_sum = 0
    self.sample_count = 0

  # ---- sampler ----------------------------------------------------------------------------
  def _draw_group(self) -> list[int]:
    """Lengths of the next group (drawn 1024 groups at a time, used in order)."""
    k = self.next_group % 1024
    if k == 0:
      self.lengths = distributions.sample_groups(self.cfg.lengths, self.rng, 1024,
                                                 self.cfg.group_size, self.next_group)
      if self.lengths.min() < 1:
        raise ValueError("SimConfig.lengths drew a length < 1.")
    return self.lengths[k].tolist()

  def _has_work(self) -> bool:
    return bool(self.active) or bool(self.waiting)

  def _may_install(self) -> bool:
    return self.cfg.driver == "pipeline" or not self._has_work()

  def _deliver(self, now: float) -> None:
    if self.pending is not None and self.pending[0] <= now and self._may_install():
      self.version = self.pending[1]
      self.pending = None
      self.admission_blocked = False
      if self.change_steps[-1] == self.step_idx:
        self.change_versions[-1] = self.version
      else:
        self.change_steps.append(self.step_idx)
        self.change_versions.append(self.version)

  def _submit_group(self) -> None:
    gid = self.next_group
    self.unfinished[gid] = self.cfg.group_size
    for length in self._draw_group():
      self.waiting.append((self.next_sample, gid, length))
      self.next_sample += 1
    self.next_group += 1
    if self.cfg.driver != "pipeline":
      self.round_of_group[gid] = self.rounds_started - 1

  def _top_up(self) -> None:
    """`RolloutWorker.top_up`, same rules."""
    cfg = self.cfg
    pipeline = cfg.driver == "pipeline"
    if not pipeline and self.round_open == 0:
      if self._has_work():
        return
      if cfg.driver == "sync" and self.version < self.rounds_started:
        return
      self.rounds_started += 1
      self.round_open = cfg.groups_per_step
      self.round_start[self.rounds_started - 1] = self.t_s
    while True:
      if pipeline and cfg.concurrency - len(self.active) - len(self.waiting) < cfg.group_size:
        break
      if not pipeline and self.round_open == 0:
        break
      if self.admission_blocked:
        break
      if not self.queue.try_admit(self.next_group, self.version):
        self.admission_blocked = True
        break
      self._submit_group()
      if not pipeline:
        self.round_open -= 1

  def _versions(self, start: int, length: int) -> np.ndarray:
    """int32[length] version of the weights at decode steps start .. start + length - 1."""
    cs, cv = self.change_steps, self.change_versions
    i = bisect.bisect_right(cs, start) - 1
    end, pos, vals, counts = start + length, start, [], []
    if i + 1 == len(cs) or cs[i + 1] >= end:
      return np.full(length, cv[i], np.int32)
    while pos < end:
      seg_end = min(cs[i + 1], end) if i + 1 < len(cs) else end
      vals.append(cv[i])
      counts.append(seg_end - pos)
      pos, i = seg_end, i + 1
    return np.repeat(np.asarray(vals, np.int32), counts)

  def _rollout(self, sid: int, gid: int, start: int, length: int, t_admit: float) -> Rollout:
    if self._zeros_i.shape[0] < length:
      self._zeros_i = np.zeros(2 * length, np.int32)
      self._zeros_f = np.zeros(2 * length, np.float32)
    return Rollout(sample_id=sid, group_id=gid, prompt_tokens=self._zeros_i[:1],
                   completion_tokens=self._zeros_i[:length],
                   behavior_logprobs=self._zeros_f[:length],
                   policy_versions=self._versions(start, length), finish_reason="eos",
                   t_admit=t_admit, t_first_token=t_admit, t_finish=self.t_s)

  def _sampler_move(self) -> None:
    """One engine step (admit, prefill, decode) plus every following decode step during which
    nothing can change (no finish, no learner move, no weight arrival)."""
    cfg, costs = self.cfg, self.costs
    free = cfg.concurrency - len(self.active)
    admitted = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
    t0 = self.t_s
    if admitted:
      prefill = costs.prefill_per_sample_s * math.ceil(len(admitted) / cfg.num_engines)
      for sid, gid, length in admitted:
        heapq.heappush(self.active, (self.step_idx + length - 1, sid, gid, self.step_idx, t0))
      if prefill > 0:
        self.sampler_spans.append((t0, t0 + prefill, -1.0))
      self.t_s += prefill
    if not self.active:
      return
    n_active = len(self.active)
    dt = costs.decode.latency(math.ceil(n_active / cfg.num_engines))
    limit = math.inf
    if not (self.learner_waiting and not self.transit):
      limit = self.t_l
    if self.pending is not None and cfg.driver == "pipeline":
      limit = min(limit, self.pending[0])
    t1 = self.t_s + dt
    extra = self.active[0][0] - self.step_idx  # decode steps until the first finish
    if extra > 0 and limit > t1:
      if dt > 0 and limit < math.inf:
        fit = min(extra, math.ceil((limit - t1) / dt))
        while fit > 0 and t1 + (fit - 1) * dt >= limit:
          fit -= 1
        extra = fit
    else:
      extra = 0
    n = 1 + extra
    t_end = self.t_s + n * dt
    self.sampler_spans.append((self.t_s, t_end, float(n_active)))
    self.t_s = t_end
    self.step_idx += n
    if self.learner_waiting and not self.transit:
      self.t_l = self.t_s  # the waiting learner follows the sampler's clock
    while self.active and self.active[0][0] < self.step_idx:
      _, sid, gid, start, t_admit = heapq.heappop(self.active)
      length = self.step_idx - start
      heapq.heappush(self.transit, (self.t_s, next(self.seq),
                                    self._rollout(sid, gid, start, length, t_admit)))
      rnd = self.round_of_group.get(gid)
      if rnd is not None:
        self.round_finishes[rnd].append(self.t_s)

  # ---- learner ----------------------------------------------------------------------------
  def _learner_move(self) -> None:
    cfg = self.cfg
    completed = False  # did a put complete a group (the only way a put changes the ready set)
    while self.transit and self.transit[0][0] <= self.t_l:
      rollout = heapq.heappop(self.transit)[2]
      self.queue.put(rollout)
      self.unfinished[rollout.group_id] -= 1
      if not self.unfinished[rollout.group_id]:
        del self.unfinished[rollout.group_id]
        completed = True
    self._deliver(self.t_s)
    if self.learner_waiting and not completed and not self.must_act:
      self.t_l = self.t_s  # the queue is unchanged since the last failed try: still no batch
      return
    self.admission_blocked = False  # puts and batches may drop or retire groups
    groups = self.queue.try_get_batch(cfg.groups_per_step, self.learner_version)
    if groups is None:
      if self.must_act:
        q = self.queue.stats()
        raise SimDeadlock(
            f"simulated learner (version {self.learner_version}) waits for "
            f"{cfg.groups_per_step} groups: {q.ready_groups} ready, {q.in_flight_groups} in "
            f"flight; the sampler may not start another group (driver {cfg.driver!r}, "
            f"staleness {cfg.staleness}, {cfg.concurrency} slots).")
      self.learner_waiting = True
      self.t_l = self.t_s
      return
    self.learner_waiting = self.must_act = False
    rollouts = [r for g in groups for r in g]
    tokens = sum(r.num_completion_tokens for r in rollouts)
    if len(self.step_ends) >= cfg.warmup_steps:
      v = self.learner_version
      lags = v - np.concatenate([r.policy_versions for r in rollouts]).astype(np.int64)
      counts = np.bincount(lags)
      if counts.shape[0] > self.lag_counts.shape[0]:
        counts[:self.lag_counts.shape[0]] += self.lag_counts
        self.lag_counts = counts
      else:
        self.lag_counts[:counts.shape[0]] += counts
      self.sample_lag_sum += sum(v - r.oldest_version() for r in rollouts)
      self.sample_count += len(rollouts)
    dt = self.costs.train(tokens)
    self.train_spans.append((self.t_l, self.t_l + dt))
    self.learner_version += 1
    self.queue.set_learner_version(self.learner_version)
    self.t_l += dt + self.costs.push_s
    self.pending = (self.t_l, self.learner_version)
    self.step_ends.append(self.t_l)
    self.step_tokens.append(tokens)
    self.step_samples.append(len(rollouts))

  # ---- loop -------------------------------------------------------------------------------
  def run(self) -> SimResult:
    while len(self.step_ends) < self.cfg.num_steps:
      if self.t_s < self.t_l or (self.t_s == self.t_l and not self.must_act):
        self._deliver(self.t_s)
        self._top_up()
        if self._has_work():
          self._sampler_move()
        else:
          targets = [t for t in (self.pending[0] if self.pending else None, self.t_l)
                     if t is not None and t > self.t_s]
          if targets:
            self.t_s = min(targets)
          else:
            self.must_act = True
      else:
        self._learner_move()
    return self._result()

  def _result(self) -> SimResult:
    cfg = self.cfg
    w = cfg.warmup_steps
    lo = self.step_ends[w - 1] if w else 0.0
    hi = self.step_ends[-1]
    span = max(hi - lo, 1e-300)
    s = np.asarray(self.sampler_spans, np.float64).reshape(-1, 3)
    clip = np.clip(np.minimum(s[:, 1], hi) - np.maximum(s[:, 0], lo), 0.0, None)
    decode = s[:, 2] >= 0
    busy_s = float(clip.sum())
    tr = np.asarray(self.train_spans, np.float64).reshape(-1, 2)
    busy_l = float(np.clip(np.minimum(tr[:, 1], hi) - np.maximum(tr[:, 0], lo), 0, None).sum())
    decode_time = float(clip[decode].sum())
    active_time = float((clip[decode] * s[decode, 2]).sum())
    lag_total = int(self.lag_counts.sum())
    stats = self.queue.stats()
    nz = np.nonzero(self.lag_counts)[0]
    t99 = t100 = None
    done = [r for r in self.round_finishes if len(self.round_finishes[r]) >= cfg.batch_samples]
    if cfg.driver != "pipeline" and done:
      k99 = math.ceil(0.99 * cfg.batch_samples) - 1
      t99 = float(np.mean([sorted(self.round_finishes[r])[k99] - self.round_start[r]
                           for r in done]))
      t100 = float(np.mean([max(self.round_finishes[r]) - self.round_start[r] for r in done]))
    return SimResult(
        steps=len(self.step_ends), end_time_s=hi, window_s=(lo, hi),
        samples_per_s=sum(self.step_samples[w:]) / span,
        tokens_per_s=sum(self.step_tokens[w:]) / span,
        step_period_s=span / (cfg.num_steps - w),
        idle_sampler=1.0 - busy_s / span, idle_learner=1.0 - busy_l / span,
        slot_occupancy=active_time / (cfg.concurrency * decode_time) if decode_time else 0.0,
        slot_idle=1.0 - active_time / (cfg.concurrency * span),
        lag_hist=tuple(int(c) for c in self.lag_counts),
        lag_mean=float((self.lag_counts * np.arange(self.lag_counts.shape[0])).sum()
                       / max(lag_total, 1)),
        lag_max=int(nz.max()) if nz.size else 0,
        sample_lag_mean=self.sample_lag_sum / max(self.sample_count, 1),
        mean_active_slots=active_time / decode_time if decode_time else 0.0,
        sync_t99_s=t99, sync_t100_s=t100, waste=stats.waste,
        wasted_token_fraction=stats.waste.wasted_tokens / max(
            1, stats.waste.wasted_tokens + stats.trained_tokens))


def simulate(cfg: SimConfig) -> SimResult:
  """Runs one simulation (deterministic for a given `cfg.seed`).

  Example:
    cfg = SimConfig(driver="pipeline", staleness=StalenessConfig("block", 2, 4), group_size=4,
                    num_steps=200, slots_per_engine=32, lengths=distributions.LogNormal(200, 1),
                    costs=SimCosts(DecodeCurve(0.01, 2e-4), train_base_s=0.05,
                                   train_per_token_s=1e-4))
    res = simulate(cfg)   # res.tokens_per_s, res.lag_mean, res.idle_sampler, ...

  Raises:
    SimDeadlock: if the configuration can never fill a learner batch.
  """
  return _Run(cfg).run()


def rates(cfg: SimConfig) -> tuple[float, float, float]:
  """Unstalled rates of the two sides: (v_rollout, v_train, rho) in samples/s.

  v_rollout = C / (E[L] * latency(C per engine) + prefill): every slot busy, Little's law;
  v_train = B / (train_base + train_per_token * B * E[L] + push). rho = v_rollout / v_train is
  the utilization of `formulas.applied_compute_staleness`.
  """
  mean_len = float(cfg.lengths.mean())
  c = cfg.costs
  per_sample = mean_len * c.decode.latency(cfg.slots_per_engine) + c.prefill_per_sample_s
  v_rollout = cfg.concurrency / per_sample
  b = cfg.batch_samples
  v_train = b / (c.train(b * mean_len) + c.push_s)
  return v_rollout, v_train, v_rollout / v_train
