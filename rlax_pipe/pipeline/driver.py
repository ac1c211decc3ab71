"""Schedulers that run the sampler side and the learner side together.

Two modes, same components (`RolloutWorker`, `Trainer`, `WeightChannel`, `RolloutQueue`):

- `run_reproducible`: one thread; a conservative discrete-event interleaving of decode steps and
  learner steps on two virtual clocks (one per mesh) whose durations come from `CostModel`. The
  actor with the smaller clock moves next; samples finished at sampler time t become visible to
  the learner at learner time >= t; a push made at the end of a learner step becomes visible to
  the sampler at its first step boundary after the push's arrival time (a round-based sampler
  installs, when a round starts, the newest version that has arrived; a version superseded while
  a round runs is skipped). Same seed, same run.
- `run_threaded`: the sampler loop runs in its own thread and the learner loop in the calling
  thread, on the real clock. Every wait has a timeout whose error says what was awaited; an
  exception on either side stops both and is re-raised in the caller with its original traceback.

Both record spans into a `Timeline` (sampler: prefill/decode/wait_*, learner: train_step/
wait_batch, channel: push) and call `on_step(result, now)` after every learner step (logging,
evaluation, checkpoints).
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
import time
from typing import Callable

from absl import logging

from rlax_pipe import timeline as timeline_lib
from rlax_pipe.pipeline.config import PipelineConfig
from rlax_pipe.pipeline.rollout_queue import QueueClosed, rollout_from_dict, rollout_to_dict
from rlax_pipe.pipeline.rollout_worker import RolloutWorker
from rlax_pipe.pipeline.trainer import StepResult, Trainer
from rlax_pipe.pipeline.weight_channel import WeightChannel

OnStep = Callable[[StepResult, float], None]


@dataclasses.dataclass
class VirtualState:
  """Mutable state of `run_reproducible` (checkpointed with the run for exact resumes).

  Attributes:
    t_s: sampler mesh clock (virtual seconds).
    t_l: learner mesh clock (virtual seconds).
    transit: min-heap of (finish time, sequence number, Rollout) finished on the sampler but not
      yet visible to the learner.
    next_seq: next sequence number for `transit` ties.
    pending_arrival: arrival time of the version waiting in the weight channel, or None.
    learner_must_act: the sampler is stuck at t_s == t_l; the learner moves next.
  """

  t_s: float = 0.0
  t_l: float = 0.0
  transit: list = dataclasses.field(default_factory=list)
  next_seq: int = 0
  pending_arrival: float | None = None
  learner_must_act: bool = False

  def state_dict(self) -> dict:
    """JSON-able copy (rollouts in transit included)."""
    return {"t_s": self.t_s, "t_l": self.t_l, "next_seq": self.next_seq,
            "pending_arrival": self.pending_arrival, "learner_must_act": self.learner_must_act,
            "transit": [[t, n, rollout_to_dict(r)] for t, n, r in self.transit]}

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict`."""
    self.t_s, self.t_l = float(state["t_s"]), float(state["t_l"])
    self.next_seq, self.pending_arrival = int(state["next_seq"]), state["pending_arrival"]
    self.learner_must_act = bool(state["learner_must_act"])
    self.transit = [(t, n, rollout_from_dict(r)) for t, n, r in state["transit"]]


class DeadlockError(RuntimeError):
  """Neither side can make progress (a configuration that can never fill a batch)."""


def _deadlock_message(worker: RolloutWorker, trainer: Trainer) -> str:
  q, e = trainer.queue.stats(), worker.engine
  return (f"no progress possible: the learner (version {trainer.learner.version}) waits for "
          f"{trainer.cfg.groups_per_step} ready groups but the queue has {q.ready_groups} ready, "
          f"{q.partial_groups} partial, {q.in_flight_groups} in flight; the sampler (version "
          f"{e.version}) has no running or waiting request and may not start another (driver "
          f"{trainer.cfg.driver!r}, staleness {trainer.cfg.staleness}). Check that max_lag, "
          "groups_per_step and the sampler's slots allow a full batch.")


