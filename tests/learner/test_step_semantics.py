"""What one learner batch does: fixed shapes, minibatch updates, empty batches, masked NaNs,
mixed precision and remat (8 virtual CPU devices, tiny model)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.lib.learner_bench import count_compiles, synthetic_batch
from rlax_pipe import learner as learner_lib
from rlax_pipe import logprobs
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner import optimizer, train_state, train_step
from rlax_pipe.model import transformer
from rlax_pipe.objectives import ObjectiveConfig

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64, tie_embeddings=False)
SAMPLING = logprobs.SamplingConfig(temperature=0.7)
FAST = (("xla_backend_optimization_level", 0),)
L = 32


def make(objective, devices=1, params=None, learning_rate=1e-3, **kwargs):
  mesh = (("fsdp", 2), ("tp", 2)) if devices == 4 else (("fsdp", 1), ("tp", 1))
  opt = learner_lib.OptimizerConfig(learning_rate=learning_rate, adam_eps=1e-4, warmup_steps=0)
  cfg = learner_lib.LearnerConfig(**{"mesh_axes": mesh, "optimizer": opt, "micro_batch_rows": 4,
                                     "compiler_options": FAST, **kwargs})
  return learner_lib.Learner(TINY, cfg, objective, SAMPLING, devices=jax.devices()[:devices],
                             params=_params() if params is None else params)


def _params():
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(np.float32),
                      transformer.abstract_params(TINY))


def batch(rows, seed, version=0, max_lag=2):
  return synthetic_batch(np.random.default_rng(seed), rows, L, TINY.vocab_size,
                                     version=version, max_lag=max_lag)


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def test_any_batch_size_reuses_one_compiled_step():
  """10 steps, batch sizes 1x-4x the micro-batch, 2 minibatches: nothing compiles after step 1."""
  learner = make(ObjectiveConfig(max_lag=4), devices=4, num_minibatches=2)
  sizes = [4, 16, 8, 13, 5, 16, 12, 4, 9, 7]
  learner.train_step(batch(sizes[0], 0))
  learner.flush()
  with count_compiles() as compiles:
    for step, rows in enumerate(sizes[1:], start=1):
      learner.train_step(batch(rows, step, version=step))
    last = learner.flush()
  assert len(compiles) == 0, f"{len(compiles)} compiles after step 1"
  assert learner.compile_counts() == {"prox": 1, "accumulate": 1, "apply": 1}
  assert int(last["version"]) == 10 and int(last["updates_applied"]) == 2


def test_one_minibatch_decoupled_ppo_is_its_truncated_is_limit():
  """m = 1: pi_prox = pi_theta, u = 1, and decoupled PPO's update equals tis_pg's with c = c_b."""
  dppo = make(ObjectiveConfig(name="decoupled_ppo", behavior_trunc=1.5, max_lag=4))
  tis = make(ObjectiveConfig(name="tis_pg", truncation=1.5, max_lag=4))
  for step in range(2):
    b = batch(8, step, version=step)
    dppo.train_step(b)
    tis.train_step(b)
    m_dppo, m_tis = dppo.flush(), tis.flush()
    np.testing.assert_allclose(m_dppo["frac_truncated"], m_tis["frac_truncated"])
    np.testing.assert_allclose(m_dppo["learning_rate"], 1e-3, rtol=1e-6)  # constant schedule
    np.testing.assert_allclose(m_dppo["grad_norm"], m_tis["grad_norm"], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               host(dppo.params), host(tis.params))


def _on_policy_batch(learner, rows, seed):
  """A batch whose behaviour log-probs are the learner's own (lag 0, equal weights)."""
  b = batch(rows, seed, version=learner.version, max_lag=0)
  params = jax.device_get(learner.params)
  logits, _ = transformer.forward(params, jnp.asarray(b.tokens), jnp.asarray(b.positions), TINY,
                                  segment_ids_BT=jnp.asarray(b.segment_ids))
  logp = logprobs.token_logprobs(logits[:, :-1], jnp.asarray(b.tokens[:, 1:]), SAMPLING)
  mu = np.concatenate([np.zeros((rows, 1), np.float32), np.asarray(logp)], axis=1)
  return dataclasses.replace(b, behavior_logprobs=np.where(b.loss_mask > 0, mu, 0.0))


def test_four_minibatches_clip_against_the_policy_before_the_first_update():
  """m = 4: later minibatches see updated params, so decoupled PPO's clip acts (u != 1),
  while the proximal policy stays the one before the batch's first update: on a batch the
  learner itself generated (mu = pi_prox exactly), the engine mismatch stays ~0 although the
  behaviour ratio pi_theta / mu moves. One version per batch; lag = version - token version."""
  cfg = ObjectiveConfig(name="decoupled_ppo", clip_eps=0.05)
  results = {}
  for m in (1, 4):
    learner = make(cfg, learning_rate=3e-2, num_minibatches=m)
    b = _on_policy_batch(learner, 16, seed=5)
    learner.train_step(b)
    results[m] = learner.flush()
  one, four = results[1], results[4]
  assert float(one["frac_truncated"]) == 0.0 and int(one["updates_applied"]) == 1
  assert float(four["frac_truncated"]) > 0.0 and int(four["updates_applied"]) == 4
  assert int(one["version"]) == int(four["version"]) == 1
  assert float(four["logp_mismatch_max"]) < 1e-4 < float(four["ratio_max"]) - 1.0
  assert int(four["mismatch_tokens"]) == int(four["valid_tokens"]) > 0

  # Lags are counted per token against the batch's learner version, whatever m.
  learner = make(cfg, learning_rate=3e-2, num_minibatches=4)
  for step in range(3):
    b = batch(12, seed=10 + step, version=learner.version, max_lag=3)
    version_before = learner.version
    learner.train_step(b)
    m = learner.flush()
    assert int(m["version"]) == version_before + 1
    mask = np.asarray(train_step.completion_mask(b.loss_mask, b.segment_ids)) > 0
    lags = version_before - b.policy_versions[mask]
    want = np.bincount(np.minimum(lags, 16), minlength=17)
    np.testing.assert_array_equal(m["lag_hist"], want)


