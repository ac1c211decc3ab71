"""Engine: log-prob parity with the full forward (with preemptions), per-token versions under
in-flight weight swaps (keep / recompute), no recompilation after warm-up, bad inputs, API."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import model
from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig, token_logprobs
from rlax_pipe.model.kv_cache import DenseKVCache
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine, page_pool
from rlax_pipe.types import WeightUpdate

from engine_reference import random_params, reference_logprobs  # this directory

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=48, max_seq_len=40)
SAMPLING = SamplingConfig(temperature=0.8, top_k=24, top_p=0.95)
# 12 pages of 4 tokens for 4 slots of up to 40 tokens: long requests force preemptions.
CFG = SamplerConfig(num_slots=4, page_size=4, num_pages=12, max_seq_len=40, max_new_tokens=16,
                    min_prefill_bucket=16, prefill_rows=2, sampling=SAMPLING)
REF_ROWS = 16


@pytest.fixture(scope="module")
def params():
  """Three independent weight sets (versions 0, 1, 2), drawn with numpy (nothing to compile)."""
  return [random_params(MODEL, np.random.default_rng(seed), 0.4) for seed in range(3)]


def _reference(params, rollouts, sampling=SAMPLING):
  """Teacher-forced log-probs of each rollout's completion (one padded batch, one compile)."""
  return reference_logprobs(params, rollouts, MODEL, sampling, REF_ROWS)


def _requests(n, seed=0, prompt_lens=(1, 3, 4, 5, 9, 15, 17, 20), budgets=(8, 20)):
  rng = np.random.default_rng(seed)
  lens = [prompt_lens[i % len(prompt_lens)] for i in range(n)]
  return [Request(prompt_tokens=rng.integers(0, MODEL.vocab_size, lens[i]), sample_id=i,
                  group_id=i // 2, prompt_index=100 + i,
                  max_new_tokens=int(rng.integers(budgets[0], budgets[1] + 1)))
          for i in range(n)]


class CompileCounter:
  """Counts XLA backend compilations (any jitted or eager op) while active."""

  def __enter__(self):
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    return self

  def _on_event(self, event, duration, **kwargs):
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      self.count += 1

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._on_event)


def test_parity_with_full_forward_across_page_boundaries_and_preemptions(params):
  engine = SamplerEngine(MODEL, CFG, params[0])
  requests = _requests(12)
  for r in requests:
    engine.submit(r)
  rollouts = engine.run_to_completion()
  assert sorted(r.sample_id for r in rollouts) == list(range(12))
  assert sum(r.num_preemptions for r in rollouts) > 0, "the tiny pool should force preemptions"
  stats = engine.stats()
  assert stats.preemptions > 0 and stats.recomputed_tokens > 0
  err = 0.0
  for r, ref in zip(rollouts, _reference(params[0], rollouts)):
    req = requests[r.sample_id]
    np.testing.assert_array_equal(r.prompt_tokens, req.prompt_tokens)
    budget = min(req.max_new_tokens, CFG.max_seq_len - len(req.prompt_tokens))
    assert r.num_completion_tokens == budget and r.finish_reason == "length"
    assert (r.group_id, r.prompt_index) == (req.group_id, req.prompt_index)
    assert np.all(r.policy_versions == 0) and r.behavior_logprobs.dtype == np.float32
    err = max(err, float(np.abs(r.behavior_logprobs - ref).max()))
  assert err < 1e-5, err
  assert stats.generated_tokens == sum(r.num_completion_tokens for r in rollouts)
  assert not engine.has_work
  alloc = engine.replicas[0].alloc
  alloc.check()
  assert alloc.num_free == CFG.num_pages


def _keep_reference(params_by_version, rollout):
  """Token-by-token dense-KV decode where each position's KV comes from the weights of the step
  that fed it: the prompt prefix from the version of the first token, position p-1+j from the
  version of token j (the decode step that produced token j fed that position)."""
  p, n = len(rollout.prompt_tokens), rollout.num_completion_tokens
  tokens = np.concatenate([rollout.prompt_tokens, rollout.completion_tokens])
  cache = DenseKVCache.init(MODEL.n_layers, 1, MODEL.max_seq_len, MODEL.n_kv_heads, MODEL.head_dim)
  versions = [rollout.policy_versions[0]] * (p - 1) + list(rollout.policy_versions)
  out = []
  for pos in range(p - 1 + n):
    lp, cache = _dense_decode(params_by_version[versions[pos]], cache, tokens[pos], pos,
                              tokens[pos + 1])
    out.append(float(lp))
  return np.asarray(out[p - 1:])


