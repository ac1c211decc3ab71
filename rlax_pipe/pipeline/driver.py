"""The one learner loop, `drive(job, clock, hooks)`, and the clocks that decide how time moves
and where the sampler side runs: `VirtualClocks` (reproducible mode) and the real-clock learner
side `RealClock` (`ThreadedClock` in threaded mode, a multi-process lead's `LeadClock`).

All record spans into a `Timeline` (sampler: prefill/decode/wait_*, learner: train_step/
wait_batch/hooks, channel: push). The local sampler sides check every sampler step for samples
lost in flight (in the engine, or between the engine and the queue: `delivery_limit`) and, under
policy `drop`, abort groups that became too stale (`RolloutWorker`).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import queue as queue_lib
import threading
import time
from typing import Callable, Sequence

from absl import logging
import jax

from rlax_pipe import costs as costs_lib
from rlax_pipe import envs
from rlax_pipe import timeline as timeline_lib
from rlax_pipe.pipeline import rules
from rlax_pipe.pipeline.config import PipelineConfig
from rlax_pipe.pipeline.rollout_queue import QueueClosed, rollout_from_dict, rollout_to_dict
from rlax_pipe.pipeline.rollout_worker import RolloutWorker
from rlax_pipe.pipeline.trainer import StepResult, Trainer

# jax.monitoring events whose durations are XLA compile work (tracing, lowering, compiling).
COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/jaxpr_trace_duration")


class CompileCounter:
  """Counts compile events of this process (any thread) and their seconds while active, and
  hands each one's interval [end - duration, end] (perf_counter seconds) to `on_compile`.

  Example:
    with CompileCounter() as compiles:
      ...                      # compiles.count, compiles.seconds
  """

  def __init__(self, on_compile: Callable[[float, float], None] | None = None):
    self.count, self.seconds = 0, 0.0
    self._on_compile = on_compile

  def _listener(self, event: str, duration: float, **kwargs) -> None:
    del kwargs
    if event in COMPILE_EVENTS:
      self.count += 1
      self.seconds += duration
      if self._on_compile is not None:
        end = time.perf_counter()
        self._on_compile(end - duration, end)

  def __enter__(self) -> CompileCounter:
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listener)

# Limit of the first waits of a run whose wait_timeout_s is None (they include XLA compiles).
STARTUP_WAIT_S = 900.0


@dataclasses.dataclass
class VirtualState:
  """Mutable state of `VirtualClocks` (checkpointed with the run for exact resumes).

  Attributes:
    t_s: sampler mesh clock (virtual seconds).
    t_l: learner mesh clock (virtual seconds).
    transit: min-heap of (finish time, sequence number, Rollout) finished on the sampler but not
      yet visible to the learner.
    next_seq: next sequence number for `transit` ties.
    pending_arrival: arrival time of the version waiting in the weight channel, or None.
    learner_must_act: the sampler is stuck at t_s == t_l; the learner moves next.
    installs: weight swaps applied since the last engine step (charged to it).
  """

  t_s: float = 0.0
  t_l: float = 0.0
  transit: list = dataclasses.field(default_factory=list)
  next_seq: int = 0
  pending_arrival: float | None = None
  learner_must_act: bool = False
  installs: int = 0

  def state_dict(self) -> dict:
    """JSON-able copy (rollouts in transit included)."""
    state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return {**state, "transit": [[t, n, rollout_to_dict(r)] for t, n, r in self.transit]}

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict` (one saved before `installs` existed restores 0)."""
    state = {"installs": 0, **state}
    for f in dataclasses.fields(self):
      setattr(self, f.name, state[f.name])
    self.transit = [(t, n, rollout_from_dict(r)) for t, n, r in state["transit"]]


class DeadlockError(RuntimeError):
  """Neither side can make progress (a configuration that can never fill a batch)."""


def _deadlock_message(worker: RolloutWorker, trainer: Trainer) -> str:
  q, e = trainer.queue.stats(), worker.engine
  return (f"no progress possible: the learner (version {trainer.version}) waits for "
          f"{trainer.cfg.groups_per_step} ready groups but the queue has {q.ready_groups} ready, "
          f"{q.partial_groups} partial, {q.in_flight_groups} in flight; the sampler (version "
          f"{e.version}) has no running or waiting request and may not start another (driver "
          f"{trainer.cfg.driver!r}, staleness {trainer.cfg.staleness}). Check that max_lag, "
          "groups_per_step and the sampler's slots allow a full batch.")


