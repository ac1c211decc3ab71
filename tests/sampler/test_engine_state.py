"""Engine state: state_dict / load_state_dict resumes exactly; weight-update ownership."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import as_model
from rlax_pipe.run_dir import join_arrays, split_arrays
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine
from rlax_pipe.types import WeightUpdate

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=64, max_seq_len=48)
CFG = SamplerConfig(num_slots=3, page_size=4, num_pages=14, max_seq_len=48, max_new_tokens=30,
                    min_prefill_bucket=8, eos_id=None, sampling=SamplingConfig(), seed=3)


def _params(seed):
  return jax.device_put(as_model(MODEL).init_params(jax.random.key(seed)), jax.devices()[0])


def _mesh(replicas):
  return jax.sharding.Mesh(np.asarray(jax.devices()[:replicas]).reshape(replicas, 1),
                           ("data", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _placed(seed, mesh):
  return jax.device_put(as_model(MODEL).init_params(jax.random.key(seed)),
                        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


@pytest.mark.parametrize("with_pending,replicas", [(False, 1), (True, 1), (True, 2)])
def test_restored_engine_continues_identically(with_pending, replicas):
  """With 2 data replicas a dispatch is still in flight at save time (read back first, its
  finished rollouts buffered in the state and returned by the next step)."""
  mesh = _mesh(replicas)
  a = SamplerEngine(MODEL, CFG, _placed(0, mesh), mesh=mesh)
  for i in range(5):  # more requests than slots, and a small pool: waiting + preemptions
    a.submit(Request(prompt_tokens=np.arange(1, 4 + i, dtype=np.int32), sample_id=i,
                     group_id=i))
  early = []
  for _ in range(3):
    early += a.step()
  if with_pending:  # an update arriving while another thread's step runs stays pending
    with a._step_lock:  # pylint: disable=protected-access
      a.update_weights(WeightUpdate(1, _placed(1, mesh)))
    assert a.version == 0 and a.latest_version == 1
  else:
    a.update_weights(WeightUpdate(1, _placed(1, mesh)))
    assert a.version == 1
  # Through the JSON + npz form the job writes.
  meta, arrays = split_arrays(a.state_dict())
  state = join_arrays(json.loads(json.dumps(meta)), dict(arrays))
  b = SamplerEngine(MODEL, CFG, _placed(0, mesh), mesh=mesh)
  b.load_state_dict(state)
  assert (b.version, b.latest_version) == (a.version, a.latest_version)
  ra = a.run_to_completion()
  rb = b.run_to_completion()
  assert len(ra) == len(rb) == 5 - len(early) > 0
  for x, y in zip(ra, rb):
    assert x.sample_id == y.sample_id
    np.testing.assert_array_equal(x.completion_tokens, y.completion_tokens)
    np.testing.assert_array_equal(x.behavior_logprobs, y.behavior_logprobs)
    np.testing.assert_array_equal(x.policy_versions, y.policy_versions)
    assert x.num_preemptions == y.num_preemptions
  # Everything but the measured wall-clock times continues identically.
  clean = lambda s: dataclasses.replace(s, host_s=0.0, device_call_s=0.0)
  assert clean(a.stats()) == clean(b.stats()) and a.stats().weight_updates == 1


def test_load_state_dict_rejects_another_pool():
  a = SamplerEngine(MODEL, CFG, _params(0))
  small = SamplerEngine(MODEL, SamplerConfig(num_slots=3, page_size=4, num_pages=12,
                                             max_seq_len=48, min_prefill_bucket=8), _params(0))
  with pytest.raises(ValueError, match="does not fit"):
    small.load_state_dict(a.state_dict())


def test_engine_owns_donated_updates_only():
  p0, p1, p2, p3 = (_params(i) for i in range(4))
  engine = SamplerEngine(MODEL, CFG, WeightUpdate(0, p0, donated=True))
  engine.update_weights(WeightUpdate(1, p1))  # not donated: the sender keeps p1
  assert all(x.is_deleted() for x in jax.tree.leaves(p0))      # replaced donated version freed
  engine.update_weights(WeightUpdate(2, p2, donated=True))
  assert not any(x.is_deleted() for x in jax.tree.leaves(p1))  # never the sender's arrays
  with engine._step_lock:  # pylint: disable=protected-access  (a step runs on another thread)
    engine.update_weights(WeightUpdate(3, p3, donated=True))
    engine.update_weights(WeightUpdate(4, _params(4), donated=True))  # supersedes pending 3
    assert all(x.is_deleted() for x in jax.tree.leaves(p3))
    assert engine.version == 2 and engine.latest_version == 4
  engine.submit(Request(prompt_tokens=np.arange(1, 5, dtype=np.int32), sample_id=0))
  (rollout,) = engine.run_to_completion()
  assert set(rollout.policy_versions.tolist()) == {4}
  assert all(x.is_deleted() for x in jax.tree.leaves(p2))