def run_reproducible(worker: RolloutWorker, trainer: Trainer, channel: WeightChannel,
                     cfg: PipelineConfig, timeline: timeline_lib.Timeline, num_steps: int,
                     on_step: OnStep, start_time: float = 0.0,
                     sampler_clock: timeline_lib.VirtualClock | None = None,
                     state: VirtualState | None = None) -> float:
  """Runs `num_steps` learner steps on virtual clocks (see module docstring).

  Args:
    sampler_clock: if given, kept equal to the sampler's virtual time (the engine's clock, so
      rollout timings are in virtual seconds).
    state: the interleaving state to continue from and to update in place (a resumed run passes
      the checkpointed one); None = a fresh one starting at `start_time`.

  Returns:
    The virtual time (seconds) at which the last learner step and its push completed.

  Raises:
    DeadlockError: when neither side can move.
  """
  cost, engine = cfg.cost_model, worker.engine
  st = state if state is not None else VirtualState(t_s=start_time, t_l=start_time)
  steps_done = 0

  def deliver(now: float):
    if st.pending_arrival is not None and st.pending_arrival <= now and (
        worker.may_install_weights()):
      w = channel.take(timeout=cfg.wait_timeout_s)
      worker.install(w)
      st.pending_arrival = None

  while steps_done < num_steps:
    if st.t_s < st.t_l or (st.t_s == st.t_l and not st.learner_must_act):
      if sampler_clock is not None:
        sampler_clock.set(st.t_s)
      deliver(st.t_s)
      worker.top_up()
      if engine.has_work:
        before = engine.stats()
        finished = worker.step()
        after = engine.stats()
        prefill_s = cost.prefill_per_token_s * (after.prefill_tokens - before.prefill_tokens)
        active = after.generated_tokens - before.generated_tokens
        if prefill_s > 0:
          timeline.record("sampler", "prefill", st.t_s, st.t_s + prefill_s)
        st.t_s += prefill_s
        if sampler_clock is not None:
          sampler_clock.set(st.t_s)
        if active:  # a dispatch of n decode steps: n fixed costs + one per generated token
          steps = max(after.decode_steps - before.decode_steps, 1)
          dt = steps * cost.decode(active / steps)
          timeline.record("sampler", "decode", st.t_s, st.t_s + dt,
                          slots_active=round(active / steps), slots_total=engine.num_slots)
          st.t_s += dt
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
    else:
      while st.transit and st.transit[0][0] <= st.t_l:
        trainer.queue.put(heapq.heappop(st.transit)[2])
      deliver(st.t_s)
      groups = trainer.queue.try_get_batch(cfg.groups_per_step, trainer.learner.version)
      if groups is None:
        if st.learner_must_act:  # t_l == t_s, every finished sample is queued, sampler is stuck
          raise DeadlockError(_deadlock_message(worker, trainer))
        timeline.record("learner", timeline_lib.WAIT_BATCH, st.t_l, st.t_s)
        st.t_l = st.t_s  # nothing to train before the sampler's clock: wait for it
        continue
      st.learner_must_act = False
      result = trainer.train_on(groups)
      dt = cost.train(result.completion_tokens)
      timeline.record("learner", "train_step", st.t_l, st.t_l + dt)
      timeline.record("channel", "push", st.t_l + dt, st.t_l + dt + cost.push_s)
      st.t_l += dt + cost.push_s
      st.pending_arrival = st.t_l
      steps_done += 1
      on_step(result, st.t_l)
  return st.t_l


def run_threaded(worker: RolloutWorker, trainer: Trainer, channel: WeightChannel,
                 cfg: PipelineConfig, timeline: timeline_lib.Timeline, num_steps: int,
                 on_step: OnStep) -> float:
  """Runs `num_steps` learner steps with the sampler loop in a background thread.

  Returns:
    Wall-clock time (seconds, the timeline's clock) at the end.

  Raises:
    Whatever either side raised (the sampler's exception with its traceback); `QueueTimeout`
    when no batch arrives within `cfg.wait_timeout_s`.
  """
  engine = worker.engine
  stop = threading.Event()
  errors: list[BaseException] = []
  clock = timeline.now

  def sampler_loop():
    try:
      while not stop.is_set():
        if worker.may_install_weights():
          w = channel.try_take()
          if w is not None:
            worker.install(w)
        worker.top_up()
        if engine.has_work:
          for r in worker.step():
            trainer.queue.put(r)
        else:
          t0 = clock()
          time.sleep(0.002)
          timeline.record("sampler", timeline_lib.WAIT_ADMISSION, t0, clock())
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
      trainer.queue.close()

  thread = threading.Thread(target=sampler_loop, name="rlax_pipe-sampler", daemon=True)
  thread.start()
  try:
    for _ in range(num_steps):
      t0 = clock()
      try:
        groups = trainer.queue.get_batch(cfg.groups_per_step, trainer.learner.version,
                                         timeout=cfg.wait_timeout_s)
      except QueueClosed:
        if errors:
          raise errors[0]  # pylint: disable=raise-missing-from
        raise
      t1 = clock()
      timeline.record("learner", timeline_lib.WAIT_BATCH, t0, t1)
      result = trainer.train_on(groups)
      t2 = clock()
      timeline.record("learner", "train_step", t1, t2)
      on_step(result, t2)
      if errors:
        raise errors[0]
  finally:
    stop.set()
    thread.join(timeout=cfg.wait_timeout_s)
    if thread.is_alive():
      logging.error("sampler thread did not stop within %.0f s", cfg.wait_timeout_s)
  return clock()