def engine_features(before, after, installs: int) -> costs_lib.EngineStep:
  """The cost-model features of one engine step from the engine's counters before and after
  it (`SamplerStats`; its generated tokens are the slot steps)."""
  counts = {name: getattr(after, name) - getattr(before, name) for name in
            ("prefill_calls", "prefill_tokens", "dispatches", "decode_steps", "live_token_steps")}
  return costs_lib.EngineStep(installs=installs, **counts,
                              slot_steps=after.generated_tokens - before.generated_tokens)


def tool_counts(engine) -> tuple[int, int]:
  """(tool waves, tool calls) an episode engine has run so far (`EpisodeEngine.episode_metrics`);
  (0, 0) for a single-turn engine. The reproducible driver charges their difference over an
  engine step to the sampler's virtual clock (`CostModel.tools`)."""
  if not isinstance(engine, envs.EpisodeEngine):
    return 0, 0
  m = engine.episode_metrics()
  return m["env_tool_waves"], m["env_tool_calls"]


class VirtualClocks:
  """The reproducible mode of `drive`: one thread; a conservative discrete-event interleaving of
  engine steps and learner steps on two virtual clocks (one per mesh) whose durations come from
  the cost model (`rlax_pipe.costs.CostModel`: measured on the machine, analytic, or the
  labelled hand-set default). The actor with the smaller clock moves next; samples finished at
  sampler time t become visible to the learner at learner time >= t; a push made at the end of a
  learner step becomes visible to the sampler at its first step boundary after the push's
  arrival time (a round-based sampler receives, when a round starts, the newest version that has
  arrived; a version superseded while a round runs is skipped). Same seed, same run. Every rule
  it applies is a pure function of `rules.py` / `staleness.py`, shared with the simulator.

  Reads from the job: `worker`, `trainer`, `channel`, `cfg.pipeline`, `timeline`, `vstate`
  (`VirtualState`, updated in place) and `sampler_clock` (None, or kept equal to the sampler's
  virtual time: the engine's clock, so rollout timings are in virtual seconds).

  Args:
    cost: the cost model (default `PipelineConfig.resolved_cost_model()`).

  Raises (from `next_batch`):
    DeadlockError: when neither side can move.
  """

  def __init__(self, cost: costs_lib.CostModel | None = None):
    self._cost = cost
    # Virtual intervals between learner batches, for the delivery limit only (a run that loses
    # nothing never reads it, so a resume that starts it empty stays exact).
    self._intervals: collections.deque[float] = collections.deque(maxlen=20)
    self._last_batch: float | None = None

  def idle_time(self, job) -> float:
    """The run time of a session without a step: the resumed offset (virtual seconds)."""
    return job.clock.offset

  def start(self, job) -> None:
    self._cost = self._cost or job.cfg.pipeline.resolved_cost_model()

  def _deliver(self, job, now: float) -> None:
    st, cfg = job.vstate, job.cfg.pipeline
    if rules.weights_deliverable(st.pending_arrival, now, job.worker.may_update_weights()):
      job.worker.engine.update_weights(
          job.channel.take(timeout=cfg.wait_timeout_s or STARTUP_WAIT_S))
      st.pending_arrival = None
      st.installs += 1

  def _sampler_moves(self, job) -> None:
    """One event of the sampler side at its clock: an engine step, or a wait."""
    st, worker, timeline = job.vstate, job.worker, job.timeline
    engine, sampler_clock = worker.engine, job.sampler_clock
    if sampler_clock is not None:
      sampler_clock.set(st.t_s)
    self._deliver(job, st.t_s)
    worker.check_lost(st.t_s, delivery_limit(job.cfg.pipeline, self._intervals))
    worker.abort_too_stale()
    worker.top_up()
    if engine.has_work:
      before, tools_before = engine.stats(), tool_counts(engine)
      finished = worker.step(st.t_s)
      feats = engine_features(before, engine.stats(), st.installs)
      prefill_s, rest_s = self._cost.engine_step(feats)
      st.installs = 0
      if prefill_s > 0:
        timeline.record("sampler", "prefill", st.t_s, st.t_s + prefill_s)
      st.t_s += prefill_s
      if sampler_clock is not None:
        sampler_clock.set(st.t_s)
      if feats.decode_steps:  # a dispatch of K decode steps (slots: mean over its steps)
        timeline.record("sampler", "decode", st.t_s, st.t_s + rest_s,
                        slots_active=round(feats.slot_steps / feats.decode_steps),
                        slots_total=engine.num_slots)
      st.t_s += rest_s
      # episodes (`rlax_pipe.envs`): the step's tool waves, during which the sampler waits
      (waves, calls), (waves0, calls0) = tool_counts(engine), tools_before
      tool_s = self._cost.tools(waves - waves0, calls - calls0)
      if tool_s > 0:
        timeline.record("env", "tool", st.t_s, st.t_s + tool_s)
        st.t_s += tool_s
      for r in finished:
        heapq.heappush(st.transit, (st.t_s, st.next_seq, r))
        st.next_seq += 1
    else:
      targets = [t for t in (st.pending_arrival, st.t_l) if t is not None and t > st.t_s]
      if targets:
        kind = timeline_lib.WAIT_WEIGHTS if st.pending_arrival in targets else (
            timeline_lib.WAIT_ADMISSION)
        timeline.record("sampler", kind, st.t_s, min(targets))
        st.t_s = min(targets)
      else:
        st.learner_must_act = True

  def next_batch(self, job) -> list:
    """Moves whichever side is behind until the learner has a batch at its clock."""
    st, trainer, cfg = job.vstate, job.trainer, job.cfg.pipeline
    while True:
      if rules.sampler_moves_next(st.t_s, st.t_l, st.learner_must_act):
        self._sampler_moves(job)
        continue
      filtered = trainer.queue.filtered_groups()
      while st.transit and st.transit[0][0] <= st.t_l:
        trainer.queue.put(heapq.heappop(st.transit)[2])
      self._deliver(job, st.t_s)
      groups = trainer.queue.try_get_batch(cfg.groups_per_step, trainer.version)
      if groups is not None:
        st.learner_must_act = False
        if self._last_batch is not None:
          self._intervals.append(st.t_l - self._last_batch)
        self._last_batch = st.t_l
        return groups
      # t_l == t_s, every finished sample is queued, the sampler is stuck (and no group the
      # filter dropped released an admission) ...
      if rules.deadlocked(st.learner_must_act, filtered, trainer.queue.filtered_groups()):
        # ... unless a sample handed back by the engine never reached the queue: time moves on
        # to when the sampler names it lost (and re-dispatches it or gives up its group).
        due = job.worker.next_delivery_deadline(delivery_limit(cfg, self._intervals))
        if due is None:
          raise DeadlockError(_deadlock_message(job.worker, trainer))
        if due > st.t_s:
          job.timeline.record("sampler", timeline_lib.WAIT_ADMISSION, st.t_s, due)
          st.t_s = due
        st.learner_must_act = False
        continue
      st.learner_must_act = False  # (a filtered group released an admission: sampler moves)
      job.timeline.record("learner", timeline_lib.WAIT_BATCH, st.t_l, st.t_s)
      st.t_l = st.t_s  # nothing to train before the sampler's clock: wait for it

  def train(self, job, groups) -> tuple[StepResult, float]:
    """The learner step and its push, timed by the cost model; returns (result, the virtual
    time the push completed: when the new version may reach the sampler)."""
    st = job.vstate
    result = job.trainer.train_on(groups)
    dt = self._cost.train(result.processed_rows * job.cfg.pipeline.seq_len,
                          result.micro_batches)
    push = self._cost.push(result.push_bytes)
    job.timeline.record("learner", "train_step", st.t_l, st.t_l + dt)
    job.timeline.record("channel", "push", st.t_l + dt, st.t_l + dt + push)
    st.t_l += dt + push
    st.pending_arrival = st.t_l
    return result, st.t_l

  def after_hooks(self, job, result: StepResult, now: float) -> None:
    del job, result, now  # hooks take no virtual time

  def stop(self, job) -> float:
    """The virtual time at which the last learner step and its push completed."""
    return job.vstate.t_l


