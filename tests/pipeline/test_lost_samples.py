"""Issue #14 item 9, lost and duplicated samples, with a scripted engine (no model): a sample
that never comes back is named and re-dispatched or its group discarded and counted; groups
too stale in flight are aborted under `drop`; the wait limit scales to measured intervals.
Issue #27 item 2: a sample lost between the engine and the queue is handled the same way under
every staleness policy, by the worker and by the reproducible driver."""

import dataclasses
import json
import logging
import time
import types

import numpy as np
import pytest

from rlax_pipe import tasks
from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.pipeline import config as pconfig
from rlax_pipe import timeline as timeline_lib
from rlax_pipe.pipeline import driver, staleness
from rlax_pipe.pipeline.job import JobClock
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.pipeline.rollout_worker import RolloutWorker
from rlax_pipe.sampler import SamplerConfig
from rlax_pipe.types import Rollout

TOK = tokenizer_lib.default_tokenizer()


class LossyEngine:
  """Every request runs `steps` engine steps, then finishes; sample ids in `lose` vanish once
  (finished inside the engine, their rollout never handed out); versions stamped per step."""

  def __init__(self, cfg, steps=1, lose=(), can_abort=False):
    self.cfg, self.steps, self.lose = cfg, steps, set(lose)
    self.version = self.latest_version = 0
    self.running = {}  # sample id -> [request, tokens so far, versions]
    self.aborted = []
    if can_abort:
      self.abort = self._abort

  @property
  def has_work(self):
    return bool(self.running)

  @property
  def num_active(self):
    return len(self.running)

  @property
  def num_slots(self):
    return self.cfg.num_slots

  num_waiting = 0

  def stats(self):  # the counters the reproducible driver's cost model reads
    return types.SimpleNamespace(decode_steps=self.decode_steps, dispatches=self.decode_steps,
                                 prefill_calls=0, prefill_tokens=0,
                                 generated_tokens=self.decode_steps,
                                 live_token_steps=self.decode_steps)

  decode_steps = 0

  def update_weights(self, version):
    self.version = self.latest_version = version

  def submit(self, request):
    self.running[request.sample_id] = [request, 0, []]

  def unfinished(self):
    return {sid: (v[0] if v else None) for sid, (_, _, v) in self.running.items()}

  def _rollout(self, req, versions, reason):
    n = len(versions)
    return Rollout(sample_id=req.sample_id, group_id=req.group_id,
                   prompt_tokens=req.prompt_tokens, completion_tokens=np.full(n, 5, np.int32),
                   behavior_logprobs=np.zeros(n, np.float32),
                   policy_versions=np.asarray(versions, np.int32), finish_reason=reason,
                   prompt_index=req.prompt_index)

  def step(self):
    self.decode_steps += 1
    out = []
    for sid, entry in list(self.running.items()):
      entry[1] += 1
      entry[2].append(self.version)
      if entry[1] >= self.steps:
        del self.running[sid]
        if sid in self.lose:
          self.lose.discard(sid)
          continue
        out.append(self._rollout(entry[0], entry[2], "length"))
    return out

  def _abort(self, sample_id):
    entry = self.running.pop(sample_id, None)
    self.aborted.append(sample_id)
    return None if entry is None else self._rollout(entry[0], entry[2], "aborted")


def _worker(engine_kw, policy="block", max_lag=1, lost="redispatch", queue_cls=RolloutQueue):
  sampler = SamplerConfig(num_slots=4, page_size=8, num_pages=32, max_seq_len=48,
                          max_new_tokens=32)
  pipe = pconfig.PipelineConfig(
      group_size=2, seq_len=48, lost_sample_policy=lost,
      staleness=staleness.StalenessConfig(
          policy=policy, max_lag=max_lag, groups_per_step=1,
          queue_capacity_groups=8 if policy == "queue-drop" else None))
  queue = queue_cls(pipe.staleness, 2)
  task = tasks.make_task("arithmetic", tasks.ArithmeticConfig(max_terms=3))
  return RolloutWorker(LossyEngine(sampler, **engine_kw), task, TOK, queue, pipe)


