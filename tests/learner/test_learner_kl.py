"""The Learner with a KL reference (ObjectiveConfig.kl) and with GSPO on the sharded mesh: the
reference is held with the params' shardings in the compute dtype, stays fixed, and the step's
loss equals the whole-batch objective with the reference's log-probs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.lib.learner_bench import synthetic_batch
from rlax_pipe import learner as learner_lib
from rlax_pipe import logprobs
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner import token_loss, train_step
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import hf_io, transformer
from rlax_pipe.objectives import ObjectiveConfig

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64)
SAMPLING = SamplingConfig(temperature=0.7)
FSDP_TP = (("fsdp", 2), ("tp", 2))
B, L = 4, 32


def _cfg(**kwargs):
  return learner_lib.LearnerConfig(
      mesh_axes=FSDP_TP, micro_batch_rows=2,
      compiler_options=(("xla_backend_optimization_level", 0),),
      optimizer=learner_lib.OptimizerConfig(learning_rate=1e-3, warmup_steps=0), **kwargs)


def _params(seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(np.float32),
                      transformer.abstract_params(TINY))


def _reference_loss(params, ref_params, batch, cfg):
  """The step's loss from full logits and the whole-batch objective (no micro-batching)."""
  logp = lambda p: logprobs.next_token_logprobs_from_logits(
      transformer.forward(p, batch.tokens, batch.positions, TINY,
                          segment_ids_BT=batch.segment_ids)[0], batch.tokens, SAMPLING)[0]
  mask = train_step.completion_mask(jnp.asarray(batch.loss_mask), jnp.asarray(batch.segment_ids))
  lag = jnp.zeros(batch.tokens.shape, jnp.int32) - jnp.asarray(batch.policy_versions)
  return token_loss.objective_loss(
      logp(params), jnp.asarray(batch.behavior_logprobs), jnp.asarray(batch.advantages), mask,
      lag, cfg, segment_ids_BT=jnp.asarray(batch.segment_ids),
      ref_logp_BT=None if ref_params is None else logp(ref_params))[0]


@pytest.mark.parametrize("objective", [
    ObjectiveConfig(name="gspo", max_lag=4, aggregation="sequence_mean", clip_eps=3e-4,
                    clip_eps_high=4e-4, kl="loss", kl_estimator="k3", kl_coef=0.5),
    ObjectiveConfig(name="tis_pg", max_lag=4, kl="reward", kl_estimator="k1", kl_coef=0.5)],
    ids=["gspo-kl_loss", "tis_pg-kl_reward"])
def test_step_loss_matches_whole_batch_reference(objective, tmp_path):
  """kl_reference from an HF directory (params differ from the learner's), micro-batches of 2
  rows on fsdp 2 x tp 2: loss == the float32 whole-batch objective with full logits."""
  params, ref = _params(0), _params(1)
  hf_io.save_hf_checkpoint(tmp_path / "ref", ref, TINY)
  objective = dataclasses.replace(objective, kl_reference=str(tmp_path / "ref"))
  learner = learner_lib.Learner(TINY, _cfg(), objective, SAMPLING, devices=jax.devices()[:4],
                                params=params)
  batch = synthetic_batch(np.random.default_rng(2), B, L, TINY.vocab_size)
  learner.train_step(batch)
  m = learner.flush()
  want = _reference_loss(params, ref, batch, objective)
  np.testing.assert_allclose(m["loss"], want, rtol=2e-5)
  without_kl = _reference_loss(params, None, batch, dataclasses.replace(
      objective, kl="off", kl_estimator="k3", kl_coef=0.04, kl_reference=None))
  assert abs(float(want) - float(without_kl)) > 1e-3   # the KL term is not negligible here
  assert float(m["kl_ref"]) > 0.01


def test_reference_defaults_to_initial_params_sharded_in_compute_dtype():
  params = _params(0)
  model = dataclasses.replace(TINY, compute_dtype="bfloat16")
  objective = ObjectiveConfig(name="tis_pg", max_lag=4, kl="loss")
  learner = learner_lib.Learner(model, _cfg(), objective, SAMPLING, devices=jax.devices()[:4],
                                params=params)
  ref = learner.reference_params
  for r, p in zip(jax.tree.leaves(ref), jax.tree.leaves(learner.params)):
    assert r.dtype == jnp.bfloat16 and p.dtype == jnp.float32
    assert r.sharding.is_equivalent_to(p.sharding, r.ndim)
  rng = np.random.default_rng(3)
  first = synthetic_batch(rng, B, L, TINY.vocab_size)
  learner.train_step(first)
  m1 = learner.flush()
  assert abs(float(m1["kl_ref"])) < 1e-5  # step 1: pi_theta = pi_ref (bf16 rounding apart)
  learner.train_step(synthetic_batch(rng, B, L, TINY.vocab_size, version=1))
  assert float(learner.flush()["kl_ref"]) > 0.0
  jax.tree.map(lambda r, p: np.testing.assert_array_equal(
      np.asarray(r, np.float32), np.asarray(jnp.asarray(p, jnp.bfloat16), np.float32)),
      ref, params)
  want = learner_lib.reference_bytes(model, learner.mesh)
  leaves = jax.tree.leaves(ref)
  assert want["reference_bytes"] == sum(x.nbytes for x in leaves)
  assert want["reference_bytes_per_device"] == sum(
      x.addressable_shards[0].data.nbytes for x in leaves)
  with pytest.raises(ValueError, match="kl_reference"):
    learner_lib.Learner(TINY, _cfg(), objective, SAMPLING, devices=jax.devices()[:4],
                        restore=True)
