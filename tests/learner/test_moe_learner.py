"""The learner's MoE router terms: load-balancing and z-loss added with the config coefficients
and reported as metrics (tiny MoE model, one device)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib.learner_bench import synthetic_batch
from rlax_pipe import learner as learner_lib
from rlax_pipe import logprobs
from rlax_pipe.config import ModelConfig
from rlax_pipe.model import transformer
from rlax_pipe.objectives import ObjectiveConfig

MOE = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, n_experts=4, n_experts_per_tok=2, moe_d_ff=16)
L = 32


def _run(cfg, params, batch):
  opt = learner_lib.OptimizerConfig(learning_rate=1e-3, warmup_steps=0)
  learner = learner_lib.Learner(
      cfg, learner_lib.LearnerConfig(mesh_axes=(("fsdp", 1),), optimizer=opt,
                                     micro_batch_rows=4,
                                     compiler_options=(("xla_backend_optimization_level", 0),)),
      ObjectiveConfig(max_lag=4), logprobs.SamplingConfig(), devices=jax.devices()[:1],
      params=params)
  learner.train_step(batch)
  return learner.flush()


def test_router_terms_enter_the_loss_with_their_coefficients():
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(np.float32),
                        transformer.abstract_params(MOE))
  batch = synthetic_batch(np.random.default_rng(1), 4, L, MOE.vocab_size,
                                      version=0, max_lag=2)
  off = _run(MOE, params, batch)
  on = _run(dataclasses.replace(MOE, router_aux_loss_coef=0.5, router_z_loss_coef=0.1),
            params, batch)
  # The metrics are the model's own aux terms on this (single) micro-batch.
  _, moe_out = jax.jit(  # one program, not eager op by op
      lambda p, t, q, s: transformer.hidden_states(p, t, q, MOE, segment_ids_BT=s,
                                                   return_moe=True),
      compiler_options={"xla_backend_optimization_level": 0})(
          params, jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
          jnp.asarray(batch.segment_ids))
  for m in (off, on):
    np.testing.assert_allclose(m["moe_load_balance_loss"], moe_out.load_balance_loss, rtol=1e-5)
    np.testing.assert_allclose(m["moe_z_loss"], moe_out.z_loss, rtol=1e-5)
  assert float(on["moe_z_loss"]) > 0 and float(on["moe_load_balance_loss"]) > 0
  # float64 reference of the objective: loss_on = loss_off + 0.5 L_balance + 0.1 L_z.
  want = (np.float64(off["loss"]) + 0.5 * np.float64(off["moe_load_balance_loss"])
          + 0.1 * np.float64(off["moe_z_loss"]))
  np.testing.assert_allclose(np.float64(on["loss"]), want, rtol=1e-5)
  assert float(on["grad_norm"]) != float(off["grad_norm"])  # the terms reach the gradient