@jax.jit
def _dense_decode(params, cache, token, position, next_token):
  logits, cache = model.forward(params, jnp.reshape(token, (1, 1)), jnp.reshape(position, (1, 1)),
                                MODEL, cache=cache)
  return token_logprobs(logits, jnp.reshape(next_token, (1, 1)), SAMPLING)[0, 0], cache


@pytest.mark.parametrize("kv_policy", ["keep", "recompute"])
def test_versions_and_logprobs_follow_the_weights_that_made_each_token(params, kv_policy):
  cfg = dataclasses.replace(CFG, kv_policy=kv_policy, decode_steps_per_dispatch=1)
  engine = SamplerEngine(MODEL, cfg, params[0])
  requests = _requests(4, seed=1, prompt_lens=(2, 5, 4, 3), budgets=(8, 8))
  for r in requests[:3]:
    engine.submit(r)
  swaps = {2: 1, 5: 2}  # before step i, version swaps[i] is handed over
  version_at_step, admitted_at, rollouts = [], {}, []
  for i in range(12):
    if i in swaps:
      engine.update_weights(WeightUpdate(swaps[i], params[swaps[i]]))
      assert engine.version == swaps[i]  # between steps: swapped in at once
    if i == 3:
      engine.submit(requests[3])  # admitted under version 1, after the first swap
    waiting_before = engine.num_waiting
    rollouts += engine.step()
    version_at_step.append(engine.version)
    if i in (0, 3):
      admitted_at.update({sid: i for sid in ((0, 1, 2) if i == 0 else (3,))})
      assert engine.num_waiting == waiting_before - (3 if i == 0 else 1)
  assert not engine.has_work and len(rollouts) == 4
  assert engine.stats().weight_updates == 2 and engine.stats().preemptions == 0
  by_version = dict(enumerate(params))
  for r in rollouts:
    expected_versions = [version_at_step[admitted_at[r.sample_id] + j]
                         for j in range(r.num_completion_tokens)]
    np.testing.assert_array_equal(r.policy_versions, expected_versions)
    assert len(set(expected_versions)) >= 2 or r.sample_id == 3
  # Reference for each policy, and proof that the two references differ (the test can tell).
  full = {v: _reference(p, rollouts) for v, p in by_version.items()}
  for i, r in enumerate(rollouts):
    recompute_ref = np.array([full[v][i][j] for j, v in enumerate(r.policy_versions)])
    keep_ref = _keep_reference(by_version, r)
    ref, other = (keep_ref, recompute_ref) if kv_policy == "keep" else (recompute_ref, keep_ref)
    np.testing.assert_allclose(r.behavior_logprobs, ref, atol=1e-5, rtol=0)
    if r.sample_id != 3:  # mixed-version samples: the other policy's reference disagrees
      assert np.abs(r.behavior_logprobs - other).max() > 1e-3
  if kv_policy == "recompute":
    assert engine.stats().recomputed_tokens > 0


def test_no_recompilation_after_warmup(params):
  cfg = dataclasses.replace(CFG, kv_policy="recompute")
  engine = SamplerEngine(MODEL, cfg, params[0])
  engine.warmup()
  requests = _requests(10, seed=2)
  with CompileCounter() as compiles, jax.transfer_guard("disallow"):
    for r in requests[:6]:
      engine.submit(r)
    finished = []
    for i in range(30):
      if i in (3, 9):
        engine.update_weights(WeightUpdate(1 + (i == 9), params[1 + (i == 9)]))
      if i == 5:
        for r in requests[6:]:
          engine.submit(r)
      finished += engine.step()
    aborted = engine.abort_all()
  stats = engine.stats()
  assert stats.weight_updates == 2 and stats.preemptions > 0 and stats.finished > 0
  assert len(finished) + len(aborted) == 10 and stats.recomputed_tokens > 0
  assert compiles.count == 0


