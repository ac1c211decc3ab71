"""The MoE learner step with experts split over an "expert" mesh axis (8 virtual CPU devices:
expert=2 x fsdp=4): the compiled micro-batch program exchanges tokens by all-to-all, each device
stores its half of the experts, and the model's loss and gradients under the learner's
sharding hook equal those of the unsharded model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import learner as learner_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner.learner import lower_accumulate
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.objectives import ObjectiveConfig
from rlax_pipe import sharding as sharding_lib
from rlax_pipe.model import transformer

MOE = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                  d_ff=48, n_experts=4, n_experts_per_tok=2, moe_d_ff=24)
R, L = 8, 16
EP_AXES = (("expert", 2), ("fsdp", 4))


def _cfg(mesh_axes):
  return learner_lib.LearnerConfig(
      mesh_axes=mesh_axes, micro_batch_rows=R,
      optimizer=learner_lib.OptimizerConfig(warmup_steps=0),
      compiler_options=(("xla_backend_optimization_level", 0),))


def test_compiled_moe_step_sends_tokens_to_experts_by_all_to_all():
  cfg = _cfg(EP_AXES)
  mesh = learner_lib.learner_mesh(jax.devices(), cfg)
  hlo = lower_accumulate(MOE, cfg, ObjectiveConfig(), SamplingConfig(), mesh, L).compile()
  text = hlo.as_text()
  # forward: dispatch (rows + ids) and combine per MoE layer (scanned: one body); backward:
  # the transposes of the row exchanges.
  assert text.count("all-to-all(") >= 4, text.count("all-to-all(")
  shardings = learner_lib.param_shardings(MOE, mesh)
  assert shardings["moe_layers"]["experts_gate"].spec == jax.sharding.PartitionSpec(
      None, "expert", "fsdp", None)
  assert shardings["moe_layers"]["experts_gate"].shard_shape((2, 4, 32, 24)) == (2, 2, 8, 24)


def test_expert_parallel_forward_and_gradient_equal_the_unsharded_model():
  """The model's training path under the learner's sharding hook on the expert x fsdp mesh (the
  MoE layers then run `moe_parallel.expert_parallel_swiglu`) vs no hook at all."""
  mesh = learner_lib.learner_mesh(jax.devices(), _cfg(EP_AXES))
  params = transformer.init_params(MOE, jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, MOE.vocab_size, (R, L)), jnp.int32)
  positions = jnp.tile(jnp.arange(L, dtype=jnp.int32), (R, 1))

  def loss(params, constrain):
    h, moe = transformer.hidden_states(params, tokens, positions, MOE, constrain=constrain,
                                       return_moe=True)
    return jnp.mean(jnp.sin(h)) + moe.load_balance_loss, moe.routes_BTLk

  grad = lambda c: jax.value_and_grad(loss, has_aux=True)(params, c)
  shardings = learner_lib.param_shardings(MOE, mesh)
  jit = functools.partial(jax.jit, compiler_options=dict(_cfg(EP_AXES).compiler_options))
  (v_ep, routes_ep), g_ep = jit(lambda p: jax.value_and_grad(loss, has_aux=True)(
      p, sharding_lib.compute_constraint(mesh)))(jax.device_put(params, shardings))
  (v, routes), g = jit(lambda: grad(None))()
  np.testing.assert_array_equal(np.asarray(routes_ep), np.asarray(routes))
  np.testing.assert_allclose(float(v_ep), float(v), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_ep), jax.tree.leaves(g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
