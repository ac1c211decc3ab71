"""The host rules of `pipeline.rules` against the code they stand for: the learner's micro-batch
split, the engine's refill rule, and a sample's lag (the token lag: test_staleness.py)."""

import numpy as np
import pytest

from rlax_pipe.learner import learner as learner_lib
from rlax_pipe.pipeline import rules
from rlax_pipe.sampler import scheduler


@pytest.mark.parametrize("micro_batch_rows", [None, 1, 2, 3, 8])
@pytest.mark.parametrize("num_minibatches", [1, 2, 3, 4])
def test_micro_batch_plan_is_the_learners_split(micro_batch_rows, num_minibatches):
  for rows in range(0, 20):
    got = rules.micro_batch_plan(rows, micro_batch_rows, num_minibatches)
    if micro_batch_rows is None:
      assert got == (num_minibatches, rows)
      continue
    plan = learner_lib.plan_micro_batches(rows, micro_batch_rows, num_minibatches)
    micro = sum(len(m) for m in plan)
    assert got == (micro, micro * micro_batch_rows), rows


def test_refill_at_is_the_engines_rule():
  for waiting in range(0, 12):
    for slots in range(1, 40):
      assert rules.refill_at(waiting, slots) == scheduler.refill_at(waiting, slots)


def test_sample_lag_is_its_oldest_tokens_lag():
  assert rules.sample_lag(np.array([4, 3, 5]), 5) == 2
  with pytest.raises(ValueError, match="pass the version the batch will be trained at"):
    rules.sample_lag(np.array([6]), 5)
  with pytest.raises(ValueError, match="without tokens"):
    rules.sample_lag(np.array([], np.int32), 5)
