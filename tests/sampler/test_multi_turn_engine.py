"""Engine, multi-turn episodes: a turn that ends on a stop id parks the sequence (slot freed,
pages kept); `continue_sequence` appends environment tokens by a prefill continuation. Checked
against the full-sequence forward: exact tokens, masks, versions (weight swaps mid-turn and
between turns), prefill counts, page eviction of parked episodes, abort and snapshot/restore."""

import dataclasses

import numpy as np
import pytest

from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine
from rlax_pipe.types import WeightUpdate

from engine_reference import random_params, reference_logprobs  # this directory

MODEL = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=48, max_seq_len=64)
SAMPLING = SamplingConfig(temperature=1.0)
STOP = tuple(range(24, 32))  # a quarter of the vocabulary ends a turn: turns are short
CFG = SamplerConfig(num_slots=2, page_size=4, num_pages=28, max_seq_len=64, max_new_tokens=48,
                    min_prefill_bucket=8, prefill_rows=2, eos_id=STOP, sampling=SAMPLING,
                    decode_steps_per_dispatch=1)


@pytest.fixture(scope="module")
def params():
  return [random_params(MODEL, np.random.default_rng(seed), 0.5) for seed in range(3)]


def _reference(params, r):
  """[T] teacher-forced log-prob of each completion token under `params`."""
  return reference_logprobs(params, [r], MODEL, SAMPLING, rows=1)[0]


def _env_tokens(sample_id, turn):
  """What a fake environment answers: 2-5 ids below the stop set (deterministic)."""
  rng = np.random.default_rng(1000 * sample_id + turn)
  return rng.integers(0, 24, int(rng.integers(2, 6))).astype(np.int32)


def _drive(engine, max_turns=3, on_step=None, on_park=None):
  """Steps until every episode ended; returns ({sample_id: final rollout}, {sample_id: [
  (sampled turn tokens, env tokens), ...]})."""
  final, log, seen = {}, {}, {}
  step = 0
  while engine.has_work or engine.num_parked:
    if on_step is not None:
      on_step(step, engine)
    step += 1
    for r in engine.step():
      sid = r.sample_id
      turns = log.setdefault(sid, [])
      new = r.completion_tokens[seen.get(sid, 0):]
      turns.append([new, None])
      seen[sid] = r.num_completion_tokens
      if r.finish_reason != "eos" or len(turns) >= max_turns or engine.num_parked == 0:
        if r.finish_reason == "eos":
          engine.end_sequence(sid)
        final[sid] = r
        continue
      if on_park is not None:
        on_park(sid, engine)
      env = _env_tokens(sid, len(turns))
      if r.num_completion_tokens + len(r.prompt_tokens) + len(env) >= 64:
        engine.end_sequence(sid)
        final[sid] = r
        continue
      turns[-1][1] = env
      seen[sid] += len(env)
      engine.continue_sequence(sid, env)
  return final, log


def _submit(engine, n, seed=0, prompt_len=5):
  rng = np.random.default_rng(seed)
  for i in range(n):
    engine.submit(Request(prompt_tokens=rng.integers(0, 24, prompt_len), sample_id=i,
                          group_id=i, multi_turn=True))


def _check_exact(final, log):
  """Training tokens == sampled tokens + environment tokens, in order; masks match."""
  multi = 0
  for sid, r in final.items():
    pieces, mask = [], []
    for sampled, env in log[sid]:
      pieces.append(sampled)
      mask += [1] * len(sampled)
      if env is not None:
        pieces.append(env)
        mask += [0] * len(env)
    np.testing.assert_array_equal(r.completion_tokens, np.concatenate(pieces))
    np.testing.assert_array_equal(r.completion_mask, mask)
    assert r.num_turns == len(log[sid])
    env_at = r.completion_mask == 0
    assert np.all(r.behavior_logprobs[env_at] == 0.0)
    multi += len(log[sid]) > 1
  return multi


def test_continuation_matches_full_forward_and_counts_prefill(params):
  engine = SamplerEngine(MODEL, CFG, params[0])
  _submit(engine, 4)
  parked_slots = []
  final, log = _drive(engine, on_park=lambda sid, e: parked_slots.append(e.num_active))
  assert sorted(final) == [0, 1, 2, 3]
  assert _check_exact(final, log) >= 2  # some episodes really had several turns
  continued = 0
  for r in final.values():
    ref = _reference(params[0], r)
    model_at = r.completion_mask > 0
    np.testing.assert_allclose(r.behavior_logprobs[model_at], ref[model_at], atol=2e-5, rtol=0)
    # environment tokens carry the version of the model token before them
    np.testing.assert_array_equal(r.policy_versions, 0)
    # a continuation prefills the turn's stop id and the environment's tokens but the last
    # (fed by the next decode step): as many tokens as the environment gave
    continued += int((r.completion_mask == 0).sum())
  stats = engine.stats()
  assert stats.continued_tokens == continued and stats.recomputed_tokens == 0
  assert stats.prefill_tokens == 4 * (5 - 1) + continued  # the conversation is never re-prefilled
  assert stats.parked_evictions == 0 and stats.finished == 4
  assert engine.num_parked == 0 and engine.replicas[0].alloc.num_used == 0
  assert parked_slots and max(parked_slots) < CFG.num_slots  # a parked episode holds no slot