def test_batch_without_loss_tokens_changes_nothing_and_reports_absent_metrics():
  learner = make(ObjectiveConfig(max_lag=4))
  learner.train_step(batch(8, 0))
  learner.flush()
  before = host(learner.state)
  empty = batch(8, 1, version=1)
  empty = dataclasses.replace(empty, loss_mask=np.zeros_like(empty.loss_mask))
  learner.train_step(empty)
  m = learner.flush()
  after = host(learner.state)
  for field in ("params", "opt_state", "version", "rng", "nonfinite_consecutive"):
    jax.tree.map(np.testing.assert_array_equal, getattr(after, field), getattr(before, field))
  assert int(after.step) == int(before.step) + 1  # calls are still counted
  assert int(m["updates_applied"]) == 0 and int(m["tokens"]) == 0 and bool(m["is_finite"])
  for absent in ("loss", "grad_norm", "update_norm", "learning_rate", "ess", "entropy",
                 "kl_k3", "ratio_mean", "frac_truncated", "frac_masked", "logp_mismatch_mean"):
    assert absent not in m, absent
  learner.train_step(batch(8, 2, version=1))  # and the next batch with data trains as usual
  assert int(learner.flush()["version"]) == 2


def test_nan_in_the_padding_embedding_never_reaches_loss_or_gradient():
  """The padding token's embedding row holds NaN; padding is selected out (never 0 * NaN)."""
  b = batch(8, 3)
  pad = 0
  b = dataclasses.replace(b, tokens=np.where(b.segment_ids > 0, np.maximum(b.tokens, 1), pad))
  assert (b.segment_ids == 0).any()
  learners = {}
  for name, row in (("clean", 0.5), ("nan", np.nan)):
    params = _params()
    params["embed"][pad] = row
    learner = make(ObjectiveConfig(max_lag=4), params=params)
    learner.train_step(b)
    learners[name] = (learner, learner.flush())
  (clean, m_clean), (nan, m_nan) = learners["clean"], learners["nan"]
  assert bool(m_nan["is_finite"]) and bool(m_nan["logp_finite"])
  for key in ("loss", "grad_norm", "ess", "entropy"):
    np.testing.assert_array_equal(m_nan[key], m_clean[key])
  p_clean, p_nan = host(clean.params), host(nan.params)
  np.testing.assert_array_equal(p_nan["embed"][1:], p_clean["embed"][1:])
  np.testing.assert_array_equal(p_nan["layers"]["wq"], p_clean["layers"]["wq"])


def _grads(model_cfg, remat="none", seed=4):
  """Gradient of one micro-batch's loss (fp32 master params) through the step's programs."""
  cfg = learner_lib.LearnerConfig(micro_batch_rows=8, remat=remat, logits_chunk_len=8,
                                  compiler_options=FAST)
  tx = optimizer.make_optimizer(cfg.optimizer)
  fns = train_step.make_step_fns(model_cfg, cfg, ObjectiveConfig(max_lag=4), SAMPLING, tx)
  state = train_state.init_state(jax.tree.map(jnp.asarray, _params()), tx, 0)
  b = batch(8, seed)
  mb = {k: jnp.asarray(getattr(b, k)) for k in train_step.BATCH_FIELDS}
  acc, stats = jax.jit(fns.accumulate, compiler_options=dict(FAST))(
      state, train_step.init_accum(state.params), train_step.init_stats(17), mb,
      jnp.zeros((8, L), jnp.float32), jnp.asarray(False))
  assert jax.tree.leaves(acc.grads)[0].dtype == jnp.float32
  return host(jax.tree.map(lambda g: g / acc.counts.tokens, acc.grads))


def test_remat_policies_give_the_same_gradient():
  reference = _grads(TINY)
  for policy in ("full", "dots_saveable"):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 _grads(TINY, policy), reference)


def test_bf16_compute_with_fp32_master_params_stays_close_to_fp32():
  """compute_dtype=bfloat16, param_dtype=float32: master params, gradients and Adam moments
  stay fp32; the gradient is within 3% (relative L2, per tensor) of the fp32 gradient (bf16
  keeps 8 mantissa bits: ~0.4% per rounding, accumulated over the layers and the backward)."""
  mixed = dataclasses.replace(TINY, compute_dtype="bfloat16")
  fp32, bf16 = _grads(TINY), _grads(mixed)
  for path, a in jax.tree_util.tree_flatten_with_path(bf16)[0]:
    b = fp32
    for k in path:
      b = b[k.key]
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert err < 0.03, (jax.tree_util.keystr(path), err)
  learner = learner_lib.Learner(mixed, learner_lib.LearnerConfig(micro_batch_rows=8,
                                                                 compiler_options=FAST),
                                ObjectiveConfig(), SAMPLING, devices=jax.devices()[:1],
                                params=_params())
  learner.train_step(batch(8, 0))
  assert bool(learner.flush()["is_finite"])
  dtypes = {x.dtype for x in jax.tree.leaves((learner.state.params, learner.state.opt_state))
            if jnp.issubdtype(x.dtype, jnp.floating)}
  assert dtypes == {jnp.dtype(jnp.float32)}
  hlo = learner_lib.learner.lower_accumulate(mixed, learner.cfg, learner.objective_cfg,
                                              SAMPLING, learner.mesh, L).as_text()
  assert "bf16" in hlo  # the matmuls run in bfloat16
