"""Pure pieces of the learner: logit processing, masks, micro-batch weights, schedule, config."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.lib.learner_bench import synthetic_batch
from rlax_pipe import learner as learner_lib
from rlax_pipe import logprobs
from rlax_pipe import objectives
from rlax_pipe.learner import token_loss
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner import optimizer, sharding, train_state, train_step
from rlax_pipe.model import transformer

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64)


@pytest.mark.parametrize("chunk_len", [None, 4, 5])
def test_chunked_next_token_logprobs_equal_the_full_logits_reference(chunk_len):
  """Values and gradients (w.r.t. hidden states and head) of the chunked, rematerialised
  log-probs equal those of full [B, T, V] logits through the shared logit processing; T = 11
  is not a multiple of 4 or 5, so the padding of the last chunk is exercised."""
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(2, 11, 6)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(6, 13)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 13, (2, 11)), jnp.int32)
  w = jnp.asarray(rng.normal(size=(2, 11)), jnp.float32)
  cfg = logprobs.SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)

  def ours(h, head):
    logp, ent = logprobs.next_token_logprobs(h, head, tokens, cfg, chunk_len=chunk_len)
    return jnp.sum(w * logp), (logp, ent)

  def reference(h, head):
    logits = jnp.einsum("bte,ev->btv", h, head)
    logp = logprobs.token_logprobs(logits[:, :-1], tokens[:, 1:], cfg)
    ent = logprobs.entropy(logprobs.processed_logprobs(logits[:, :-1], cfg))
    pad = jnp.zeros((2, 1))
    return jnp.sum(w[:, 1:] * logp), (jnp.concatenate([pad, logp], 1),
                                      jnp.concatenate([pad, ent], 1))

  (v, (logp, ent)), g = jax.jit(jax.value_and_grad(ours, (0, 1), has_aux=True))(h, head)
  (rv, (rlogp, rent)), rg = jax.jit(jax.value_and_grad(reference, (0, 1), has_aux=True))(h, head)
  np.testing.assert_allclose(logp, rlogp, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(ent, rent, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(v, rv, rtol=1e-6)
  for a, b in zip(g, rg):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


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
def test_micro_batch_sums_reproduce_the_whole_batch_objective(aggregation, name):
  """sum_m numerator_m / normaliser(sum_m counts_m) == L(batch), and the same for gradients,
  for the learner's split of rows into micro-batches (k = 4, row blocks of 2)."""
  x = _random_objective_inputs(0)
  cfg = objectives.ObjectiveConfig(
      name=name, aggregation=aggregation, max_lag=2,
      max_completion_len=12 if aggregation == "constant" else None)

  def loss(logp, d):
    return token_loss.objective_loss(logp, d["mu"], d["adv"], d["mask"], d["lag"], cfg,
                                     segment_ids_BT=d["seg"])[0]

  def numerator(logp, d):
    sel = token_loss.select_valid(logp, d["mu"], d["adv"], d["mask"], d["lag"], cfg)
    _, out = token_loss.per_token_loss(sel, d["lag"], cfg)
    return token_loss.loss_sums(out.loss_BT, sel.valid_BT, d["mask"], d["seg"], cfg)

  full, full_grad = jax.jit(jax.value_and_grad(loss))(x["logp"], x)
  num_and_grad = jax.jit(jax.value_and_grad(numerator, has_aux=True))
  total, counts, grads = 0.0, None, []
  for rows in learner_lib.plan_micro_batches(8, 2, 1)[0]:
    part = {n: v[rows] for n, v in x.items()}
    (value, c), g = num_and_grad(part["logp"], part)
    total += value
    counts = c if counts is None else jax.tree.map(jnp.add, counts, c)
    grads.append(g)
  denom = token_loss.normalizer(counts, cfg)
  np.testing.assert_allclose(total / denom, full, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(jnp.concatenate(grads) / denom, full_grad, rtol=1e-6, atol=1e-8)


def test_plan_micro_batches_pads_and_strides_minibatches():
  plan = learner_lib.plan_micro_batches(7, 2, 2)
  assert [[r.tolist() for r in mb] for mb in plan] == [[[0, 2], [4, 6]], [[1, 3], [5, -1]]]
  assert learner_lib.plan_micro_batches(1, 4, 3)[1:] == [[], []]  # minibatches without rows


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
    (dict(micro_batch_rows=0), "micro_batch_rows"),
    (dict(mesh_axes=(("data", 2), ("fsdp", 2)), micro_batch_rows=6), "multiple"),
    (dict(num_minibatches=0), "num_minibatches"),
    (dict(logits_chunk_len=0), "logits_chunk_len"),
    (dict(attention_block_len=0), "attention_block_len"),
    (dict(remat="some"), "remat"),
    (dict(max_consecutive_nonfinite=0), "max_consecutive_nonfinite"),
    (dict(optimizer=dict(max_grad_norm=-1.0)), "max_grad_norm"),
    (dict(checkpoint=dict(keep=0)), "keep"),
])
def test_config_rejects_bad_values(kwargs, match):
  subs = {"optimizer": learner_lib.OptimizerConfig, "checkpoint": learner_lib.CheckpointConfig}
  with pytest.raises(ValueError, match=match):
    learner_lib.LearnerConfig(**{k: subs[k](**v) if k in subs else v for k, v in kwargs.items()})


def test_config_accepts_the_old_boolean_remat():
  assert learner_lib.LearnerConfig(remat=True).remat == "full"
  assert learner_lib.LearnerConfig(remat=False).remat == "none"


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
  b = synthetic_batch(np.random.default_rng(0), 4, 32, 64, samples_per_row=3,
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
