"""One rule, two users: the real reproducible driver (tiny model, real engine, queue, learner) and
the simulator, given the same lengths and the same cost model, produce the same schedule: the
same samples in every learner step, the same per-token policy versions, the same virtual step
end times (bit for bit). With dynamic sampling (filter_groups="zero_variance") the simulator
also replays the run's rewards, so it drops the same groups and admits the same replacements;
that case is also the suite's tiny-model run of the filter."""

import dataclasses

import numpy as np
import pytest

from rlax_pipe import costs
from rlax_pipe.pipeline import rollout_queue
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.pipeline.group_filter import GroupFilterConfig
from rlax_pipe.sim import distributions as dist
from rlax_pipe.sim import rewards as rewards_lib
from rlax_pipe.sim import simulator as sim

COSTS = costs.CostModel(
    engine_step_s=1.1e-3, install_s=1e-4, prefill_call_s=4e-4, prefill_token_s=2.3e-5,
    dispatch_s=3e-4, decode_step_s=2.1e-3, slot_step_s=1.7e-4, token_step_s=1.3e-6,
    train_step_s=0.021, train_token_s=1.1e-5, micro_batch_s=1e-3, learner_host_s=7e-4,
    push_s=2e-3, push_byte_s=1e-9, source="test")


class Recorder:
  """Step hook: the trained samples of every step; every sample's lengths: finished ones
  exactly (from every rollout put into the queue, so samples of groups discarded later count
  too), aborted and unfinished ones at their cap (they never finish in the run, so any length
  >= the true one gives the same schedule)."""

  def __init__(self, monkeypatch):
    self.schedule, self.lengths, self.prompts, self.aborted = [], {}, {}, {}
    self.rewards = {}
    put = rollout_queue.RolloutQueue.put

    def recording_put(queue, rollout, *args, **kwargs):
      if rollout.finish_reason == "aborted":
        self.aborted[rollout.sample_id] = rollout
        self.prompts[rollout.group_id] = int(rollout.prompt_tokens.shape[0])
      else:
        self._note([rollout])
      return put(queue, rollout, *args, **kwargs)

    monkeypatch.setattr(rollout_queue.RolloutQueue, "put", recording_put)

  def on_step(self, job, result, time_s):
    del job
    self.schedule.append((time_s, tuple((r.sample_id, r.group_id, tuple(r.policy_versions.tolist()))
                                        for r in result.rollouts)))
    self._note(result.rollouts)

  def _note(self, rollouts):
    for r in rollouts:
      self.rewards[r.sample_id] = r.reward
      self.lengths[r.sample_id] = r.num_completion_tokens
      self.prompts[r.group_id] = int(r.prompt_tokens.shape[0])

  def on_end(self, job, time_s):
    del time_s
    self._note([r for _, _, r in job.vstate.transit])  # finished, not yet in the queue
    cap = job.cfg.sampler.max_new_tokens
    for sid, gid, _, ids in job.worker.state_dict()["outstanding"]:
      self.prompts[gid] = len(ids)
      self.lengths.setdefault(sid, min(cap, job.cfg.sampler.max_seq_len - len(ids)))
    for sid, rollout in self.aborted.items():
      self.lengths.setdefault(sid, min(cap, job.cfg.sampler.max_seq_len -
                                       int(rollout.prompt_tokens.shape[0])))
    self.push_bytes = job.channel.stats().bytes_per_version
    self.micro_batch_rows = job.learner.cfg.micro_batch_rows
    self.num_minibatches = job.learner.cfg.num_minibatches


@pytest.mark.parametrize("driver,policy,max_lag,filter_groups", [
    ("pipeline", "block", 1, "off"), ("pipeline", "learner-wait", 1, "off"),
    ("sync", "block", 1, "off"),
    ("pipeline", "drop", 0, "off"),  # drop at max lag 0: groups in flight are aborted
    ("sync", "block", 1, "zero_variance"),  # replacements re-open the round
    ("pipeline", "block", 1, "zero_variance")])  # drops release admissions
def test_driver_and_simulator_agree(tmp_path, monkeypatch, tiny_init, tiny_config, train_rows,
                                    driver, policy, max_lag, filter_groups):
  cfg = tiny_config(tmp_path, tiny_init, driver=driver, policy=policy, steps=5, max_lag=max_lag)
  group_size = cfg.pipeline.group_size
  cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(
      cfg.pipeline, cost_model=COSTS, checkpoint_every=100, eval_every=100,
      filter_groups=filter_groups,
      **({} if filter_groups == "off" else {"filter_max_dropped_per_step": 4})))
  rec = Recorder(monkeypatch)
  summary = run_lib.run(cfg, hooks=[rec])
  num_groups = max(rec.prompts) + 1
  assert sorted(rec.lengths) == list(range(num_groups * group_size))
  lengths = dist.Replay(tuple(tuple(rec.lengths[g * group_size + i] for i in range(group_size))
                              for g in range(num_groups)))
  prompts = dist.Replay(tuple((rec.prompts[g],) for g in range(num_groups)))
  # Rewards of samples that never finished do not matter (their groups never complete).
  rewards = rewards_lib.RewardReplay(tuple(
      tuple(rec.rewards.get(g * group_size + i, 0.0) for i in range(group_size))
      for g in range(num_groups)))
  s = cfg.sampler
  res = sim.simulate(sim.SimConfig(
      driver=driver, staleness=cfg.pipeline.staleness, group_size=group_size, num_steps=5,
      slots_per_engine=s.num_slots, lengths=lengths, costs=COSTS, prompt_lengths=prompts,
      prefill_rows=s.prefill_rows, seq_len=cfg.pipeline.seq_len,
      micro_batch_rows=rec.micro_batch_rows, num_minibatches=rec.num_minibatches,
      push_bytes=rec.push_bytes, decode_steps_per_dispatch=s.decode_steps_per_dispatch,
      share_prompt_pages=s.share_prompt_pages, record_schedule=True,
      group_filter=cfg.pipeline.group_filter, rewards=rewards))
  assert len(res.schedule) == len(rec.schedule) == 5
  for step, (real, simulated) in enumerate(zip(rec.schedule, res.schedule)):
    assert simulated[1] == real[1], f"step {step + 1}: different samples or versions"
    assert simulated[0] == real[0], f"step {step + 1}: end time {simulated[0]} vs {real[0]}"
  versions = {v for _, samples in rec.schedule for _, _, vs in samples for v in vs}
  if driver == "pipeline":
    assert len(versions) > 1  # a schedule with in-flight weight updates, not a trivial one
  assert res.waste.wasted_tokens == summary["wasted_tokens"]  # drop: the same aborts
  if policy == "drop":
    assert rec.aborted and summary["wasted_tokens"] > 0, "no in-flight abort to compare"
  if filter_groups != "off":
    rows = train_rows(cfg.run_dir)
    assert rows[-1]["filtered_groups"] == res.waste.filtered_groups > 0, "nothing filtered"
    assert rows[-1]["filtered_tokens"] == res.waste.filtered_tokens
    assert rows[-1]["filter_kept_groups"] == res.filter_kept_groups
    assert all(r["samples"] == cfg.pipeline.groups_per_step * group_size for r in rows)
    assert driver != "sync" or all(r["token_lag_max"] == 0 for r in rows)  # sync: lag 0
    assert all(r["signal_group_frac"] == 1.0 for r in rows) or res.filter_kept_groups > 0
