"""The learner with LoRA: only the adapters are trained (state, optimizer moments, gradient
accumulator), the base stays bit-identical, version 0 is the base model, checkpoints hold the
adapters and restore onto a learner given the same base."""

import jax
import numpy as np
import pytest

from experiments.lib.learner_bench import synthetic_batch
from rlax_pipe import learner as learner_lib
from rlax_pipe.config import LoraConfig, ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import transformer
from rlax_pipe.objectives import ObjectiveConfig

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64)
LORA = LoraConfig(rank=2, alpha=4.0)
B, L = 4, 32


def _learner(params, checkpoint_dir=None, restore=False, lora=LORA):
  cfg = learner_lib.LearnerConfig(
      mesh_axes=(("fsdp", 2), ("tp", 2)), micro_batch_rows=B, lora=lora,
      compiler_options=(("xla_backend_optimization_level", 0),),
      optimizer=learner_lib.OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
      checkpoint=learner_lib.CheckpointConfig(directory=checkpoint_dir, async_save=False))
  return learner_lib.Learner(TINY, cfg, ObjectiveConfig(name="tis_pg", max_lag=4),
                             SamplingConfig(temperature=0.7), devices=jax.devices()[:4],
                             params=params, restore=restore)


def test_only_adapters_are_trained_and_checkpointed(tmp_path):
  rng = np.random.default_rng(0)
  base = jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(np.float32),
                      transformer.abstract_params(TINY))
  learner = _learner(base, checkpoint_dir=str(tmp_path))
  lora = learner.lora
  adapter_shapes = sorted(a.shape for a in jax.tree.leaves(lora.abstract_params()))
  # Trained params, optimizer moments and the gradient accumulator: adapters only.
  assert sorted(x.shape for x in jax.tree.leaves(learner.params)) == adapter_shapes
  moments = [x.shape for x in jax.tree.leaves(learner.state.opt_state) if x.ndim > 0]
  assert sorted(moments) == sorted(adapter_shapes * 2)  # Adam mu and nu
  # Version 0 is the base: the merged params equal it exactly (B = 0).
  for got, want in zip(jax.tree.leaves(learner.merged_params()), jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(got), want)
  batch = synthetic_batch(rng, B, L, TINY.vocab_size, max_lag=0)
  for _ in range(2):
    learner.train_step(batch)
  metrics = learner.flush()
  assert int(metrics["version"]) == 2 and bool(metrics["is_finite"])
  grads = learner._accum[0].grads  # pylint: disable=protected-access
  assert sorted(g.shape for g in jax.tree.leaves(grads)) == adapter_shapes
  for got, want in zip(jax.tree.leaves(learner.base_params), jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(got), want)  # frozen, bit for bit
  adapters = jax.device_get(learner.params)
  assert all(np.any(ad["lora_b"]) for ad in adapters.values())  # B moved off zero
  merged = jax.device_get(learner.merged_params())
  np.testing.assert_allclose(merged["layers"]["wq"],
                             jax.device_get(jax.jit(lora.merge)(base, adapters))["layers"]["wq"],
                             atol=1e-6)
  assert np.max(np.abs(merged["layers"]["wq"] - base["layers"]["wq"])) > 1e-4
  np.testing.assert_array_equal(merged["embed"], base["embed"])  # not a target
  # Checkpoints hold the adapters (and their optimizer state), never a base-sized array.
  learner.save()
  learner.close()
  restored = _learner(base, checkpoint_dir=str(tmp_path), restore=True)
  assert restored.version == 2
  for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(adapters)):
    np.testing.assert_array_equal(np.asarray(got), want)
  # (the restore target is the adapters-only state, and a restore checks that the saved tree has
  # exactly the target's leaves: CheckpointMismatchError on any extra, e.g. base, leaf)
  manager = restored.checkpointer._manager  # pylint: disable=protected-access
  saved = manager.item_metadata(2)["state"]
  shapes = sorted(tuple(x.shape) for x in jax.tree.leaves(saved) if len(x.shape) > 1)
  assert shapes == sorted(adapter_shapes * 3)  # params, Adam mu, Adam nu (+ scalars, rng)
  restored.close()
  other = jax.tree.map(lambda a: a + np.float32(1e-3), base)
  with pytest.raises(learner_lib.CheckpointMismatchError, match="another base"):
    _learner(other, checkpoint_dir=str(tmp_path), restore=True)


def test_lora_with_kl_reference_is_the_frozen_base():
  """LoRA + KL: the default reference is the initial policy, i.e. the frozen base (B = 0), held
  on the full params' learner shardings; at version 0 the policy equals it, so the k3 estimate
  (r - 1 - log r >= 0, zero iff r = 1) is 0 up to rounding, and it grows once B moves."""
  rng = np.random.default_rng(1)
  base = jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(np.float32),
                      transformer.abstract_params(TINY))
  cfg = learner_lib.LearnerConfig(
      mesh_axes=(("fsdp", 2), ("tp", 2)), micro_batch_rows=B, lora=LORA,
      compiler_options=(("xla_backend_optimization_level", 0),),
      optimizer=learner_lib.OptimizerConfig(learning_rate=3e-2, warmup_steps=0))
  learner = learner_lib.Learner(
      TINY, cfg, ObjectiveConfig(name="tis_pg", max_lag=4, kl="loss", kl_estimator="k3"),
      SamplingConfig(temperature=0.7), devices=jax.devices()[:4], params=base)
  ref = jax.device_get(learner.reference_params)
  assert jax.tree.structure(ref) == jax.tree.structure(base)
  for got, want in zip(jax.tree.leaves(ref), jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(got), want)  # float32 model: no cast
  batch = synthetic_batch(rng, B, L, TINY.vocab_size, max_lag=0)
  learner.train_step(batch)
  first = learner.flush()
  assert abs(float(first["kl_ref"])) < 1e-6
  for _ in range(3):
    learner.train_step(batch)
  assert float(learner.flush()["kl_ref"]) > 1e-6
  learner.close()
