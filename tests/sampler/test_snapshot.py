"""Engine snapshot/restore: a restored engine continues exactly like the original."""

import dataclasses

import jax
import numpy as np
import pytest

from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import transformer
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine
from rlax_pipe.sampler import snapshot


def _engine(params, cfg, model_cfg, mesh):
  return SamplerEngine(model_cfg, cfg, params, mesh=mesh)


@pytest.mark.parametrize("replicas", [1, 2])
def test_restored_engine_continues_identically(replicas):
  """With 2 data replicas a dispatch is still in flight at snapshot time (read back by
  `settle`, its finished rollouts buffered and returned by the next step)."""
  model_cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                          head_dim=8, d_ff=64, max_seq_len=48)
  cfg = SamplerConfig(num_slots=3, page_size=4, num_pages=14, max_seq_len=48, max_new_tokens=30,
                      min_prefill_bucket=8, eos_id=None, sampling=SamplingConfig(), seed=3)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:replicas]).reshape(replicas, 1),
                           ("data", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  place = lambda p: jax.device_put(p, replicated)
  params = place(transformer.init_params(model_cfg, jax.random.key(0)))
  new_params = place(transformer.init_params(model_cfg, jax.random.key(1)))
  a = _engine(params, cfg, model_cfg, mesh)
  for i in range(5):  # more requests than slots, and a small pool: waiting + preemptions
    a.submit(Request(prompt_tokens=np.arange(1, 4 + i, dtype=np.int32), sample_id=i,
                     group_id=i))
  early = []
  for _ in range(3):
    early += a.step()
  a.update_weights(new_params, 1)  # pending at snapshot time
  state, arrays = snapshot.snapshot(a)
  b = _engine(params, cfg, model_cfg, mesh)
  snapshot.restore(b, state, arrays)
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
  assert clean(a.stats()) == clean(b.stats())