def wait_timeout(cfg: PipelineConfig, intervals) -> float:
  """The limit of the learner's next wait for a batch: `cfg.wait_timeout_s` when set, else
  `wait_timeout_factor` x the longest recent interval between batches (seconds), at least
  `wait_timeout_floor_s`; `STARTUP_WAIT_S` before any interval was measured."""
  if cfg.wait_timeout_s is not None:
    return cfg.wait_timeout_s
  if not intervals:
    return STARTUP_WAIT_S
  return max(cfg.wait_timeout_floor_s, cfg.wait_timeout_factor * max(intervals))


def delivery_limit(cfg: PipelineConfig, intervals) -> float:
  """Seconds a sample handed back by the engine may take to reach the queue (grading included)
  before the worker names it lost (`RolloutWorker.check_lost`): half of `wait_timeout`, so that
  under every staleness policy a lost sample is named within the learner's wait limit and a
  re-dispatched one has the other half to be sampled again before a learner waiting for its
  group (learner-wait, block) gives up."""
  return 0.5 * wait_timeout(cfg, intervals)


class RealClock:
  """The learner side of the real-clock modes of `drive`: waits for a batch with a limit, trains,
  records spans (learner: wait_batch / train_step / hooks) and, with the job's `CostRecorder`,
  the timed learner operations (train_step, push, learner_host) for `costs.fit_cost_model`,
  an operation during which XLA compiled anything (any thread) flagged and left out of the fit
  (`CompileCounter`). The sampler side runs elsewhere (module docstring).

  Reads from the job: `trainer`, `cfg.pipeline`, `timeline` (its clock is `time.perf_counter`)
  and `cost_recorder`.
  """

  def __init__(self):
    self._intervals: collections.deque[float] = collections.deque(maxlen=20)
    self._t_batch: float | None = None  # when the learner got its last batch

  def idle_time(self, job) -> float:
    del job
    return time.perf_counter()

  def start(self, job) -> None:
    recorder = job.cost_recorder
    self._compiles = CompileCounter(
        recorder.add_compile if recorder is not None else None).__enter__()

  def wait_limit(self, job) -> float | None:
    """Seconds the learner waits for its next batch (`wait_timeout`)."""
    return wait_timeout(job.cfg.pipeline, self._intervals)

  def raise_failure(self, job) -> None:
    """Raises the error of a failed side if there is one (a failed side also closes the queue):
    called when the queue was closed while the learner waited (else the `QueueClosed`
    propagates) and after every step's hooks."""
    del job

  def next_batch(self, job) -> list:
    """The next batch (`RolloutQueue.get_batch` at the trainer's version, within `wait_limit`).

    Raises:
      QueueTimeout: no batch within the limit; QueueClosed (or the error of the side that
        closed the queue).
    """
    t0 = job.timeline.now()
    try:
      groups = job.trainer.queue.get_batch(job.cfg.pipeline.groups_per_step, job.trainer.version,
                                           timeout=self.wait_limit(job))
    except QueueClosed:
      self.raise_failure(job)
      raise
    t1 = job.timeline.now()
    if self._t_batch is not None:
      self._intervals.append(t1 - self._t_batch)
    self._t_batch = t1
    job.timeline.record("learner", timeline_lib.WAIT_BATCH, t0, t1)
    return groups

  def step(self, job, groups) -> StepResult:
    """The learner step on `groups` (`Trainer.train_on`)."""
    return job.trainer.train_on(groups)

  def train(self, job, groups) -> tuple[StepResult, float]:
    result = self.step(job, groups)
    t2 = job.timeline.now()
    job.timeline.record("learner", "train_step", self._t_batch, t2)
    return result, t2

  def after_hooks(self, job, result: StepResult, now: float) -> None:
    t2, t3 = now, job.timeline.now()
    job.timeline.record("learner", "hooks", t2, t3)
    recorder = job.cost_recorder
    if recorder is not None:  # (the timeline's clock is perf_counter in the real-clock modes)
      recorder.record("train_step", result.train_s, start_s=self._t_batch + result.build_s,
                      tokens=result.processed_rows * job.cfg.pipeline.seq_len,
                      micro_batches=result.micro_batches)
      recorder.record("push", result.push_s, start_s=t2 - result.push_s,
                      bytes=result.push_bytes)
      recorder.record("learner_host", result.build_s + (t3 - t2), start_s=t2)
    self.raise_failure(job)

  def stop(self, job) -> float:
    self._compiles.__exit__()
    return job.timeline.now()


