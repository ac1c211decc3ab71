"""Issue #14 item 9, lost and duplicated samples, with a scripted engine (no model): a sample
that never comes back is named and re-dispatched or its group discarded and counted; groups
too stale in flight are aborted under `drop`; the wait limit scales to measured intervals."""

import dataclasses

import numpy as np
import pytest

from rlax_pipe import tasks
from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.pipeline import config as pconfig
from rlax_pipe.pipeline import driver, staleness
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


def _worker(engine_kw, policy="block", max_lag=1, lost="redispatch"):
  sampler = SamplerConfig(num_slots=4, page_size=8, num_pages=32, max_seq_len=48,
                          max_new_tokens=32)
  pipe = pconfig.PipelineConfig(
      group_size=2, seq_len=48, lost_sample_policy=lost,
      staleness=staleness.StalenessConfig(policy=policy, max_lag=max_lag, groups_per_step=1))
  queue = RolloutQueue(pipe.staleness, 2)
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
