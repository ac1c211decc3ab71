"""Static dense-KV baseline: greedy tokens are the full forward's argmax; budgets and stats."""

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import model
from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig, token_logprobs
from rlax_pipe.sampler import Request
from rlax_pipe.sampler.static_generate import static_generate

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=48, max_seq_len=32)
GREEDY = SamplingConfig(greedy=True)


def test_static_batches_generate_the_argmax_until_each_budget():
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.4, a.shape).astype(np.float32)),
                        model.abstract_params(MODEL))
  budgets = [3, 9, 1, 30, 5]  # 30 is capped by max_seq_len
  requests = [Request(prompt_tokens=rng.integers(0, 64, n), sample_id=i, max_new_tokens=b)
              for i, (n, b) in enumerate(zip([4, 1, 7, 6, 2], budgets))]
  ticks = iter(range(100))
  rollouts, stats = static_generate(params, MODEL, requests, batch_size=3, max_seq_len=32,
                                    max_new_tokens=8, sampling=GREEDY,
                                    clock=lambda: float(next(ticks)))
  assert stats.batches == 2 and [r.sample_id for r in rollouts] == list(range(5))
  tokens = np.zeros((5, 32), np.int32)
  for i, r in enumerate(rollouts):
    assert r.num_completion_tokens == min(budgets[i], 32 - len(r.prompt_tokens))
    capped = budgets[i] > 32 - len(r.prompt_tokens)  # max_seq_len reached before the budget
    assert r.finish_reason == ("capacity" if capped else "length")
    assert np.all(r.policy_versions == 0)
    seq = np.concatenate([r.prompt_tokens, r.completion_tokens])
    tokens[i, :len(seq)] = seq
  logits, _ = jax.jit(model.forward, static_argnums=3)(
      params, tokens, np.broadcast_to(np.arange(32), (5, 32)), MODEL)
  ref = np.asarray(token_logprobs(logits[:, :-1], tokens[:, 1:], GREEDY))
  for i, r in enumerate(rollouts):  # log-prob 0 under greedy == the token is the argmax
    np.testing.assert_array_equal(ref[i, len(r.prompt_tokens) - 1:][:r.num_completion_tokens], 0)
  # Batch 1 runs until its longest row (9 tokens); batch 2 until 26 (= 32 - 6).
  assert stats.decode_steps == 9 + 26
  assert 0 < stats.kv_utilization < stats.slot_occupancy <= 1
  assert np.all(stats.done_times <= np.array([r.t_finish for r in rollouts]))