class ThreadedClock(RealClock):
  """The threaded mode of `drive`: the sampler loop in a background thread, grading in a grader
  thread (off the sampler's serial path), the learner loop in the calling thread, on the real
  clock. Every wait has a limit (`wait_timeout`) whose error says what was awaited; an exception
  on any side stops all (Raises). With the job's `CostRecorder`, every sampler-loop iteration
  that runs the engine is recorded too.

  Reads from the job, besides `RealClock`'s: `worker`, `channel`.

  Raises (from `drive`): whatever any side raised (the sampler's or grader's exception with its
  traceback); `QueueTimeout` when no batch arrives within the wait limit.
  """

  def start(self, job) -> None:
    self._stop = threading.Event()
    self._errors: list[BaseException] = []
    self._to_grade: queue_lib.Queue = queue_lib.Queue()  # finished rollouts; None ends grading
    self._limit_s = delivery_limit(job.cfg.pipeline, [])  # updated by the learner loop
    super().start(job)
    self._sampler = threading.Thread(target=self._side, args=(job, self._sampler_loop),
                                     name="rlax_pipe-sampler", daemon=True)
    self._grader = threading.Thread(target=self._side, args=(job, self._grader_loop),
                                    name="rlax_pipe-grader", daemon=True)
    self._sampler.start()
    self._grader.start()

  def _side(self, job, loop: Callable) -> None:
    """Runs one side's `loop(job)` (its own thread); its error is kept for the learner side
    (`raise_failure`) and closes the queue."""
    try:
      loop(job)
    except BaseException as e:  # pylint: disable=broad-except
      self._errors.append(e)
      job.trainer.queue.close()

  def _sampler_loop(self, job) -> None:
    """Weight swaps, lost-sample checks, admissions and engine steps until `stop`."""
    worker, recorder, timeline = job.worker, job.cost_recorder, job.timeline
    engine = worker.engine
    while not self._stop.is_set():
      t0 = time.perf_counter()
      update = job.channel.try_take() if worker.may_update_weights() else None
      if update is not None:
        engine.update_weights(update)
      worker.check_lost(time.monotonic(), self._limit_s)
      worker.abort_too_stale()
      worker.top_up()
      if engine.has_work:
        before = engine.stats()
        finished = worker.engine_step(time.monotonic())
        if finished:
          self._to_grade.put(list(finished))
        if recorder is not None:
          f = engine_features(before, engine.stats(), installs=int(update is not None))
          recorder.record("engine_step", time.perf_counter() - t0, start_s=t0,
                          **dataclasses.asdict(f))
      else:
        t_wait = timeline.now()
        time.sleep(0.002)
        timeline.record("sampler", timeline_lib.WAIT_ADMISSION, t_wait, timeline.now())

  def _grader_loop(self, job) -> None:
    """Grades finished rollouts off the sampler's serial path (the sampler never waits for
    verifiers) and puts them into the queue, until `stop` sends None."""
    while (batch := self._to_grade.get()) is not None:
      for r in job.worker.grade_batch(batch):
        job.trainer.queue.put(r)

  def raise_failure(self, job) -> None:
    if self._errors:
      raise self._errors[0]

  def next_batch(self, job) -> list:
    groups = super().next_batch(job)
    self._limit_s = delivery_limit(job.cfg.pipeline, self._intervals)
    return groups

  def stop(self, job) -> float:
    self._stop.set()
    limit = job.cfg.pipeline.wait_timeout_s or STARTUP_WAIT_S
    self._sampler.join(timeout=limit)
    if self._sampler.is_alive():
      logging.error("sampler thread did not stop within %.0f s", limit)
    self._to_grade.put(None)
    self._grader.join(timeout=limit)
    return super().stop(job)


