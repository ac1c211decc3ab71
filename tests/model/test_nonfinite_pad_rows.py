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
from rlax_pipe.types import Rollout

VOCAB = 48
PAD, UNUSED = 0, (45, 46, 47)  # ids no real token of these tests uses


def _cfg(tie):
  return ModelConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
                     head_dim=8, d_ff=32, max_seq_len=24, tie_embeddings=tie)


def _params(tie):
  """Clean params, and the same with NaN in the padding row and +-inf / NaN in unused rows."""
  clean = jax.tree.map(np.array, jax.device_get(
      model_lib.as_model(_cfg(tie)).init_params(jax.random.key(0))))
  if not tie:  # unused ids get logit 0: outside the top-k of the sampler tests below
    clean["lm_head"][:, [PAD, *UNUSED]] = 0.0
  bad = dict(clean, embed=clean["embed"].copy())
  bad["embed"][PAD] = np.nan
  bad["embed"][UNUSED[0]] = np.inf
  bad["embed"][UNUSED[1]] = -np.inf
  bad["embed"][UNUSED[2], ::2] = np.nan
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


@pytest.mark.parametrize("tie,excluded", [(False, False), (True, True)])
def test_learner_scoring_path_equals_the_clean_model(tie, excluded):
  """With a tied head, `SamplingConfig.excluded_ids` (the out-of-use ids) makes the poisoned
  model score exactly as the clean one with the same exclusion."""
  cfg, b = _cfg(tie), _batch()
  model = model_lib.as_model(cfg)
  real = jnp.asarray(b.segment_ids > 0)
  sampling = logprobs.SamplingConfig(temperature=0.9, top_k=20,
                                     excluded_ids=(PAD, *UNUSED) if excluded else ())

  def score(params):
    h = model.hidden_states(params, b.tokens, b.positions, segment_ids_BT=b.segment_ids,
                            attention_block_len=4)
    lp, _ = logprobs.next_token_logprobs(h, model.output_head(params), b.tokens, sampling,
                                         chunk_len=4)
    return jnp.sum(jnp.where(real, lp, 0.0) * b.advantages), (h, lp)

  loss_and_grad = jax.jit(jax.value_and_grad(score, has_aux=True))
  clean, bad = _params(tie)
  (l0, (h0, lp0)), g0 = loss_and_grad(clean)
  (l1, (h1, lp1)), g1 = loss_and_grad(bad)
  mask = np.asarray(real)
  np.testing.assert_array_equal(np.asarray(h1)[mask], np.asarray(h0)[mask])
  # (A tied head without the exclusion cannot pass: row PAD is also the pad id's output column,
  # so its NaN enters every position's softmax.)
  np.testing.assert_array_equal(np.asarray(lp1)[mask], np.asarray(lp0)[mask])
  assert np.isfinite(float(l0)) and float(l1) == float(l0)
  keep = np.ones(VOCAB, bool)
  keep[[PAD, *UNUSED]] = False
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(g0)[0], jax.tree.leaves(g1)):
    x, y = np.asarray(x), np.asarray(y)
    if jax.tree_util.keystr(path) == "['embed']":
      np.testing.assert_array_equal(y[~keep], 0.0)  # nothing flows into the poisoned rows
      x, y = x[keep], y[keep]
    np.testing.assert_array_equal(y, x, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("tie", [False, True])
def test_sampler_behaviour_logprobs_equal_the_clean_model(tie):
  """Prefill padding (short prompts in a 16-token bucket, padding rows), idle slots (more
  slots than requests at the end) and decode: same tokens and behaviour log-probs. A tied head
  needs the poisoned ids in `excluded_ids` (they are its output columns too)."""
  cfg = _cfg(tie)
  clean, bad = _params(tie)
  scfg = SamplerConfig(num_slots=4, page_size=4, num_pages=32, max_seq_len=24,
                       max_new_tokens=8, min_prefill_bucket=16, prefill_rows=2,
                       decode_steps_per_dispatch=4,
                       sampling=logprobs.SamplingConfig(
                           temperature=1.0, top_k=6, excluded_ids=(PAD, *UNUSED) if tie else ()))
  rng = np.random.default_rng(1)
  requests = [Request(prompt_tokens=rng.integers(1, 40, n).astype(np.int32), sample_id=i,
                      max_new_tokens=int(m))
              for i, (n, m) in enumerate([(3, 8), (7, 5), (1, 8), (5, 3), (2, 6)])]
  out = {}
  for name, params in (("clean", clean), ("bad", bad)):
    engine = SamplerEngine(cfg, scfg, jax.device_put(params))
    for r in requests:
      engine.submit(r)
    out[name] = sorted(engine.run_to_completion(), key=lambda r: r.sample_id)
  for c, p in zip(out["clean"], out["bad"]):
    assert not set(c.completion_tokens.tolist()) & {PAD, *UNUSED}  # the rows stay unused
    np.testing.assert_array_equal(p.completion_tokens, c.completion_tokens)
    np.testing.assert_array_equal(p.behavior_logprobs, c.behavior_logprobs)
    assert np.isfinite(c.behavior_logprobs).all()
  if tie:
    with pytest.raises(ValueError, match=r"excluded_ids=\(0, 45, 46, 47\) must be ids in"):
      SamplerEngine(cfg, dataclasses.replace(scfg, eos_id=UNUSED[0]), jax.device_put(clean))
