"""NaN / inf in embedding rows no real token uses (the padding id, unused ids) never reach a real
token's log-prob, loss gradient or behaviour log-prob (#27 item 1).

Padding is selected out (`jnp.where`), never multiplied by zero (NaN * 0 = NaN), on every path
that looks a padding id up: the learner's packed rows, whole padding rows, chunked log-probs and
blockwise attention, and the sampler's prefill padding and idle slots.
Each check compares a poisoned model with the clean one it came from: equal, not just finite.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import logprobs, model as model_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.pipeline import batching
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine
from rlax_pipe.types import Rollout, WeightUpdate

VOCAB = 48
PAD, UNUSED = 0, (45, 46, 47)  # ids no real token of these tests uses


def _cfg(tie):
  return ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
                     head_dim=8, d_ff=32, max_seq_len=24, tie_embeddings=tie)


def _params(tie):
  """Clean params, and the same with NaN in the padding row and +-inf / NaN in unused rows (of
  the embedding and, when untied, of the output head's columns too)."""
  clean = jax.tree.map(np.array, jax.device_get(
      model_lib.as_model(_cfg(tie)).init_params(jax.random.key(0))))
  bad = dict(clean, embed=clean["embed"].copy())
  rows = [bad["embed"]]
  if not tie:
    bad["lm_head"] = clean["lm_head"].copy()
    rows.append(bad["lm_head"].T)  # a view: writes go to the head's columns
  for r in rows:
    r[PAD] = np.nan
    r[UNUSED[0]] = np.inf
    r[UNUSED[1]] = -np.inf
    r[UNUSED[2], ::2] = np.nan
  return clean, bad


def _batch():
  """Three samples packed into rows of 16 with two whole padding rows (pad id 0)."""
  rng = np.random.default_rng(0)
  rollouts = [Rollout(sample_id=i, group_id=0,
                      prompt_tokens=rng.integers(1, 40, 3).astype(np.int32),
                      completion_tokens=rng.integers(1, 40, n).astype(np.int32),
                      behavior_logprobs=np.zeros(n, np.float32),
                      policy_versions=np.zeros(n, np.int32), finish_reason="eos")
              for i, n in enumerate([5, 9, 2])]
  b = batching.pack_rollouts(rollouts, np.ones(3, np.float32), 16, num_rows=4)
  assert (b.segment_ids == 0).all(axis=1).sum() >= 1 and (b.segment_ids == 0).any(axis=1).all()
  return b


@pytest.mark.parametrize("tie", [False, True])
def test_learner_scoring_path_equals_the_clean_model(tie):
  """By default (no setting), the poisoned model scores exactly as the clean one with the
  poisoned ids excluded (`SamplingConfig.excluded_ids`): the non-finite head columns are found
  and blocked (tied: the embedding rows are the head's columns; untied: the head's own)."""
  cfg, b = _cfg(tie), _batch()
  model = model_lib.as_model(cfg)
  real = jnp.asarray(b.segment_ids > 0)
  base = logprobs.SamplingConfig(temperature=0.9, top_k=20)

  def score(params, sampling):
    h = model.hidden_states(params, b.tokens, b.positions, segment_ids_BT=b.segment_ids,
                            attention_block_len=4)
    lp, _ = logprobs.next_token_logprobs(h, model.output_head(params), b.tokens, sampling,
                                         chunk_len=4)
    return jnp.sum(jnp.where(real, lp, 0.0) * b.advantages), (h, lp)

  # LLVM -O0: two compile-bound programs, both at the same level (equality is still exact)
  loss_and_grad = jax.jit(jax.value_and_grad(score, has_aux=True), static_argnums=1,
                          compiler_options={"xla_backend_optimization_level": 0})
  clean, bad = _params(tie)
  (l0, (h0, lp0)), g0 = loss_and_grad(
      clean, dataclasses.replace(base, excluded_ids=(PAD, *UNUSED)))
  (l1, (h1, lp1)), g1 = loss_and_grad(bad, base)
  mask = np.asarray(real)
  np.testing.assert_array_equal(np.asarray(h1)[mask], np.asarray(h0)[mask])
  np.testing.assert_array_equal(np.asarray(lp1)[mask], np.asarray(lp0)[mask])
  assert np.isfinite(float(l0)) and float(l1) == float(l0)
  keep = np.ones(VOCAB, bool)
  keep[[PAD, *UNUSED]] = False
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(g0)[0], jax.tree.leaves(g1)):
    x, y = np.asarray(x), np.asarray(y)
    if jax.tree_util.keystr(path) in ("['embed']", "['lm_head']"):
      y_rows = y if y.shape[0] == VOCAB else y.T
      x_rows = x if x.shape[0] == VOCAB else x.T
      np.testing.assert_array_equal(y_rows[~keep], 0.0)  # nothing flows into the poisoned rows
      x, y = x_rows[keep], y_rows[keep]
    np.testing.assert_array_equal(y, x, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("chunk_len", [None, 4])
def test_clean_weights_score_bit_identically_to_the_unmasked_formula(chunk_len, monkeypatch):
  """On finite weights the non-finite-column mask is all False and changes no bit: log-probs,
  entropies and the gradients (hidden states and head) equal the plain formula
  `processed_logprobs(h @ head)` at the target, which has no mask."""
  cfg, b = _cfg(True), _batch()
  model = model_lib.as_model(cfg)
  clean, _ = _params(True)
  sampling = logprobs.SamplingConfig(temperature=0.9, top_k=20)
  h = model.hidden_states(clean, b.tokens, b.positions, segment_ids_BT=b.segment_ids)
  head = model.output_head(clean)
  w = jnp.asarray(b.advantages)

  def masked(h, head):
    lp, ent = logprobs.next_token_logprobs(h, head, b.tokens, sampling, chunk_len=chunk_len)
    return jnp.sum(lp * w), (lp, ent)

  def plain(h, head):
    logits = jnp.einsum("bte,ev->btv", h.astype(jnp.float32), head.astype(jnp.float32))
    logp_all = logprobs.processed_logprobs(logits[:, :-1], sampling)
    hit = jnp.arange(VOCAB)[None, None, :] == jnp.asarray(b.tokens)[:, 1:, None]
    zero = jnp.zeros((b.tokens.shape[0], 1), jnp.float32)
    lp = jnp.concatenate([zero, jnp.sum(jnp.where(hit, logp_all, 0.0), axis=-1)], axis=1)
    ent = jnp.concatenate([zero, logprobs.entropy(logp_all)], axis=1)
    return jnp.sum(lp * w), (lp, ent)

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
  if chunk_len is None:  # same program shape: every bit equal
    (l1, aux1), g1 = grad(masked)(h, head)
    (l0, aux0), g0 = grad(plain)(h, head)
  else:  # chunked: compare with the unmasked chunked path (the mask forced off)
    (l1, aux1), g1 = grad(masked)(h, head)
    monkeypatch.setattr(logprobs, "nonfinite_columns", lambda head: None)
    (l0, aux0), g0 = grad(masked)(h, head)
  for x, y in zip(jax.tree.leaves(((l0, aux0), g0)), jax.tree.leaves(((l1, aux1), g1))):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_sample_is_bit_identical_with_an_all_false_mask_and_never_draws_a_blocked_id():
  """`logprobs.sample` with the mask of finite weights (all False) equals the call without it;
  with a NaN / inf logit column blocked, the rest equals the reference without those ids."""
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(64, VOCAB)).astype(np.float32) * 3)
  key = jax.random.key(3)
  for cfg in (logprobs.SamplingConfig(temperature=0.7, top_k=9),
              logprobs.SamplingConfig(top_p=0.8)):
    draw = jax.jit(logprobs.sample, static_argnums=2)
    t0, lp0 = draw(key, logits, cfg)
    t1, lp1 = draw(key, logits, cfg, jnp.zeros(VOCAB, bool))
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t0))
    np.testing.assert_array_equal(np.asarray(lp1), np.asarray(lp0))
    blocked = np.zeros(VOCAB, bool)
    blocked[[PAD, *UNUSED]] = True
    poisoned = logits.at[:, PAD].set(jnp.nan).at[:, UNUSED[0]].set(jnp.inf)
    t2, lp2 = draw(key, poisoned, cfg, jnp.asarray(blocked))
    t3, lp3 = draw(key, logits, dataclasses.replace(cfg, excluded_ids=(PAD, *UNUSED)))
    assert not np.isin(np.asarray(t2), [PAD, *UNUSED]).any() and np.isfinite(lp2).all()
    np.testing.assert_array_equal(np.asarray(t2), np.asarray(t3))
    np.testing.assert_array_equal(np.asarray(lp2), np.asarray(lp3))


