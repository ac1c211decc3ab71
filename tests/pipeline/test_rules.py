"""The host rules of `pipeline.rules`: the learner's micro-batch split and the engine's refill
rule (one copy each, in `rlax_pipe.host_rules`, used by the sampler, the learner and the
simulator), and a sample's lag (the token lag: test_staleness.py)."""

import numpy as np
import pytest

from rlax_pipe import host_rules
from rlax_pipe import learner as learner_lib
from rlax_pipe.pipeline import rules
from rlax_pipe.sampler import replica


@pytest.mark.parametrize("micro_batch_rows", [None, 1, 2, 3, 8])
@pytest.mark.parametrize("num_minibatches", [1, 2, 3, 4])
def test_micro_batch_plan_matches_its_closed_form(micro_batch_rows, num_minibatches):
  """Independent reference: minibatch j holds ceil((rows - j) / m) rows (row r goes to minibatch
  r mod m), hence ceil(that / micro_batch_rows) micro-batches of micro_batch_rows rows."""
  for rows in range(0, 20):
    got = rules.micro_batch_plan(rows, micro_batch_rows, num_minibatches)
    if micro_batch_rows is None:
      assert got == (num_minibatches, rows)
      continue
    per_minibatch = [max(0, -(-(rows - j) // num_minibatches)) for j in range(num_minibatches)]
    micro = sum(-(-n // micro_batch_rows) for n in per_minibatch)
    assert got == (micro, micro * micro_batch_rows), rows


def test_shared_rules_have_one_source():
  """The pipeline, the simulator, the engine's replica and the learner call the same functions."""
  assert rules.refill_at is host_rules.refill_at is replica.host_rules.refill_at
  assert rules.micro_batch_plan is host_rules.micro_batch_plan
  assert learner_lib.plan_micro_batches is host_rules.plan_micro_batches
  assert learner_lib.learner.plan_micro_batches is host_rules.plan_micro_batches


@pytest.mark.parametrize("waiting, slots, want", [
    (0, 32, 0), (3, 32, 3), (10, 32, 4), (10, 33, 5), (10, 1, 1), (1, 8, 1), (2, 8, 1)])
def test_refill_at_is_min_of_waiting_and_an_eighth_of_the_slots(waiting, slots, want):
  assert rules.refill_at(waiting, slots) == want


def test_sample_lag_is_its_oldest_tokens_lag():
  assert rules.sample_lag(np.array([4, 3, 5]), 5) == 2
  with pytest.raises(ValueError, match="pass the version the batch will be trained at"):
    rules.sample_lag(np.array([6]), 5)
  with pytest.raises(ValueError, match="without tokens"):
    rules.sample_lag(np.array([], np.int32), 5)
