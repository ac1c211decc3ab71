"""#25 step 4: typed messages between processes (pipeline/multihost/messages), no processes."""

import pickle

import numpy as np
import pytest

from rlax_pipe.pipeline.multihost import messages as m
from rlax_pipe.types import Rollout

# The link layer's own control kinds (rlax_pipe.cluster.links): a message tag must differ, or
# the link consumes the message (a sample abort tagged "abort" was read as a fault report).
LINK_CONTROL_KINDS = {"bye", "hb", "abort", "error", "hello", "welcome"}


def _rollout():
  return Rollout(sample_id=1, group_id=0, prompt_tokens=np.arange(3, dtype=np.int32),
                 completion_tokens=np.arange(2, dtype=np.int32),
                 behavior_logprobs=np.zeros(2, np.float32),
                 policy_versions=np.zeros(2, np.int32), finish_reason="eos")


def test_tags_are_unique_and_distinct_from_link_control():
  kinds = [t.KIND for t in m.MESSAGES]
  assert len(set(kinds)) == len(kinds)
  assert not set(kinds) & LINK_CONTROL_KINDS
  assert set(m.TO_REPLICA) | set(m.TO_LEARNER) | set(m.TO_LEAD) == set(m.MESSAGES)


@pytest.mark.parametrize("msg, expected", [
    (m.Init(rng=None), m.TO_REPLICA), (m.Submit(("request",)), m.TO_REPLICA),
    (m.Abort((3, 4)), m.TO_REPLICA), (m.Stop(), m.TO_REPLICA),
    (m.Train(([],)), m.TO_LEARNER), (m.End(), m.TO_LEARNER),
    (m.Rollouts((_rollout(),), {"version": 2}), m.TO_LEAD),
    (m.Spans((("lane", "decode", 0.0, 1.0, None, None),)), m.TO_LEAD),
    (m.Rows(({"kind": "replica"},)), m.TO_LEAD), (m.Done(), m.TO_LEAD),
    (m.Costs(({"op": "engine_step", "duration_s": 0.1, "start_s": 2.0, "decode_steps": 1},),
             ((1.0, 1.5),)), m.TO_LEAD)])
def test_round_trip_through_pickle(msg, expected):
  kind, payload = pickle.loads(pickle.dumps(m.wire(msg)))  # what the link does
  back = m.received(kind, payload, expected)
  assert type(back) is type(msg) and back.KIND == kind


def test_bad_messages_are_refused_with_a_named_error():
  with pytest.raises(m.ProtocolError, match="not a multihost message"):
    m.wire({"rollouts": []})
  with pytest.raises(m.ProtocolError, match="sample_ids must be a tuple of int"):
    m.wire(m.Abort([3]))
  with pytest.raises(m.ProtocolError, match="CostRecord.to_dict"):
    m.wire(m.Costs(({"duration_s": 0.1},), ()))
  with pytest.raises(m.ProtocolError, match="start_s, end_s"):
    m.wire(m.Costs((), ((1.0,),)))
  with pytest.raises(m.ProtocolError, match="received kind 'train' with a dict payload"):
    m.received("train", {"groups": []}, m.TO_LEARNER)
  with pytest.raises(m.ProtocolError, match="received kind 'stop' with a End payload"):
    m.received("stop", m.End(), m.TO_LEARNER)
  with pytest.raises(m.ProtocolError, match="handles only"):
    m.received(*m.wire(m.Train(())), m.TO_REPLICA)
  # Unpickling skips __post_init__: the receiver checks the fields again.
  bad = pickle.loads(pickle.dumps(m.Rollouts((_rollout(),), {})))
  object.__setattr__(bad, "rollouts", ("not a rollout",))
  with pytest.raises(m.ProtocolError, match="tuple of types.Rollout"):
    m.received("rollouts", bad, m.TO_LEAD)
