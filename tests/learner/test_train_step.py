"""Pure pieces of the learner: logit processing, masks, micro-batch weights, schedule, config."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import learner as learner_lib
from rlax_pipe import logprobs
from rlax_pipe import objectives
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner import optimizer, sharding, train_state, train_step
from rlax_pipe.model import transformer

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64)


def test_shifted_token_logprobs_use_the_shared_logit_processing():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, 6, 11)) * 3, jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 11, (2, 6)), jnp.int32)
  cfg = logprobs.SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)
  logp, ent = jax.jit(train_step.shifted_token_logprobs, static_argnums=2)(logits, tokens, cfg)
  want, want_ent = jax.jit(lambda lo, t: (
      logprobs.token_logprobs(lo[:, :-1], t[:, 1:], cfg),
      logprobs.entropy(logprobs.processed_logprobs(lo[:, :-1], cfg))))(logits, tokens)
  np.testing.assert_array_equal(logp[:, 1:], want)
  np.testing.assert_array_equal(ent[:, 1:], want_ent)
  np.testing.assert_array_equal(logp[:, 0], 0.0)
  np.testing.assert_array_equal(ent[:, 0], 0.0)


def test_completion_mask_needs_a_predecessor_in_the_same_segment():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0]], jnp.int32)
  mask = jnp.asarray([[1, 1, 1, 1, 1, 1, 0]], jnp.float32)
  np.testing.assert_array_equal(train_step.completion_mask(mask, seg), [[0, 1, 1, 0, 1, 0, 0]])


def _random_objective_inputs(seed, b=8, l=12):
  rng = np.random.default_rng(seed)
  seg = np.zeros((b, l), np.int32)
  mask = np.zeros((b, l), np.float32)
  for r in range(b):  # two samples per row, random completion lengths, some rows empty
    cut = int(rng.integers(3, l - 3))
    seg[r, :cut], seg[r, cut:l - int(rng.integers(0, 3))] = 1, 2
    for s in (1, 2):
      idx = np.flatnonzero(seg[r] == s)
      mask[r, idx[1 + int(rng.integers(0, len(idx) - 1)):]] = float(rng.random() > 0.15)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return dict(
      logp=f32(-rng.uniform(0.1, 3, (b, l))), mu=f32(-rng.uniform(0.1, 3, (b, l))),
      adv=f32(rng.normal(size=(b, l))), mask=f32(mask),
      lag=jnp.asarray(rng.integers(0, 4, (b, l)), jnp.int32), seg=jnp.asarray(seg))


@pytest.mark.parametrize("name, aggregation", [
    ("tis_pg", "token_mean"), ("tis_pg", "sequence_mean"), ("tis_pg", "constant"),
    ("decoupled_ppo", "token_mean")])
def test_micro_batch_weights_reproduce_the_whole_batch_objective(aggregation, name):
  """sum_m (n_m / n) L_m == L(batch) and the same for gradients (k = 4 micro-batches)."""
  x = _random_objective_inputs(0)
  cfg = objectives.ObjectiveConfig(
      name=name, aggregation=aggregation, max_lag=2,
      constant_normalizer=100.0 if aggregation == "constant" else None)
  obj = objectives.get_objective(name)

  def loss(logp, d):
    return obj(logp, d["mu"], d["adv"], d["mask"], d["lag"], cfg,
               prox_logp_BT=jax.lax.stop_gradient(logp), segment_ids_BT=d["seg"])[0]

  loss_and_grad = jax.jit(jax.value_and_grad(loss))
  rest = {n: v for n, v in x.items() if n != "logp"}
  full, full_grad = loss_and_grad(x["logp"], rest)
  total = train_step.normalizer_count(x["mask"], x["lag"], x["seg"], cfg)
  k = 4
  split = {n: train_step._split(v, k) for n, v in x.items()}  # pylint: disable=protected-access
  acc, grads, naive = 0.0, [], []
  for m in range(k):
    mb = {n: v[m] for n, v in split.items()}
    weight = train_step.normalizer_count(mb["mask"], mb["lag"], mb["seg"], cfg)
    if aggregation != "constant":
      weight = weight / total
    value, grad = loss_and_grad(mb["logp"], {n: v for n, v in mb.items() if n != "logp"})
    acc += weight * value
    naive.append(value)
    grads.append(weight * grad)
  merged = train_step._merge(jnp.stack(grads))  # pylint: disable=protected-access
  np.testing.assert_allclose(acc, full, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(merged, full_grad, rtol=1e-6, atol=1e-8)
  if aggregation != "constant":  # the naive per-micro-batch mean is a different estimator
    assert abs(np.mean(naive) - full) > 1e-4


def test_split_and_merge_assign_row_r_to_micro_batch_r_mod_k():
  x = jnp.arange(12, dtype=jnp.int32).reshape(6, 2)
  s = train_step._split(x, 3)  # pylint: disable=protected-access
  np.testing.assert_array_equal(s[1], [[2, 3], [8, 9]])
  np.testing.assert_array_equal(train_step._merge(s), x)  # pylint: disable=protected-access


def test_learning_rate_schedules():
  const = learner_lib.OptimizerConfig(learning_rate=1e-3, warmup_steps=4)
  np.testing.assert_allclose([optimizer.learning_rate(const, s) for s in (0, 3, 50)],
                             [2.5e-4, 1e-3, 1e-3], rtol=1e-6)
  cos = learner_lib.OptimizerConfig(learning_rate=1e-3, warmup_steps=4, schedule="cosine",
                                  decay_steps=14, min_lr_ratio=0.1)
  np.testing.assert_allclose([optimizer.learning_rate(cos, s) for s in (0, 4, 9, 14, 99)],
                             [2.5e-4, 1e-3, 5.5e-4, 1e-4, 1e-4], rtol=1e-5)


def test_weight_decay_skips_norms_and_biases():
  mask = optimizer.decay_mask(transformer.abstract_params(
      ModelConfig(vocab_size=16, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8,
                  qkv_bias=True, qk_norm=True)))
  assert mask["embed"] and mask["layers"]["wq"] and mask["layers"]["w_down"]
  assert not any([mask["final_norm"], mask["layers"]["attn_norm"], mask["layers"]["q_norm"],
                  mask["layers"]["bq"]])


@pytest.mark.parametrize("kwargs, match", [
    (dict(mesh_axes=(("fsdp", 0),)), "mesh_axes"),
    (dict(mesh_axes=(("tp", 2), ("tp", 2))), "repeats"),
    (dict(optimizer=dict(learning_rate=0.0)), "learning_rate"),
    (dict(optimizer=dict(schedule="linear")), "schedule"),
    (dict(optimizer=dict(schedule="cosine", warmup_steps=5, decay_steps=5)), "decay_steps"),
    (dict(optimizer=dict(decay_steps=10)), "only used"),
    (dict(micro_batches=0), "micro_batches"),
    (dict(max_consecutive_nonfinite=0), "max_consecutive_nonfinite"),
    (dict(optimizer=dict(max_grad_norm=-1.0)), "max_grad_norm"),
    (dict(checkpoint=dict(keep=0)), "keep"),
])
def test_config_rejects_bad_values(kwargs, match):
  subs = {"optimizer": learner_lib.OptimizerConfig, "checkpoint": learner_lib.CheckpointConfig}
  with pytest.raises(ValueError, match=match):
    learner_lib.LearnerConfig(**{k: subs[k](**v) if k in subs else v for k, v in kwargs.items()})


def _strip(spec):
  spec = tuple(spec)
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return spec


def test_state_shardings_come_from_abstract_shapes():
  cfg = learner_lib.LearnerConfig(mesh_axes=(("fsdp", 2), ("tp", 4)))
  mesh = sharding.learner_mesh(jax.devices(), cfg)
  tx = optimizer.make_optimizer(cfg.optimizer)
  shardings = train_state.state_shardings(TINY, tx, mesh)
  specs = {k: _strip(s.spec) for k, s in
           jax.tree_util.tree_flatten_with_path(shardings)[0]}
  specs = {jax.tree_util.keystr(k): v for k, v in specs.items()}
  assert specs[".params['layers']['wq']"] == (None, "fsdp", "tp")
  # 2 kv heads do not divide over 4-way tp: replicated on that dim instead of failing.
  assert specs[".params['layers']['wk']"] == (None, "fsdp")
  adam = [k for k in specs if k.endswith(".mu['layers']['wq']")]
  assert len(adam) == 1 and specs[adam[0]] == specs[".params['layers']['wq']"]
  assert specs[".version"] == specs[".rng"] == ()
  assert all(k.endswith("count") for k, v in specs.items() if v == () and ".opt_state" in k)


def test_synthetic_batch_respects_the_train_batch_contract():
  b = learner_lib.synthetic_batch(np.random.default_rng(0), 4, 32, 64, samples_per_row=3,
                                  version=5, max_lag=2)
  mask = b.loss_mask > 0
  assert mask.any() and (b.segment_ids[mask] > 0).all()
  np.testing.assert_array_equal(np.asarray(train_step.completion_mask(b.loss_mask,
                                                                      b.segment_ids)), b.loss_mask)
  lags = 5 - b.policy_versions[mask]
  assert lags.min() >= 0 and lags.max() <= 2


def test_public_api_is_documented():
  for name in learner_lib.__all__:
    obj = getattr(learner_lib, name)
    if inspect.isfunction(obj) or inspect.isclass(obj):
      assert obj.__doc__ and obj.__doc__.strip(), name