def test_lost_sample_is_named_and_redispatched():
  worker = _worker({"lose": {1}})
  try:
    assert worker.top_up() == 2  # groups 0 (samples 0, 1) and 1 (samples 2, 3)
    for r in worker.step():
      worker.queue.put(r)
    assert worker.queue.missing_samples(0) == [1]
    assert worker.check_lost() == [1]  # the engine no longer holds it: lost
    assert 1 in worker.engine.running  # re-dispatched with its id and prompt
    for r in worker.step():
      worker.queue.put(r)
    assert worker.queue.missing_samples(0) is None  # group 0 complete
    assert worker.check_lost() == []
    m = worker.pop_metrics()
    assert (m["samples_lost"], m["samples_redispatched"], m["groups_lost"]) == (1, 1, 0)
    assert worker.queue.stats().ready_groups == 2
  finally:
    worker.close()


def test_lost_sample_discards_its_group_when_configured():
  worker = _worker({"lose": {1}}, lost="discard")
  try:
    worker.top_up()
    for r in worker.step():
      worker.queue.put(r)
    assert worker.check_lost() == [1]
    w = worker.queue.stats().waste
    assert (w.lost_groups, w.lost_samples) == (1, 1)  # sample 0 arrived, counted as lost work
    assert worker.pop_metrics()["groups_lost"] == 1
    assert worker.queue.stats().in_flight_groups == 0  # admission released
  finally:
    worker.close()


@pytest.mark.parametrize("can_abort", [False, True])
def test_drop_aborts_groups_that_became_too_stale_in_flight(can_abort):
  worker = _worker({"steps": 50, "can_abort": can_abort}, policy="drop", max_lag=1)
  try:
    worker.top_up()
    worker.step()  # every sample has a first token of version 0
    assert worker.abort_too_stale() == 0  # learner at version 0: fine
    worker.queue.set_learner_version(2)  # the next batch trains at v2: lag 2 > 1
    n = worker.abort_too_stale()
    assert n == 3  # every group in flight (3 groups of 2 on 4 slots + one waiting group)
    assert worker.queue.stats().waste.stale_groups == n
    assert worker.pop_metrics()["groups_aborted_stale"] == n
    assert worker.abort_too_stale() == 0  # checked once per version
    worker.queue.set_learner_version(3)
    assert worker.abort_too_stale() == 0  # given-up groups are not given up twice
    assert worker.queue.stats().waste.stale_groups == n
    if can_abort:  # the engine stopped them; their partial rollouts were counted
      assert sorted(worker.engine.aborted) == list(range(6)) and not worker.engine.running
      assert worker.queue.stats().waste.stale_samples == 6
    else:  # no per-request abort: they run on and are counted when they finish
      assert not worker.engine.aborted and len(worker.engine.running) == 6
      worker.engine.steps = 2
      for r in worker.step():
        worker.queue.put(r)
      assert worker.queue.stats().waste.stale_samples == 6
    assert worker.check_lost() == []  # given-up samples are not "lost"
  finally:
    worker.close()


def test_wait_limit_scales_to_measured_intervals():
  cfg = pconfig.PipelineConfig()
  assert cfg.wait_timeout_s is None
  assert driver.wait_timeout(cfg, []) == driver.STARTUP_WAIT_S
  assert driver.wait_timeout(cfg, [0.5, 2.0]) == cfg.wait_timeout_floor_s  # 20 x 2 s < 60 s
  assert driver.wait_timeout(cfg, [3.0, 10.0]) == 200.0
  fixed = dataclasses.replace(cfg, wait_timeout_s=5.0)
  assert driver.wait_timeout(fixed, [100.0]) == 5.0
  with pytest.raises(ValueError, match="lost_sample_policy"):
    pconfig.PipelineConfig(lost_sample_policy="retry")


