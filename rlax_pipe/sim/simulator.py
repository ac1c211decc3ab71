"""Discrete-event simulator of the three drivers (sync, async-batch, pipeline); host-side
Python and numpy, no JAX computation.

It replays the reproducible driver (`rlax_pipe.pipeline.driver.VirtualClocks`) with modelled
instead of real compute, and it decides everything with THE SAME code as the real pipeline: the
driver rules of `rlax_pipe.pipeline.rules` (when a group may start, when weights install, who
moves next), a real `RolloutQueue` (the staleness admission `staleness.AdmissionLedger`, drops,
due groups and the learner's batch rule `staleness.batch_size`, waste counters) fed with
synthetic `Rollout`s whose `policy_versions` are stamped per token, and the learner's batch
shape rule (`rules.batch_rows`, `rules.micro_batch_plan`). Durations come from the same
`rlax_pipe.costs.CostModel` as the reproducible driver's virtual clock, with the same features,
so on the same lengths and costs the simulator reproduces the driver's schedule exactly
(tests/sim/test_same_schedule.py).

Model (what is simulated, what is assumed):
  * Sampler: `num_engines` engines of `slots_per_engine` decode slots each (the KV / slot limit),
    modelled as one lock-step engine with C = num_engines * slots_per_engine slots and balanced
    load: each engine step admits waiting requests (FIFO) into free slots, prefills them
    (prompt length - 1 tokens each, in calls of `prefill_rows` rows; with shared prompt pages
    only a group's first sample admitted under the current weights), then runs one decode
    dispatch of up to K steps, each advancing every active slot by one token; the dispatch
    stops early once min(waiting requests, ceil(slots / 8)) slots finished in it, or when every
    slot is done (`rules.refill_at`: the engine's own rule, `rlax_pipe.host_rules.refill_at`, and
    `sampler.device_loop.decode_dispatch`). The step costs
    `CostModel.engine_step` of one engine's share (ceil(x / num_engines) of the slot-steps, live
    tokens, prefill calls and tokens). A slot's live tokens are its prompt plus the tokens
    generated so far. KV pages never run out (no preemption), and a weight swap does not
    re-prefill running sequences (`SamplerConfig.kv_policy="keep"`).
  * Driver rules: `rules.begin_top_up`, `rules.may_start_group`, `rules.may_update_weights`,
    `rules.sampler_moves_next`, `rules.weights_deliverable`; weight swaps are charged to the
    next engine step (`CostModel.install_s`). Under policy `drop` groups in flight whose oldest
    token is already too stale are given up when the learner's version changes, their requests
    aborted (slots freed) and counted as waste (`RolloutWorker.abort_too_stale` with the
    engine's per-request abort).
  * Dynamic sampling (`SimConfig.group_filter`): rewards come from `SimConfig.rewards` (drawn a
    group at a time); the real queue drops zero-variance groups (waste reason "filtered", up to
    its bound per learner batch) and the sampler admits replacements by the same rules as the
    worker (the staleness admission; `rules.reopen_filtered` for round-based drivers).
  * Learner: one step on the batch the queue hands out takes `CostModel.train(rows * seq_len,
    micro-batches)` (rows from the packing rule; without `seq_len`, the batch's tokens); the push
    then takes `CostModel.push(push_bytes)`; the sampler sees the new version at its first step
    boundary at or after the push's end (newest version only).
  * Interleaving: the two virtual clocks advance exactly as in `VirtualClocks` (the actor with
    the smaller clock moves; samples finished at sampler time t reach the queue at learner time
    >= t). Runs of engine steps during which nothing can change are advanced in one chunk
    (`CostModel.decode_run`, exact), so a run costs O(finished samples + learner steps) Python
    operations plus O(decode steps) vectorised numpy work.
Completion lengths come from a `distributions.LengthDist`, drawn a prompt group at a time, prompt
lengths from `prompt_lengths`, one per group.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import math

import numpy as np

from rlax_pipe.costs import CostModel
from rlax_pipe.costs import model as costs_model
from rlax_pipe.pipeline import rules
from rlax_pipe.pipeline import staleness as staleness_lib
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.sim import distributions
from rlax_pipe.sim.sim_config import SimConfig, SimDeadlock, SimResult
from rlax_pipe.types import Rollout


class _Run:
  """Mutable state of one simulation (see module docstring); use `simulate`."""

  def __init__(self, cfg: SimConfig):
    self.cfg, self.costs = cfg, cfg.costs
    self.rng = np.random.default_rng(cfg.seed)
    self.prompt_rng = np.random.default_rng([cfg.seed, 1])
    self.reward_rng = np.random.default_rng([cfg.seed, 2])
    self.queue = RolloutQueue(cfg.staleness, cfg.group_size, cfg.group_filter)
    self.t_s = self.t_l = 0.0
    self.transit: list[tuple[float, int, Rollout]] = []
    self.seq = itertools.count()
    self.pending: tuple[float, int] | None = None  # (arrival time, version) in the channel
    self.must_act = False
    self.learner_waiting = False
    self.installs = 0  # weight swaps charged to the next engine step
    # Exact shortcut: skip `try_admit` calls whose inputs have not changed since they last
    # failed (admission state, sampler version).
    self.admission_blocked = False
    self.unfinished: dict[int, int] = {}  # group id -> samples not yet put into the queue
    self.learner_version = 0
    # Sampler.
    self.version = 0  # weights version installed on the sampler
    self.change_steps, self.change_versions = [0], [0]  # decode step where each version began
    self.step_idx = 0
    # active: (last decode step, sid, gid, start step, t_admit, prompt length, slot)
    self.active: list[tuple[int, int, int, int, float, int, int]] = []
    self.free_slots = list(range(cfg.concurrency))  # min-heap: the engine fills the lowest
    self.sum_prompt = self.sum_start = 0  # over active: live tokens = these + n * step
    self.waiting: collections.deque[tuple[int, int, int, int]] = collections.deque()
    self.outstanding: dict[int, int] = {}  # sid -> gid of samples whose group is not given up
    self.entries: dict[int, int] = {}  # group id -> weights version of its shared prompt entry
    self.stale_checked_version = -1
    self.next_group = self.next_sample = 0
    self.rounds = rules.RoundState()
    self.filtered_reopened = 0  # groups dropped by the filter that were re-opened (rounds)
    self.round_of_group: dict[int, int] = {}
    self.round_start: dict[int, float] = {}
    self.round_finishes: dict[int, list[float]] = collections.defaultdict(list)
    self.lengths = np.zeros((0, cfg.group_size), np.int64)  # lengths of the current 1024 groups
    self.prompts = np.zeros((0, 1), np.int64)
    self.rewards = np.zeros((0, cfg.group_size), np.float64)
    self.sample_reward: dict[int, float] = {}  # sid -> reward, while the sample is unfinished
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
    self.sample_lag_max = 0
    self.sample_count = 0
    self.schedule: list = []

  # ---- sampler ----------------------------------------------------------------------------
  def _draw_group(self) -> tuple[list[int], int, list[float] | None]:
    """Completion lengths, prompt length and rewards (None without a reward model) of the next
    group (drawn 1024 groups at a time, each from its own random stream)."""
    k = self.next_group % 1024
    if k == 0:
      if self.cfg.rewards is not None:
        self.rewards = np.asarray(self.cfg.rewards.sample_groups(
            self.reward_rng, 1024, self.cfg.group_size, self.next_group), np.float64)
      self.lengths = distributions.sample_groups(self.cfg.lengths, self.rng, 1024,
                                                 self.cfg.group_size, self.next_group)
      self.prompts = distributions.sample_groups(self.cfg.prompt_lengths, self.prompt_rng, 1024,
                                                 1, self.next_group)
      if self.lengths.min() < 1 or self.prompts.min() < 1:
        raise ValueError("SimConfig.lengths / prompt_lengths drew a length < 1.")
    rewards = None if self.cfg.rewards is None else self.rewards[k].tolist()
    return self.lengths[k].tolist(), int(self.prompts[k, 0]), rewards

  def _has_work(self) -> bool:
    return bool(self.active) or bool(self.waiting)

  def _deliver(self, now: float) -> None:
    may = rules.may_update_weights(self.cfg.driver, self._has_work())
    if rules.weights_deliverable(None if self.pending is None else self.pending[0], now, may):
      self.version = self.pending[1]
      self.pending = None
      self.installs += 1
      self.entries.clear()  # a swap drops the prompt entries of older weights
      self.admission_blocked = False
      if self.change_steps[-1] == self.step_idx:
        self.change_versions[-1] = self.version
      else:
        self.change_steps.append(self.step_idx)
        self.change_versions.append(self.version)

  def _submit_group(self) -> None:
    gid = self.next_group
    self.unfinished[gid] = self.cfg.group_size
    lengths, prompt, rewards = self._draw_group()
    if self.cfg.max_seq_len is not None:
      lengths = [max(1, min(n, self.cfg.max_seq_len - prompt)) for n in lengths]
    for i, length in enumerate(lengths):
      self.waiting.append((self.next_sample, gid, length, prompt))
      self.outstanding[self.next_sample] = gid
      if rewards is not None:
        self.sample_reward[self.next_sample] = rewards[i]
      self.next_sample += 1
    self.next_group += 1
    if self.cfg.driver != "pipeline":
      self.round_of_group[gid] = self.rounds.rounds_started - 1

  def _top_up(self) -> None:
    """`RolloutWorker.top_up`: the same rules (`rules`) and the same admission (the queue)."""
    cfg = self.cfg
    filtered = self.queue.filtered_groups()
    self.rounds = rules.reopen_filtered(cfg.driver, self.rounds,
                                        filtered - self.filtered_reopened)
    self.filtered_reopened = filtered
    started = self.rounds.rounds_started
    self.rounds, ok = rules.begin_top_up(cfg.driver, self.rounds, has_work=self._has_work(),
                                         weights_version=self.version,
                                         groups_per_step=cfg.groups_per_step)
    if self.rounds.rounds_started != started:
      self.round_start[self.rounds.rounds_started - 1] = self.t_s
    while ok and not self.admission_blocked and rules.may_start_group(
        cfg.driver, self.rounds, cfg.concurrency - len(self.active) - len(self.waiting)):
      ids = range(self.next_sample, self.next_sample + cfg.group_size)
      if not self.queue.try_admit(self.next_group, self.version, sample_ids=ids):
        self.admission_blocked = True
        break
      self._submit_group()
      self.rounds = rules.group_started(cfg.driver, self.rounds)

  def _abort_too_stale(self) -> None:
    """`RolloutWorker.abort_too_stale` with the engine's per-request abort: under policy drop,
    when the learner's next version changes, groups with a running sample whose first token is
    already too stale are given up; their requests leave the engine (slots freed) and their
    partial rollouts go to the queue, which counts them as waste."""
    st = self.cfg.staleness
    if st.policy != "drop" or st.max_lag is None:
      return
    v = self.queue.next_train_version()
    if v == self.stale_checked_version:
      return
    self.stale_checked_version = v
    doomed = {gid for _, sid, gid, start, *_ in self.active if sid in self.outstanding
              and staleness_lib.is_too_stale(self._versions(start, 1)[0], v, st.max_lag)}
    if not doomed:
      return
    for gid in sorted(doomed):
      self.queue.discard_group(gid, "stale")
      for sid in [s for s, g in self.outstanding.items() if g == gid]:
        del self.outstanding[sid]
        self._abort(sid, gid)
    self.admission_blocked = False

  def _abort(self, sid: int, gid: int) -> None:
    """Takes one request out of the engine (running or waiting) and puts its partial rollout."""
    for i, e in enumerate(self.active):
      if e[1] == sid:
        last, _, _, start, t_admit, prompt, slot = e
        self.active[i] = self.active[-1]
        self.active.pop()
        heapq.heapify(self.active)
        heapq.heappush(self.free_slots, slot)
        self.sum_prompt -= prompt
        self.sum_start -= start
        rollout = self._rollout(sid, gid, start, self.step_idx - start, t_admit, prompt)
        break
    else:
      for i, (wsid, _, _, prompt) in enumerate(self.waiting):
        if wsid == sid:
          del self.waiting[i]
          rollout = self._rollout(sid, gid, self.step_idx, 0, self.t_s, prompt)
          break
      else:
        return  # finished already: in transit, counted when it reaches the queue
    rollout = dataclasses.replace(rollout, finish_reason="aborted")
    self.queue.put(rollout)
    self.unfinished[gid] -= 1
    if not self.unfinished[gid]:
      del self.unfinished[gid]

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

  def _rollout(self, sid: int, gid: int, start: int, length: int, t_admit: float,
               prompt: int) -> Rollout:
    need = max(length, prompt)
    if self._zeros_i.shape[0] < need:
      self._zeros_i = np.zeros(2 * need, np.int32)
      self._zeros_f = np.zeros(2 * need, np.float32)
    return Rollout(sample_id=sid, group_id=gid, prompt_tokens=self._zeros_i[:prompt],
                   completion_tokens=self._zeros_i[:length],
                   behavior_logprobs=self._zeros_f[:length],
                   policy_versions=self._versions(start, length), finish_reason="eos",
                   reward=self.sample_reward.pop(sid, 0.0),
                   t_admit=t_admit, t_first_token=t_admit, t_finish=self.t_s)

  def _prefill(self, admitted) -> tuple[int, int]:
    """(prefill calls, prefill tokens) of `admitted`, as the engine counts them: prompt length
    - 1 tokens per leader, in calls of `prefill_rows` rows; with shared prompt pages, a sample
    whose group has an entry made under the current weights (`self.entries`) is a follower and
    prefills nothing."""
    cfg = self.cfg
    leaders = tokens = 0
    for _, gid, _, p in admitted:
      if cfg.share_prompt_pages and self.entries.get(gid) == self.version:
        continue
      if p > 1:
        leaders, tokens = leaders + 1, tokens + p - 1
        if cfg.share_prompt_pages:
          self.entries[gid] = self.version
    return math.ceil(leaders / cfg.prefill_rows), tokens

  def _dispatch(self) -> tuple[int, int, int, int]:
    """(steps n, slot-steps, live-token-steps, slots finishing) of the next dispatch: up to K
    steps, fewer when every slot is done or when min(waiting, ceil(slots / 8)) slots finish
    (the engine's refill rule)."""
    cfg, k = self.cfg, self.cfg.decode_steps_per_dispatch
    first = self.active[0][0] - self.step_idx + 1  # tokens left of the soonest finisher
    if first > k:
      n_active = len(self.active)
      live = self.sum_prompt + n_active * self.step_idx - self.sum_start
      return k, n_active * k, k * live + n_active * k * (k - 1) // 2, 0
    left = sorted(f - self.step_idx + 1 for f, *_ in self.active)
    refill_at = rules.refill_at(len(self.waiting), cfg.slots_per_engine)
    n = min(k, left[-1], left[refill_at - 1] if refill_at > 0 else k)
    slot_steps = live_steps = finishing = 0
    for f, _, _, start, _, prompt, _ in self.active:
      c = min(f - self.step_idx + 1, n)
      live = prompt + self.step_idx - start
      slot_steps += c
      live_steps += c * live + c * (c - 1) // 2
      finishing += c == f - self.step_idx + 1
    return n, slot_steps, live_steps, finishing

  def _sampler_move(self) -> None:
    """One engine step (admit, prefill, one dispatch) plus every following engine step during
    which nothing can change (no finish, no learner move, no weight arrival)."""
    cfg = self.cfg
    free = cfg.concurrency - len(self.active)
    admitted = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
    t0 = self.t_s
    calls, tokens = self._prefill(admitted)
    for sid, gid, length, prompt in admitted:
      heapq.heappush(self.active, (self.step_idx + length - 1, sid, gid, self.step_idx, t0, prompt,
                                   heapq.heappop(self.free_slots)))
      self.sum_prompt += prompt
      self.sum_start += self.step_idx
    if not self.active:
      return
    e, k = cfg.num_engines, cfg.decode_steps_per_dispatch
    n, slot_steps, live_steps, finishing = self._dispatch()
    prefill, rest = self.costs.engine_step(costs_model.EngineStep(
        installs=self.installs, prefill_calls=math.ceil(calls / e),
        prefill_tokens=math.ceil(tokens / e), dispatches=1, decode_steps=n,
        slot_steps=math.ceil(slot_steps / e), live_token_steps=math.ceil(live_steps / e)))
    self.installs = 0
    if prefill > 0:
      self.sampler_spans.append((t0, t0 + prefill, -1.0))
    t_start = self.t_s = t0 + prefill
    t_end = t_start + rest
    limit = math.inf
    if not (self.learner_waiting and not self.transit):
      limit = self.t_l
    if self.pending is not None and cfg.driver == "pipeline":
      limit = min(limit, self.pending[0])
    n_active = len(self.active)
    more = (self.active[0][0] - self.step_idx) // k - 1 if not finishing else 0
    if more > 0 and limit > t_end:
      # Later dispatches grow longer (live tokens grow): the first one's duration bounds the count.
      cap = more if limit == math.inf or rest <= 0 else min(
          more, math.ceil((limit - t_end) / rest) + 1)
      live = self.sum_prompt + n_active * (self.step_idx + k) - self.sum_start
      durs = self.costs.decode_run(cap, math.ceil(n_active / e), math.ceil(live / e), steps=k)
      ends = t_end + np.cumsum(durs)
      starts = np.concatenate([[t_end], ends[:-1]])
      extra = int(np.searchsorted(starts, limit, side="left"))  # dispatches starting < limit
      if extra:
        t_end = float(ends[extra - 1])
      n += extra * k
    self.sampler_spans.append((t_start, t_end, float(n_active)))
    self.t_s = t_end
    self.step_idx += n
    if self.learner_waiting and not self.transit:
      self.t_l = self.t_s  # the waiting learner follows the sampler's clock
    done = []
    while self.active and self.active[0][0] < self.step_idx:
      done.append(heapq.heappop(self.active))
    for last, sid, gid, start, t_admit, prompt, slot in sorted(done, key=lambda e: e[6]):
      # The engine returns a dispatch's finished samples in slot order.
      heapq.heappush(self.free_slots, slot)
      self.sum_prompt -= prompt
      self.sum_start -= start
      self.outstanding.pop(sid, None)
      length = last - start + 1  # it may have stopped before the dispatch's last step
      heapq.heappush(self.transit, (self.t_s, next(self.seq),
                                    self._rollout(sid, gid, start, length, t_admit, prompt)))
      rnd = self.round_of_group.get(gid)
      if rnd is not None:
        self.round_finishes[rnd].append(self.t_s)

  # ---- learner ----------------------------------------------------------------------------
  def _train_seconds(self, rollouts: list[Rollout]) -> float:
    cfg = self.cfg
    lengths = [r.prompt_tokens.shape[0] + r.num_completion_tokens for r in rollouts]
    if cfg.seq_len is None:
      return self.costs.train(sum(lengths), cfg.num_minibatches)
    rows = rules.batch_rows(lengths, cfg.seq_len)
    micro, processed = rules.micro_batch_plan(rows, cfg.micro_batch_rows,
                                                 cfg.num_minibatches)
    return self.costs.train(processed * cfg.seq_len, micro)

  def _record_lags(self, rollouts: list[Rollout]) -> None:
    v = self.learner_version
    lags = v - np.concatenate([r.policy_versions for r in rollouts]).astype(np.int64)
    counts = np.bincount(lags)
    if counts.shape[0] > self.lag_counts.shape[0]:
      counts[:self.lag_counts.shape[0]] += self.lag_counts
      self.lag_counts = counts
    else:
      self.lag_counts[:counts.shape[0]] += counts
    sample_lags = [v - r.oldest_version() for r in rollouts]
    self.sample_lag_sum += sum(sample_lags)
    self.sample_lag_max = max(self.sample_lag_max, max(sample_lags))
    self.sample_count += len(rollouts)

  def _learner_move(self) -> None:
    cfg = self.cfg
    completed = False  # did a put complete a group (the only way a put changes the ready set)
    filtered = self.queue.filtered_groups()
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
      if rules.deadlocked(self.must_act, filtered, self.queue.filtered_groups()):
        q = self.queue.stats()
        raise SimDeadlock(
            f"simulated learner (version {self.learner_version}) waits for "
            f"{cfg.groups_per_step} groups: {q.ready_groups} ready, {q.in_flight_groups} in "
            f"flight; the sampler may not start another group (driver {cfg.driver!r}, "
            f"staleness {cfg.staleness}, {cfg.concurrency} slots).")
      self.learner_waiting = True
      self.must_act = False  # (a filtered group released an admission: the sampler moves)
      self.t_l = self.t_s
      return
    self.learner_waiting = self.must_act = False
    rollouts = [r for g in groups for r in g]
    tokens = sum(r.num_completion_tokens for r in rollouts)
    if len(self.step_ends) >= cfg.warmup_steps:
      self._record_lags(rollouts)
    dt = self._train_seconds(rollouts)
    push = self.costs.push(cfg.push_bytes)
    self.train_spans.append((self.t_l, self.t_l + dt))
    self.learner_version += 1
    self.queue.set_learner_version(self.learner_version)
    self.t_l += dt + push
    self.pending = (self.t_l, self.learner_version)
    self.step_ends.append(self.t_l)
    self.step_tokens.append(tokens)
    self.step_samples.append(len(rollouts))
    if cfg.record_schedule:
      self.schedule.append((self.t_l, tuple((r.sample_id, r.group_id,
                                             tuple(r.policy_versions.tolist()))
                                            for r in rollouts)))

  # ---- loop -------------------------------------------------------------------------------
  def run(self) -> SimResult:
    while len(self.step_ends) < self.cfg.num_steps:
      if rules.sampler_moves_next(self.t_s, self.t_l, self.must_act):
        self._deliver(self.t_s)
        self._abort_too_stale()
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
        token_lag_mean=float((self.lag_counts * np.arange(self.lag_counts.shape[0])).sum()
                             / max(lag_total, 1)),
        token_lag_max=int(nz.max()) if nz.size else 0,
        sample_lag_mean=self.sample_lag_sum / max(self.sample_count, 1),
        sample_lag_max=self.sample_lag_max,
        mean_active_slots=active_time / decode_time if decode_time else 0.0,
        sync_t99_s=t99, sync_t100_s=t100, waste=stats.waste,
        wasted_token_fraction=stats.waste.wasted_tokens / max(
            1, stats.waste.wasted_tokens + stats.trained_tokens),
        schedule=tuple(self.schedule) if cfg.record_schedule else None,
        generated_samples_per_step=(stats.trained_samples + sum(
            getattr(stats.waste, f"{r}_samples") for r in staleness_lib.WASTE_REASONS))
        / len(self.step_ends),
        filter_kept_groups=stats.filter_kept_groups)


