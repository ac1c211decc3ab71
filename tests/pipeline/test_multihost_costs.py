"""Issue 26 item 3: the multi-process job's timed operations (no processes started).

The replica's engine-step records and compile intervals travel to the lead in `messages.Costs`
on the lead's clock; the lead's recorder flags every record against every process's compiles
(the lead's own train steps, pushes and host work are `driver.RealClock`'s records,
checked by test_multihost_job)."""

import pickle
import types


from rlax_pipe import costs as costs_lib
from rlax_pipe.pipeline.multihost import messages
from rlax_pipe.pipeline.multihost import replica


def _replica_side(offset_s: float) -> messages.Costs:
  rec = costs_lib.CostRecorder()
  rec.record("engine_step", 0.5, start_s=1.0, decode_steps=2, slot_steps=7)
  rec.record("engine_step", 0.25, start_s=3.0, decode_steps=1, slot_steps=4)
  rec.add_compile(3.1, 3.2)  # overlaps the second record only
  fake = types.SimpleNamespace(costs=rec)
  return replica.ReplicaProcess.cost_message(fake, offset_s)


def test_replica_records_reach_the_lead_on_its_clock_and_flagged_by_every_compile():
  msg = _replica_side(offset_s=100.0)
  kind, payload = pickle.loads(pickle.dumps(messages.wire(msg)))  # what the link does
  msg = messages.received(kind, payload, messages.TO_LEAD)
  assert [r["start_s"] for r in msg.records] == [101.0, 103.0]
  assert msg.compiles == ((103.1, 103.2),)
  lead_rec = costs_lib.CostRecorder()
  lead_rec.record("train_step", 2.0, start_s=100.2, tokens=64, micro_batches=1)
  lead_rec.add_compile(50.0, 60.0)  # the lead's own compile: overlaps nothing here
  lead_rec.extend([costs_lib.CostRecord.from_dict(r) for r in msg.records], msg.compiles)
  by_start = {r.start_s: r for r in lead_rec.records()}
  # the learner step [100.2, 102.2] overlaps no compile; the replica's second step does
  assert by_start[100.2].features.get("compiles", 0) == 0
  assert by_start[101.0].features.get("compiles", 0) == 0
  assert by_start[103.0].features["compiles"] == 1
  assert by_start[101.0].features == {"decode_steps": 2, "slot_steps": 7}
  fit = costs_lib.fit_cost_model(lead_rec.records(), source="test")
  assert fit.ops["engine_step"].excluded == 1