@pytest.mark.parametrize("lost", ["redispatch", "discard"])
@pytest.mark.parametrize("policy", staleness.POLICIES)
def test_sample_lost_between_engine_and_queue_is_named_under_every_policy(policy, lost, caplog):
  worker = _worker({}, policy=policy, lost=lost)
  q = worker.queue
  try:
    started = worker.top_up()
    out = worker.step(now=0.0)
    assert len(out) == 2 * started
    for r in out:
      if r.sample_id != 1:  # sample 1 left the engine and never reached the queue
        q.put(r)
    assert q.missing_samples(0) == [1]
    # what is in transit survives a checkpoint (JSON) and restore
    worker.load_state_dict(json.loads(json.dumps(worker.state_dict())))
    assert worker.check_lost(now=9.9, delivery_limit_s=10.0) == []  # not yet overdue
    assert worker.next_delivery_deadline(10.0) == 10.0
    with caplog.at_level(logging.WARNING):
      assert worker.check_lost(now=10.0, delivery_limit_s=10.0) == [1]
    assert "group 0: samples [1]" in caplog.text and "not in the queue" in caplog.text
    m = worker.pop_metrics()
    if lost == "redispatch":
      assert 1 in worker.engine.running  # same id and prompt, sampled again
      assert (m["samples_lost"], m["samples_redispatched"], m["groups_lost"]) == (1, 1, 0)
      for r in worker.step(now=11.0):
        q.put(r)
      assert q.missing_samples(0) is None and q.stats().ready_groups == started
    else:
      assert (m["samples_lost"], m["samples_redispatched"], m["groups_lost"]) == (1, 0, 1)
      w = q.stats().waste
      assert (w.lost_groups, w.lost_samples) == (1, 1)  # sample 0 arrived: lost work
      assert q.stats().ready_groups == started - 1 and q.stats().partial_groups == 0
    # delivered samples are never named, however late the check
    assert worker.check_lost(now=1e6, delivery_limit_s=10.0) == []
    assert worker.next_delivery_deadline(10.0) is None
    with pytest.raises(ValueError, match="delivery_limit_s"):
      worker.check_lost(now=0.0, delivery_limit_s=0.0)
  finally:
    worker.close()


def test_late_delivery_within_the_limit_and_given_up_groups_are_not_lost():
  worker = _worker({}, policy="drop")
  q = worker.queue
  try:
    worker.top_up()
    out = worker.step(now=0.0)
    late = [r for r in out if r.group_id == 0]
    for r in out:
      if r.group_id != 0:
        q.put(r)
    q.discard_group(1, "stale")  # a complete group given up later is not waited for either
    for r in late:  # group 0 arrives late, but before the limit
      q.put(r)
    assert worker.next_delivery_deadline(5.0) is None
    assert worker.check_lost(now=100.0, delivery_limit_s=5.0) == []
    assert worker.pop_metrics()["samples_lost"] == 0
  finally:
    worker.close()


class _DropsOnce(RolloutQueue):
  """A queue whose transport loses the first copy of sample 1 (a lost message)."""

  lost = False

  def put(self, rollout, learner_version=None):
    if rollout.sample_id == 1 and not self.lost:
      self.lost = True
      return True
    return super().put(rollout, learner_version)


def _job(worker, trainer, channel, cfg, num_steps):
  """The parts of a `Job` that `driver.drive` and its clocks read (no model, no run dir)."""
  return types.SimpleNamespace(
      worker=worker, trainer=trainer, channel=channel,
      cfg=types.SimpleNamespace(pipeline=dataclasses.replace(cfg, num_steps=num_steps)),
      timeline=timeline_lib.Timeline(), vstate=driver.VirtualState(), sampler_clock=None,
      clock=JobClock(reproducible=False, offset=0.0), start_step=0, cost_recorder=None)


