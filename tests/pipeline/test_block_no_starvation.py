"""`block` admission does not starve long samples; `drop` by staleness does (a length bias).

A small pipeline is simulated with the real `RolloutQueue` and staleness policy code: a sampler
with a fixed number of slots decodes one token per slot per step, every sample's length is drawn
from a heavy-tailed distribution, and a learner step (taking the oldest ready groups) happens
every `period` sampler steps. In-flight weight updates stamp each token with the sampler version
at the step it was produced.
"""

import numpy as np

from rlax_pipe.pipeline import RolloutQueue, StalenessConfig
from rlax_pipe.types import Rollout


def _simulate(policy: str, *, max_lag=1, groups=4, group_size=4, slots=32, period=12,
              steps=6000, seed=0):
  rng = np.random.default_rng(seed)
  cfg = StalenessConfig(policy=policy, max_lag=max_lag, groups_per_step=groups)
  queue = RolloutQueue(cfg, group_size)
  version, next_group, next_sample = 0, 0, 0
  running = []  # [sample_id, group_id, target_len, versions list]
  admitted_lengths, trained_lengths, max_seen_lag = [], [], 0
  for t in range(steps):
    while len(running) + group_size <= slots and queue.try_admit(next_group, version):
      lengths = np.minimum(1 + rng.pareto(1.2, size=group_size) * 6, 400).astype(int)
      for n in lengths:
        running.append([next_sample, next_group, int(n), []])
        next_sample += 1
      admitted_lengths.extend(lengths.tolist())
      next_group += 1
    still = []
    for s in running:
      s[3].append(version)
      if len(s[3]) == s[2]:
        n = len(s[3])
        queue.put(Rollout(sample_id=s[0], group_id=s[1], prompt_tokens=np.ones(3, np.int32),
                          completion_tokens=np.ones(n, np.int32),
                          behavior_logprobs=np.zeros(n, np.float32),
                          policy_versions=np.asarray(s[3], np.int32), finish_reason="length"),
                  learner_version=version)
      else:
        still.append(s)
    running = still
    if t % period == period - 1:
      batch = queue.try_get_batch(groups, version)
      if batch is not None:
        for g in batch:
          for r in g:
            trained_lengths.append(r.num_completion_tokens)
            max_seen_lag = max(max_seen_lag, version - int(r.policy_versions.min()))
        version += 1
  return np.asarray(admitted_lengths), np.asarray(trained_lengths), max_seen_lag, queue


def test_block_trains_the_lengths_it_samples():
  admitted, trained, max_lag_seen, queue = _simulate("block")
  assert max_lag_seen <= 1
  assert queue.stats().waste.wasted_tokens == 0
  assert len(trained) > 1000
  # Long samples are trained as often as they are sampled: same mean and upper quantiles.
  for q in (50, 90, 99):
    assert abs(np.percentile(trained, q) - np.percentile(admitted, q)) <= max(
        2.0, 0.15 * np.percentile(admitted, q)), q
  assert abs(trained.mean() - admitted.mean()) <= 0.1 * admitted.mean()


def test_drop_policy_biases_toward_short_samples():
  admitted, trained, max_lag_seen, queue = _simulate("drop")
  assert max_lag_seen <= 1
  assert queue.stats().waste.wasted_tokens > 0
  assert trained.mean() < 0.8 * admitted.mean()