def simulate(cfg: SimConfig) -> SimResult:
  """Runs one simulation (deterministic for a given `cfg.seed`).

  Example:
    cfg = SimConfig(driver="pipeline", staleness=StalenessConfig("block", 2, 4), group_size=4,
                    num_steps=200, slots_per_engine=32, lengths=distributions.LogNormal(200, 1),
                    costs=CostModel(decode_step_s=0.01, slot_step_s=2e-4, train_step_s=0.05,
                                    train_token_s=1e-4))
    res = simulate(cfg)   # res.tokens_per_s, res.sample_lag_mean, res.idle_sampler, ...

  Raises:
    SimDeadlock: if the configuration can never fill a learner batch.
  """
  return _Run(cfg).run()


def rates(cfg: SimConfig) -> tuple[float, float, float]:
  """Unstalled rates of the two sides: (v_rollout, v_train, rho) in samples/s.

  v_rollout = C / (E[L] * step(S) + prefill): every slot busy (Little's law), a step of one
  engine with S = slots_per_engine active slots holding P + E[L] / 2 live tokens each on average;
  v_train = B / (train(B (P + E[L]) tokens) + push). rho = v_rollout / v_train is the
  utilization of `formulas.applied_compute_staleness`. P = the mean prompt length.
  """
  mean_len = float(cfg.lengths.mean())
  prompt = float(cfg.prompt_lengths.mean())
  c, slots = cfg.costs, cfg.slots_per_engine
  _, step = c.engine_step(costs_model.EngineStep(
      dispatches=1, decode_steps=1, slot_steps=slots,
      live_token_steps=round(slots * (prompt + mean_len / 2))))
  per_sample = mean_len * step + c.prefill(1 / cfg.prefill_rows, prompt - 1)
  v_rollout = cfg.concurrency / per_sample
  b = cfg.batch_samples
  v_train = b / (c.train(round(b * (prompt + mean_len))) + c.push(cfg.push_bytes))
  return v_rollout, v_train, v_rollout / v_train