class _Trainer:
  """The learner side of `driver.drive` without a model: counts versions and groups."""

  def __init__(self, queue, cfg):
    self.queue, self.cfg = queue, cfg
    self.version = 0  # the trainer owns the version (a host integer)
    self.trained = []

  def train_on(self, groups):
    self.version += 1
    self.trained += [g[0].group_id for g in groups]
    return types.SimpleNamespace(processed_rows=1, micro_batches=1, push_bytes=1,
                                 trained_at=self.version - 1, produced=self.version)


@pytest.mark.parametrize("policy", staleness.POLICIES)
def test_reproducible_run_names_and_redispatches_a_sample_lost_on_its_way(policy):
  """Before issue #27 item 2: under drop / queue-drop the run ended normally with group 0
  never trained nor counted; under block / learner-wait it stopped with a DeadlockError."""
  worker = _worker({"steps": 2}, policy=policy, max_lag=1, queue_cls=_DropsOnce)
  cfg = dataclasses.replace(worker.cfg, wait_timeout_s=0.2)  # delivery limit 0.1 virtual s
  trainer = _Trainer(worker.queue, cfg)
  channel = types.SimpleNamespace(take=lambda timeout: trainer.version)
  try:
    end = driver.drive(_job(worker, trainer, channel, cfg, 6), driver.VirtualClocks(), ())
    m = worker.pop_metrics()
    assert worker.queue.lost and end > 0.1  # (the run outlived the delivery limit)
    assert (m["samples_lost"], m["samples_redispatched"]) == (1, 1)
    q = worker.queue.stats()
    assert q.rejected_samples == 0  # nothing else was taken for lost
    # group 0 was trained or counted as waste: no longer waited for, and every group admitted
    # is trained, counted as waste, ready or in flight
    state = worker.queue.state_dict()  # (in flight = admitted, live and not ready)
    ready = {r["group_id"] for g in state["ready"] for r in g["rollouts"]}
    in_flight = [g for g, _ in state["admission"]["live"] if g not in ready]
    assert worker.queue.missing_samples(0) is None and 0 not in in_flight
    assert q.admitted_groups == (q.trained_groups + q.waste.dropped_groups + q.ready_groups
                                 + q.in_flight_groups)
    if policy in ("block", "learner-wait"):
      assert 0 in trainer.trained
  finally:
    worker.close()


class _SlowTrainer(_Trainer):
  """`_Trainer` whose steps take real time, so a threaded run outlives the delivery limit."""

  def train_on(self, groups):
    time.sleep(0.05)
    return super().train_on(groups)


class _PacedEngine(LossyEngine):
  """`LossyEngine` at a few ms per step, so the grader keeps up under unlimited admission."""

  def step(self):
    time.sleep(0.005)
    return super().step()


@pytest.mark.parametrize("policy", ["drop", "learner-wait"])
def test_threaded_run_names_and_redispatches_a_sample_lost_on_its_way(policy):
  """The threaded driver on the real clock: the sample dropped between the engine and the queue
  (here by the queue's transport, after the grader) is named within half the wait limit and
  sampled again; under learner-wait the learner, waiting for its group, does not time out."""
  worker = _worker({"steps": 2}, policy=policy, max_lag=1, queue_cls=_DropsOnce)
  worker.engine = _PacedEngine(worker.engine.cfg, steps=2)
  probe = worker.engine._rollout(  # pylint: disable=protected-access
      types.SimpleNamespace(sample_id=-1, group_id=-1, prompt_tokens=np.ones(3, np.int32),
                            prompt_index=0), [0], "length")
  worker.grade_batch([probe])  # the verifier processes start before the clock matters
  cfg = dataclasses.replace(worker.cfg, wait_timeout_s=2.0)  # delivery limit 1 s
  trainer = _SlowTrainer(worker.queue, cfg)
  engine = worker.engine
  channel = types.SimpleNamespace(
      try_take=lambda: (trainer.version
                        if trainer.version > engine.latest_version else None))
  try:
    t0 = time.monotonic()
    driver.drive(_job(worker, trainer, channel, cfg, 25), driver.ThreadedClock(), ())
    assert time.monotonic() - t0 > 1.0
    m = worker.pop_metrics()
    assert worker.queue.lost and (m["samples_lost"], m["samples_redispatched"]) == (1, 1)
    assert worker.queue.missing_samples(0) is None
    if policy == "learner-wait":
      assert 0 in trainer.trained
  finally:
    worker.close()


