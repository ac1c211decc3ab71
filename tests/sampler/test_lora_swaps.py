"""A tiny LoRA RL loop: learner steps push adapters only (bytes counted) through the
`LoraWeightChannel`, the sampler merges them and swaps in flight between decode steps, and every
token's version tag names the merged weights that produced it (its log-prob equals a dense-KV
decode with that version's weights, computed from the learner's own merged params)."""

import dataclasses

import jax
import numpy as np

from experiments.lib.learner_bench import synthetic_batch
from rlax_pipe import learner as learner_lib
from rlax_pipe import sharding as sh_lib
from rlax_pipe.config import LoraConfig
from rlax_pipe.model.lora import adapter_bytes
from rlax_pipe.objectives import ObjectiveConfig
from rlax_pipe.pipeline.lora_channel import LoraWeightChannel
from rlax_pipe.sampler import Request, SamplerEngine
from rlax_pipe.types import WeightUpdate

from test_sampler_engine import (  # pylint: disable=wrong-import-order
    CFG, MODEL, SAMPLING, _keep_reference, params)  # noqa: F401  (pytest fixture)


def test_adapter_pushes_swap_in_flight_with_exact_token_versions(params):
  base = params[0]
  lcfg = learner_lib.LearnerConfig(
      mesh_axes=(("fsdp", 2), ("tp", 1)), micro_batch_rows=2,
      lora=LoraConfig(rank=2, alpha=8.0, target_modules=("wq", "wv", "w_down")),
      compiler_options=(("xla_backend_optimization_level", 0),),
      optimizer=learner_lib.OptimizerConfig(learning_rate=0.1, warmup_steps=0))
  learner = learner_lib.Learner(MODEL, lcfg, ObjectiveConfig(name="tis_pg", max_lag=8), SAMPLING,
                                devices=jax.devices()[:2], params=base)
  smesh = sh_lib.make_mesh(jax.devices()[4:6], {"tp": 2}, sh_lib.SAMPLER_RULES)
  channel = LoraWeightChannel(learner.lora, learner.base_params, smesh)
  by_version = {0: jax.device_get(learner.merged_params())}
  channel.push(WeightUpdate(0, learner.params))
  engine = SamplerEngine(MODEL, dataclasses.replace(CFG, num_pages=40,
                                                    decode_steps_per_dispatch=2),
                         channel.take(timeout=60), mesh=smesh)
  for i in range(3):
    engine.submit(Request(prompt_tokens=np.arange(1, 4 + i, dtype=np.int32), sample_id=i,
                          group_id=i, max_new_tokens=12))
  rng = np.random.default_rng(0)
  rollouts, steps = [], 0
  while engine.has_work:
    rollouts += engine.step()
    steps += 1
    if steps % 2 == 0 and learner.version < 3:  # a learner step and a push mid-generation
      learner.train_step(synthetic_batch(rng, 2, 16, MODEL.vocab_size))
      learner.flush()
      v = learner.version
      by_version[v] = jax.device_get(learner.merged_params())
      channel.push(WeightUpdate(v, learner.params))
      engine.update_weights(channel.take(timeout=60))
  assert engine.stats().weight_updates == 3 and set(by_version) == {0, 1, 2, 3}
  # Only the adapters travelled: bytes per version = A + B of the three targets.
  stats = channel.stats()
  assert stats.pushes == 4 and stats.bytes_per_version == adapter_bytes(learner.params)
  assert stats.bytes_per_version < channel.base_bytes / 4
  mixed = [r for r in rollouts if len(set(r.policy_versions.tolist())) > 1]
  assert mixed, [r.policy_versions for r in rollouts]  # swaps really happened mid-sample
  for r in rollouts:
    assert np.all(np.diff(r.policy_versions) >= 0)
    np.testing.assert_allclose(r.behavior_logprobs, _keep_reference(by_version, r), atol=1e-5,
                               rtol=0)
  channel.close()


def test_debug_verify_sees_the_merged_params(params):
  """`verify` (with `debug`) runs on each taken version's merged full params, not on the
  adapters that travelled; without `debug` it never runs."""
  lcfg = learner_lib.LearnerConfig(
      mesh_axes=(("fsdp", 2), ("tp", 1)), lora=LoraConfig(rank=2, target_modules=("wq",)),
      compiler_options=(("xla_backend_optimization_level", 0),))
  learner = learner_lib.Learner(MODEL, lcfg, ObjectiveConfig(name="tis_pg", max_lag=8), SAMPLING,
                                devices=jax.devices()[:2], params=params[0])
  smesh = sh_lib.make_mesh(jax.devices()[4:6], {"tp": 2}, sh_lib.SAMPLER_RULES)
  seen = []
  verify = lambda merged, version: seen.append((version, jax.device_get(merged)))
  quiet = LoraWeightChannel(learner.lora, learner.base_params, smesh, verify=verify)
  quiet.push(WeightUpdate(0, learner.params))
  quiet.take(timeout=60)
  quiet.close()
  assert not seen
  channel = LoraWeightChannel(learner.lora, learner.base_params, smesh, verify=verify,
                              debug=True)
  channel.push(WeightUpdate(0, learner.params))
  channel.take(timeout=60)
  channel.close()
  (version, merged), = seen
  want = jax.device_get(learner.merged_params())
  assert version == 0 and jax.tree.structure(merged) == jax.tree.structure(want)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), merged, want)