def test_nonfinite_columns_finds_each_kind():
  head = np.ones((4, 6), np.float32)
  head[1, 2], head[0, 3], head[3, 5] = np.nan, np.inf, -np.inf
  np.testing.assert_array_equal(np.asarray(logprobs.nonfinite_columns(jnp.asarray(head))),
                                [False, False, True, True, False, True])
  with pytest.raises(ValueError, match="must be"):
    logprobs.nonfinite_columns(jnp.ones(3))


def test_sampler_behaviour_logprobs_equal_the_clean_model():
  """Prefill padding (short prompts in a 16-token bucket, padding rows), idle slots (more
  slots than requests at the end) and decode: by default (no setting) the poisoned model gives
  the same tokens and behaviour log-probs as the clean one with the poisoned ids excluded.

  Tied head only: it covers the untied case's paths too (the poisoned embedding rows are read by
  the input-side lookups, the same code untied; and they are the output-head columns, which the
  mask finds through `model.output_head`, the untied head's code as well). The learner test
  above runs both."""
  cfg = _cfg(True)
  clean, bad = _params(True)
  scfg = SamplerConfig(num_slots=4, page_size=4, num_pages=32, max_seq_len=24,
                       max_new_tokens=8, min_prefill_bucket=16, prefill_rows=2,
                       decode_steps_per_dispatch=4,
                       sampling=logprobs.SamplingConfig(temperature=1.0, top_k=6))
  rng = np.random.default_rng(1)
  requests = [Request(prompt_tokens=rng.integers(1, 40, n).astype(np.int32), sample_id=i,
                      max_new_tokens=int(m))
              for i, (n, m) in enumerate([(3, 8), (7, 5), (1, 8), (5, 3), (2, 6)])]
  excluded = dataclasses.replace(
      scfg, sampling=dataclasses.replace(scfg.sampling, excluded_ids=(PAD, *UNUSED)))
  out, engines = {}, {}
  for name, params, sc in (("clean", clean, excluded), ("bad", bad, scfg)):
    engines[name] = engine = SamplerEngine(cfg, sc, jax.device_put(params))
    for r in requests:
      engine.submit(r)
    out[name] = sorted(engine.run_to_completion(), key=lambda r: r.sample_id)
  for c, p in zip(out["clean"], out["bad"]):
    assert not set(c.completion_tokens.tolist()) & {PAD, *UNUSED}  # the rows stay unused
    np.testing.assert_array_equal(p.completion_tokens, c.completion_tokens)
    np.testing.assert_array_equal(p.behavior_logprobs, c.behavior_logprobs)
    assert np.isfinite(c.behavior_logprobs).all()
  # The mask belongs to a weight version: computed when it is installed, again at a swap.
  poisoned = np.zeros(VOCAB, bool)
  poisoned[[PAD, *UNUSED]] = True
  engine = engines["bad"]
  assert all((np.asarray(m) == poisoned).all() for m in engine.weights.masks)
  engine.update_weights(WeightUpdate(1, jax.device_put(clean)))
  assert engine.version == 1 and not any(np.asarray(m).any() for m in engine.weights.masks)
  with pytest.raises(ValueError, match=r"excluded_ids=\(0, 45, 46, 47\) must be ids in"):
    SamplerEngine(cfg, dataclasses.replace(excluded, eos_id=UNUSED[0]), jax.device_put(clean))