@pytest.mark.parametrize("side", ["engine_step", "grade_batch"])
def test_threaded_clock_re_raises_an_error_of_the_sampler_or_grader_thread(side):
  """A side thread's exception closes the queue, so the learner waiting for a batch stops at once
  (long before its wait limit), and `drive` re-raises that exception."""
  worker = _worker({"steps": 2}, policy="learner-wait")

  def fail(*args):
    raise ValueError(f"{side} failed")

  setattr(worker, side, fail)
  cfg = dataclasses.replace(worker.cfg, wait_timeout_s=60.0)
  trainer = _Trainer(worker.queue, cfg)
  channel = types.SimpleNamespace(try_take=lambda: None)
  try:
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"{side} failed"):
      driver.drive(_job(worker, trainer, channel, cfg, 3), driver.ThreadedClock(), ())
    assert time.monotonic() - t0 < 30.0
  finally:
    worker.close()


class _Hub:
  """Records what the lead sends (no processes)."""

  def __init__(self):
    self.sent = []

  def send(self, process_id, kind, payload):
    self.sent.append((process_id, kind, payload))


def test_multiprocess_lead_redispatches_a_lost_sample_to_the_replica_that_had_it():
  """The learner lead's worker drives `RemoteEngines` (the replicas of other processes): a
  rollout a replica returned that never reached the queue is named and re-sent to that
  replica, and returned samples stop being outstanding (they used to pile up forever)."""
  from rlax_pipe.cluster import Topology  # pylint: disable=import-outside-toplevel
  from rlax_pipe.pipeline.multihost.remote import RemoteEngines  # pylint: disable=import-outside-toplevel
  hub = _Hub()
  sampler = SamplerConfig(num_slots=2, page_size=8, num_pages=32, max_seq_len=48,
                          max_new_tokens=32)
  proxy = RemoteEngines(hub, Topology(0, 3, 1, 4), sampler, {0: 2, 1: 2})
  worker = _worker({}, policy="drop")
  worker.engine = proxy
  try:
    for r in (0, 1):
      proxy.replicas[r].version = 0
      with proxy.target(r):
        worker.top_up()
      proxy.flush(r)
    sent = {(p, req.sample_id) for p, kind, msg in hub.sent if kind == "submit" for req in msg.requests}
    assert sent == {(1, 0), (1, 1), (2, 2), (2, 3)}  # group 0 on replica 0 (process 1), ...
    fake = LossyEngine(sampler)
    back = [fake._rollout(req, [0], "length")  # pylint: disable=protected-access
            for _, kind, msg in hub.sent if kind == "submit" for req in msg.requests]
    proxy.returned(0, back[:2], {"version": 0})
    proxy.returned(1, back[2:], {"version": 0})
    worker.returned(back, now=0.0)
    for r in back:
      if r.sample_id != 1:  # the lead lost sample 1 between the link and the queue
        worker.queue.put(r)
    assert worker.check_lost(now=1.0, delivery_limit_s=5.0) == []
    assert worker.check_lost(now=5.0, delivery_limit_s=5.0) == [1]
    assert proxy.replicas[0].outstanding == {1: 0}  # re-sent to replica 0, where it was
    hub.sent.clear()
    proxy.flush(0)
    assert [(p, [q.sample_id for q in msg.requests]) for p, _, msg in hub.sent] == [(1, [1])]
    assert [e[0] for e in worker.state_dict()["outstanding"]] == [1]  # only the re-sent one
  finally:
    worker.close()