def test_weight_swaps_mid_turn_and_between_turns_keep_exact_tags(params):
  cfg = dataclasses.replace(CFG, kv_policy="recompute")
  engine = SamplerEngine(MODEL, cfg, params[0])
  _submit(engine, 3, seed=3)
  version_at = {}

  def on_step(step, e):
    if step in (2, 6):  # mid-turn: sequences are decoding
      e.update_weights(WeightUpdate(e.version + 1, params[e.version + 1]))
    version_at[step] = e.version

  final, log = _drive(engine, on_step=on_step)
  assert engine.version == 2
  assert _check_exact(final, log) >= 1
  mixed = 0
  for r in final.values():
    model_at = r.completion_mask > 0
    versions = r.policy_versions[model_at]
    assert np.all(np.diff(versions) >= 0)
    mixed += len(set(versions.tolist())) > 1
    refs = {v: _reference(params[v], r) for v in range(3)}
    expected = np.array([refs[v][j] for j, v in enumerate(r.policy_versions)])
    # recompute: every model token's log-prob is the full forward under its own version
    np.testing.assert_allclose(r.behavior_logprobs[model_at], expected[model_at], atol=2e-5,
                               rtol=0)
    assert r.oldest_version() == versions.min()
  assert mixed >= 1 and engine.stats().recomputed_tokens > 0


def test_parked_pages_are_evicted_under_pressure_and_recomputed(params):
  engine = SamplerEngine(MODEL, CFG, params[0])
  rng = np.random.default_rng(7)
  engine.submit(Request(prompt_tokens=rng.integers(0, 24, 9), sample_id=0, multi_turn=True))
  parked = None
  while parked is None:
    for r in engine.step():
      parked = r
  assert parked.finish_reason == "eos" and engine.num_parked == 1
  sched = engine.replicas[0].sched
  assert engine.replicas[0].alloc.num_pages_of(next(iter(sched.parked))) > 0
  # three longer episodes (40-token prompts, 10+ pages each) park too: 28 pages cannot hold all
  for i in (1, 2, 3):
    engine.submit(Request(prompt_tokens=rng.integers(0, 24, 40), sample_id=i, multi_turn=True))
  others = []
  while len(others) < 3:
    others += engine.step()
  assert engine.stats().parked_evictions >= 1
  assert not engine.replicas[0].alloc.holds(next(iter(sched.parked)))  # the oldest went first
  recomputed = engine.stats().recomputed_tokens  # preemptions of the two, if any
  env = np.array([3, 4, 5], np.int32)
  engine.continue_sequence(0, env)
  out = []
  while not out:
    out = engine.step()
  r = out[0]
  if r.finish_reason == "eos":
    engine.end_sequence(0)
  n = parked.num_completion_tokens
  np.testing.assert_array_equal(r.completion_tokens[:n + 3],
                                np.concatenate([parked.completion_tokens, env]))
  # the evicted episode's whole prefix is prefilled again (prompt - 1 + its tokens + env - 1)
  assert engine.stats().recomputed_tokens - recomputed == 9 - 1 + n
  assert engine.stats().continued_tokens == 3
  ref = _reference(params[0], r)
  model_at = r.completion_mask > 0
  np.testing.assert_allclose(r.behavior_logprobs[model_at], ref[model_at], atol=2e-5, rtol=0)


def test_abort_and_snapshot_restore_of_a_parked_episode(params):
  engine = SamplerEngine(MODEL, CFG, params[0])
  _submit(engine, 2, seed=5)
  parked = {}
  while len(parked) < 2:
    for r in engine.step():
      if r.finish_reason == "eos":
        parked[r.sample_id] = r
      else:  # ended on length: not an episode to test here
        pytest.skip("seed gave a length finish")
  assert engine.num_parked == 2 and engine.num_active == 0
  assert set(engine.unfinished()) == {0, 1}
  state = engine.state_dict()
  aborted = engine.abort(1)
  assert aborted.finish_reason == "aborted" and engine.num_parked == 1
  np.testing.assert_array_equal(aborted.completion_tokens, parked[1].completion_tokens)
  with pytest.raises(ValueError, match="not a parked episode"):
    engine.continue_sequence(1, [1, 2])
  with pytest.raises(ValueError, match="non-empty"):
    engine.continue_sequence(0, [])

  def finish(e):
    e.continue_sequence(0, [7, 8, 9])
    while True:
      for r in e.step():
        if r.sample_id == 0:
          if r.finish_reason == "eos":
            e.end_sequence(0)
          return r

  restored = SamplerEngine(MODEL, CFG, params[1], version=0)
  restored.load_state_dict(state)
  assert restored.num_parked == 2
  a, b = finish(engine), finish(restored)
  np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
  np.testing.assert_array_equal(a.behavior_logprobs, b.behavior_logprobs)
  np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
  assert restored.abort_all()[0].sample_id == 1 and restored.num_parked == 0