def test_no_recompilation_across_generations_swaps_refills_and_restores(params):
  """#27 item 10: after `warmup`, nothing compiles over several generations (more requests
  than slots: refills), a weight push of committed arrays (as the weight channel places them)
  into an engine started from uncommitted `jnp` weights, `load_rng_state` and a whole-state
  restore; nor in a second engine started from committed weights. Before the fix the push
  compiled the decode and prefill programs again (committed vs uncommitted weights) and the
  sampling key placed by `device_put` compiled a decode variant (typed-key avals)."""
  def committed(p, scale=1.0):
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x) * scale, x.sharding), p)

  engine = SamplerEngine(MODEL, CFG, params[0])  # jnp arrays: uncommitted
  engine.warmup()
  other = SamplerEngine(MODEL, CFG, committed(params[1]))
  other.warmup()
  rng = np.random.default_rng(11)
  with CompileCounter() as compiles:
    finished = 0
    for gen in range(4):
      for i in range(6):
        engine.submit(Request(prompt_tokens=rng.integers(0, MODEL.vocab_size, 2 + 3 * i),
                              sample_id=10 * gen + i, group_id=10 * gen + i // 2,
                              max_new_tokens=int(rng.integers(4, 12))))
      steps = 0
      while engine.has_work:
        finished += len(engine.step())
        steps += 1
        if gen == 1 and steps == 2:  # mid-generation swap
          engine.update_weights(WeightUpdate(1, committed(params[2]), donated=True))
      if gen == 1:
        engine.load_rng_state(engine.rng_state())
      if gen == 2:
        engine.load_state_dict(engine.state_dict())
    other.submit(Request(prompt_tokens=np.arange(5, dtype=np.int32), sample_id=0))
    other.run_to_completion()
  assert finished == 24 and engine.stats().weight_updates == 1 and engine.version == 1
  assert compiles.count == 0


def test_eos_first_token_is_passed_on_as_an_eos_completion(params):
  request = _requests(1, seed=4)[0]
  probe = SamplerEngine(MODEL, CFG, params[0])
  probe.submit(request)
  probe_rollout = probe.run_to_completion()[0]
  first = int(probe_rollout.completion_tokens[0])
  engine = SamplerEngine(MODEL, dataclasses.replace(CFG, eos_id=first), params[0])
  engine.submit(request)  # same seed, same slot: the first draw is `first` again
  (rollout,) = engine.run_to_completion()
  assert rollout.finish_reason == "eos"
  np.testing.assert_array_equal(rollout.completion_tokens, [first])
  assert rollout.behavior_logprobs[0] == probe_rollout.behavior_logprobs[0]


def test_bad_inputs_fail_early_with_the_numbers(params):
  engine = SamplerEngine(MODEL, CFG, params[0])
  with pytest.raises(ValueError, match="prompt has 40 tokens.*at most 39"):
    engine.submit(Request(prompt_tokens=np.ones(40, np.int32), sample_id=0))
  with pytest.raises(ValueError, match="empty prompt"):
    Request(prompt_tokens=np.zeros(0, np.int32), sample_id=1)
  with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
    engine.submit(Request(prompt_tokens=np.array([3, 64]), sample_id=2))
  small = SamplerEngine(MODEL, dataclasses.replace(CFG, num_pages=3), params[0])
  with pytest.raises(ValueError, match="5 pages of 4, but the pool has only 3 pages; increase"):
    small.submit(Request(prompt_tokens=np.ones(10, np.int32), sample_id=3, max_new_tokens=8))
  with pytest.raises(ValueError, match="not newer"):
    engine.update_weights(WeightUpdate(0, params[1]))
  with pytest.raises(ValueError, match="layout"):
    engine.update_weights(WeightUpdate(
        1, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params[1])))
  with pytest.raises(ValueError, match="kv_policy"):
    SamplerConfig(kv_policy="discard")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    SamplerEngine(MODEL, dataclasses.replace(CFG, eos_id=64), params[0])
  with pytest.raises(ValueError, match="exceeds the model"):
    SamplerEngine(MODEL, dataclasses.replace(CFG, max_seq_len=41), params[0])
  capped = SamplerEngine(MODEL, CFG, params[0])  # a 39-token prompt leaves one position
  capped.submit(Request(prompt_tokens=np.arange(39, dtype=np.int32) % 64, sample_id=4))
  (r,) = capped.run_to_completion()
  assert r.num_completion_tokens == 1 and r.finish_reason == "capacity" and r.truncated