def test_learner_blocks_nonfinite_head_columns_found_when_its_params_are_set():
  """The Learner finds the poisoned ids once on the host (not in every step program): they are
  added to its SamplingConfig.excluded_ids, so a train step on the poisoned model gives exactly
  the metrics of the clean model with those ids excluded; clean params leave the config as is."""
  from rlax_pipe import learner as learner_lib
  from rlax_pipe.objectives import ObjectiveConfig
  cfg, b = _cfg(True), _batch()
  clean, bad = _params(True)
  sampling = logprobs.SamplingConfig(temperature=0.9, top_k=20)
  lcfg = learner_lib.LearnerConfig(
      mesh_axes=(("fsdp", 1), ("tp", 1)), micro_batch_rows=4,
      optimizer=learner_lib.OptimizerConfig(learning_rate=1e-3, warmup_steps=0))
  dev = jax.devices()[:1]
  learners = {
      "bad": learner_lib.Learner(cfg, lcfg, ObjectiveConfig(), sampling, devices=dev, params=bad),
      "clean": learner_lib.Learner(
          cfg, lcfg, ObjectiveConfig(),
          dataclasses.replace(sampling, excluded_ids=(PAD, *UNUSED)), devices=dev, params=clean),
      "clean_default": learner_lib.Learner(cfg, lcfg, ObjectiveConfig(), sampling, devices=dev,
                                           params=clean)}
  assert learners["bad"].sampling_cfg.excluded_ids == (PAD, *UNUSED)
  assert learners["clean_default"].sampling_cfg.excluded_ids == ()
  metrics = {}
  for name in ("bad", "clean"):
    learners[name].train_step(b)
    metrics[name] = learners[name].flush()
  for key in ("loss", "grad_norm"):
    assert np.isfinite(metrics["clean"][key]), key
    assert float(metrics["bad"][key]) == float(metrics["clean"][key]), key