def drive(job, clock: VirtualClocks | RealClock, hooks: Sequence) -> float:
  """The learner loop of every mode: runs the job's remaining learner steps
  (`cfg.pipeline.num_steps - job.start_step`), each one batch -> train step (the trainer pushes
  the new version to the job's weight sink) -> `hook.on_step(job, result, run time)` for every
  hook in order.

  Args:
    job: the job (`pipeline.job.Job`; the clock says which of its parts it reads).
    clock: `VirtualClocks()`, `ThreadedClock()` or a lead's `LeadClock`.
    hooks: step hooks (`hooks.StepHook`): logging, evaluation, checkpoints, ...

  Returns:
    The clock's time at the end (virtual seconds, or `time.perf_counter()`); with no step left,
    the clock's `idle_time`.

  Raises:
    Whatever the clock raises (`DeadlockError`, `QueueTimeout`, a sampler side's error) or a
    hook raises; the clock is stopped first (its threads joined).
  """
  todo = job.cfg.pipeline.num_steps - job.start_step
  if todo <= 0:
    return clock.idle_time(job)
  clock.start(job)
  try:
    for _ in range(todo):
      groups = clock.next_batch(job)
      result, now = clock.train(job, groups)
      time_s = job.clock.time_s(now)
      for hook in hooks:
        hook.on_step(job, result, time_s)
      clock.after_hooks(job, result, now)
  except BaseException:
    clock.stop(job)
    raise
  return clock.stop(job)