def test_abort_admission_filter_spans_and_virtual_clock(params):
  ticks = iter(range(10_000))
  spans = []
  allowed = {"odd": False}
  engine = SamplerEngine(
      MODEL, dataclasses.replace(CFG, decode_steps_per_dispatch=1), params[0],
      clock=lambda: float(next(ticks)),
      on_span=lambda *span: spans.append(span),
      admit_filter=lambda req: req.sample_id % 2 == 0 or allowed["odd"])
  for r in _requests(6, seed=5, budgets=(12, 12)):
    engine.submit(r)
  engine.step()
  running = {s.request.sample_id for s in engine.replicas[0].sched.running()}
  assert running and all(sid % 2 == 0 for sid in running) and engine.num_waiting == 6 - len(running)
  allowed["odd"] = True
  done = []
  for _ in range(3):
    done += engine.step()
  aborted = engine.abort_all()
  assert not done and len(aborted) == 6 and not engine.has_work
  assert {r.finish_reason for r in aborted} == {"aborted"}
  for r in aborted:
    if r.num_completion_tokens:
      assert r.t_admit < r.t_first_token < r.t_finish
      assert r.policy_versions.shape == r.behavior_logprobs.shape == (r.num_completion_tokens,)
    else:
      assert np.isnan(r.t_admit) and np.isnan(r.t_first_token)
  kinds = [s[1] for s in spans]
  assert kinds.count("decode") == 4 and "prefill" in kinds
  assert all(s[0] == "sampler" and s[2] < s[3] and s[5] == CFG.num_slots for s in spans)
  assert 0 < engine.stats().slot_occupancy <= 1
  engine.admit_filter = lambda req: False
  engine.submit(_requests(1)[0])
  with pytest.raises(RuntimeError, match="refuses all 1 waiting"):
    engine.run_to_completion()


def test_pool_is_sharded_over_tp_by_kv_heads(params):
  devices = jax.devices()[4:6]
  mesh = jax.sharding.Mesh(np.asarray(devices, dtype=object), ("tp",),
                           axis_types=(jax.sharding.AxisType.Auto,))
  cfg = dataclasses.replace(CFG, max_seq_len=16, min_prefill_bucket=16, max_new_tokens=6)
  layout = page_pool.PoolLayout.of(MODEL, cfg)
  assert layout.sharding(mesh).spec == jax.sharding.PartitionSpec("tp")
  odd = dataclasses.replace(MODEL, n_kv_heads=1, n_heads=3)  # 1 kv head: stays whole
  assert page_pool.PoolLayout.of(odd, cfg).sharding(mesh).spec == jax.sharding.PartitionSpec()
  on_mesh = jax.device_put(params[0], page_pool.replicated(mesh))
  engine = SamplerEngine(MODEL, cfg, on_mesh, mesh=mesh)
  assert engine.replicas[0].pools[0].sharding.spec[0] == "tp"
  for r in _requests(3, seed=6, prompt_lens=(1,), budgets=(6, 6)):  # decode only
    engine.submit(r)
  rollouts = engine.run_to_completion()
  assert engine.replicas[0].pools[0].sharding == layout.sharding(mesh)
  for r, ref in zip(rollouts, _reference(params[0], rollouts)):
    np.testing.assert_allclose(r.behavior_logprobs, ref, atol=1e-5, rtol=0)


def test_bf16_cache_on_cpu_is_stored_as_bits_and_matches_the_full_forward(params):
  """Issue #28: a bf16 pool on CPU is kept as uint16 bits (in-place writes, see
  test_in_place); the engine's log-probs still follow the fp32 full forward up to bf16 KV
  rounding."""
  cfg = dataclasses.replace(CFG, cache_dtype="bfloat16", num_pages=24)
  engine = SamplerEngine(MODEL, cfg, params[0])
  r = engine.replicas[0]
  assert r.layout.bits and all(p.dtype == jnp.uint16 for p in r.pools)
  for req in _requests(4, budgets=(6, 6)):
    engine.submit(req)
  rollouts = engine.run_to_completion()
  errs = [np.abs(r.behavior_logprobs - ref).max()
          for r, ref in zip(rollouts, _reference(params[0], rollouts))]
  assert 0 < max(errs) < 0.1, errs  # bf16 K/V rounding is visible, and small
