"""K-step dispatches: weight swaps at dispatch boundaries with exact tags, stop-id sets and finish
reasons, per-request abort, shared prompt pages, data replicas, one read-back per dispatch."""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine
from rlax_pipe.sampler.config import normalize_stop_ids
from rlax_pipe.types import WeightUpdate

from test_sampler_engine import (  # pylint: disable=wrong-import-order
    CFG, MODEL, _keep_reference, _reference, params)  # noqa: F401  (pytest fixture)

K_CFG = dataclasses.replace(CFG, num_pages=40, decode_steps_per_dispatch=4)


def _group(n, prompt, group_id=0, budget=12, first_id=0):
  return [Request(prompt_tokens=np.asarray(prompt, np.int32), sample_id=first_id + i,
                  group_id=group_id, max_new_tokens=budget) for i in range(n)]


def test_swap_arriving_mid_dispatch_lands_at_the_next_boundary(params, monkeypatch):
  engine = SamplerEngine(MODEL, K_CFG, params[0])
  replica = engine.replicas[0]
  launch = replica.launch
  arrivals = []

  def launch_then_receive(*args, **kwargs):  # the learner pushes while the dispatch runs
    out = launch(*args, **kwargs)
    if len(arrivals) < 2:
      t0 = time.perf_counter()
      engine.update_weights(WeightUpdate(len(arrivals) + 1, params[len(arrivals) + 1]))
      arrivals.append(time.perf_counter() - t0)
    return out

  monkeypatch.setattr(replica, "launch", launch_then_receive)
  for r in _group(2, [5, 9, 11], budget=14) + _group(1, [7], group_id=1, budget=14, first_id=2):
    engine.submit(r)
  rollouts = engine.run_to_completion()
  assert max(arrivals) < 0.05  # handing weights over never waits for the sampler
  assert engine.stats().weight_updates == 2
  for r in rollouts:  # 4 tokens per dispatch: v0 x4, v1 x4, v2 for the rest
    np.testing.assert_array_equal(r.policy_versions, [0] * 4 + [1] * 4 + [2] * 6)
    np.testing.assert_allclose(r.behavior_logprobs, _keep_reference(dict(enumerate(params)), r),
                               atol=1e-5, rtol=0)


def test_swaps_from_another_thread_keep_every_tag_exact(params):
  """A learner thread pushes versions at arbitrary times; each token's tag names the weights
  that produced it (log-probs match that version's keep-reference)."""
  engine = SamplerEngine(MODEL, dataclasses.replace(K_CFG, decode_steps_per_dispatch=3),
                         params[0])
  for i in range(4):
    engine.submit(Request(prompt_tokens=np.arange(1, 3 + i, dtype=np.int32), sample_id=i,
                          group_id=i, max_new_tokens=16))
  stop = threading.Event()

  def learner():
    for v in (1, 2):
      time.sleep(0.05)
      engine.update_weights(WeightUpdate(v, params[v]))
    stop.set()

  thread = threading.Thread(target=learner)
  thread.start()
  rollouts = []
  while engine.has_work:
    rollouts += engine.step()
    time.sleep(0.01)
  thread.join()
  by_version = dict(enumerate(params))
  for r in rollouts:
    assert np.all(np.diff(r.policy_versions) >= 0)
    np.testing.assert_allclose(r.behavior_logprobs, _keep_reference(by_version, r), atol=1e-5,
                               rtol=0)


def test_stop_id_set_and_finish_reasons(params):
  assert SamplerConfig(eos_id=3).stop_ids == (3,)
  assert SamplerConfig(eos_id=(4, 3, 3)).stop_ids == (3, 4)
  assert SamplerConfig().stop_ids == () and normalize_stop_ids(np.int64(5)) == (5,)
  with pytest.raises(ValueError, match="integers"):
    SamplerConfig(eos_id=("x",))
  with pytest.raises(ValueError, match=">= 0"):
    SamplerConfig(eos_id=(1, -1))
  request = Request(prompt_tokens=np.array([5, 6, 7], np.int32), sample_id=0, max_new_tokens=20)
  probe = SamplerEngine(MODEL, K_CFG, params[0])
  probe.submit(request)
  (free,) = probe.run_to_completion()
  assert free.finish_reason == "length" and free.num_completion_tokens == 20
  toks = free.completion_tokens.tolist()
  first, later = toks[2], next(t for t in toks[6:] if t not in toks[:6])
  stops = (later, first)  # any id of the set ends the completion at its first occurrence
  engine = SamplerEngine(MODEL, dataclasses.replace(K_CFG, eos_id=stops), params[0])
  engine.submit(request)
  (r,) = engine.run_to_completion()
  end = min(toks.index(first), toks.index(later)) + 1
  assert r.finish_reason == "eos" and r.num_completion_tokens == end
  np.testing.assert_array_equal(r.completion_tokens, toks[:end])  # nothing after the stop id
  capped = SamplerEngine(MODEL, K_CFG, params[0])
  capped.submit(dataclasses.replace(request, max_new_tokens=60))  # max_seq_len 40 comes first
  (c,) = capped.run_to_completion()
  assert c.finish_reason == "capacity" and c.num_completion_tokens == 37 and c.truncated


def test_abort_one_request(params):
  engine = SamplerEngine(MODEL, dataclasses.replace(K_CFG, num_slots=2), params[0])
  for r in _group(4, [1, 2, 3], budget=20):
    engine.submit(r)
  engine.step()
  running = {s.request.sample_id for s in engine.replicas[0].sched.running()}
  waiting = {s.request.sample_id for s in engine.replicas[0].sched.waiting}
  a = engine.abort(min(running))
  b = engine.abort(min(waiting))
  assert a.finish_reason == b.finish_reason == "aborted"
  assert a.num_completion_tokens == 4 and b.num_completion_tokens == 0
  assert engine.abort(min(running)) is None and engine.abort(99) is None
  rest = engine.run_to_completion()
  assert sorted(r.sample_id for r in rest) == sorted((running | waiting)
                                                    - {a.sample_id, b.sample_id})
  alloc = engine.replicas[0].alloc
  alloc.check()
  assert alloc.num_free == K_CFG.num_pages and engine.stats().aborted == 2


@pytest.mark.parametrize("share", [True, False])
def test_group_shares_its_prompt_pages(params, share):
  """8 samples of one 10-token prompt (page size 4: 2 full pages + a partial one): prefilled
  once, full pages shared, partial page copied per sample; log-probs exact either way."""
  cfg = dataclasses.replace(K_CFG, num_slots=8, share_prompt_pages=share)
  engine = SamplerEngine(MODEL, cfg, params[0])
  for r in _group(8, np.arange(3, 13), group_id=7, budget=6):
    engine.submit(r)
  engine.step()
  alloc = engine.replicas[0].alloc
  seqs = engine.replicas[0].sched.running()
  first_pages = {alloc.pages_of(s.uid)[:2] for s in seqs}
  stats = engine.stats()
  if share:
    assert len(first_pages) == 1 and stats.prefill_tokens == 9
    assert stats.shared_prompt_copies == 7
    assert all(alloc.refcount(p) == 9 for p in next(iter(first_pages)))  # 8 samples + entry
  else:
    assert len(first_pages) == 8 and stats.prefill_tokens == 8 * 9
  rollouts = engine.run_to_completion()
  for r, ref in zip(rollouts, _reference(params[0], rollouts)):
    np.testing.assert_allclose(r.behavior_logprobs, ref, atol=1e-5, rtol=0)
  alloc.check()
  assert alloc.num_free == cfg.num_pages and not engine.replicas[0].sharing.entries


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_data_replicas_decode_disjoint_sequences(params):
  """A ("data": 2, "tp": 1) mesh runs two replicas with their own slots and pools: twice the
  sequences per decode step, each sample on exactly one replica, parity with the reference."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]).reshape(2, 1), ("data", "tp"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)
  on_mesh = jax.device_put(params[0],
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  requests = [Request(prompt_tokens=np.arange(1, 4 + i % 3, dtype=np.int32), sample_id=i,
                      group_id=i, max_new_tokens=8) for i in range(8)]

  def run(engine):
    for r in requests:
      engine.submit(r)
    engine.step()
    owners = [{s.request.sample_id for s in r.sched.running()} for r in engine.replicas]
    rollouts = engine.run_to_completion()
    return owners, rollouts, engine.stats()

  owners, rollouts, two = run(SamplerEngine(MODEL, K_CFG, on_mesh, mesh=mesh))
  assert len(owners) == 2 and owners[0] and owners[1] and not owners[0] & owners[1]
  assert sorted(r.sample_id for r in rollouts) == list(range(8))
  for r, ref in zip(rollouts, _reference(params[0], rollouts)):
    np.testing.assert_allclose(r.behavior_logprobs, ref, atol=1e-5, rtol=0)
  _, _, one = run(SamplerEngine(MODEL, K_CFG, params[0]))
  ratio = (two.generated_tokens / two.decode_steps) / (one.generated_tokens / one.decode_steps)
  assert ratio >= 1.9, ratio


def test_one_read_back_per_dispatch(params):
  engine = SamplerEngine(MODEL, K_CFG, params[0])
  engine.warmup()
  with jax.transfer_guard_device_to_host("disallow"):  # only the explicit read-back is allowed
    for r in _group(3, [4, 5], budget=16):
      engine.submit(r)
    rollouts = engine.run_to_completion()
  stats = engine.stats()
  assert len(rollouts) == 3 and stats.host_syncs == stats.dispatches
  assert stats.decode_steps >= 4 * (stats.dispatches - 1)  # K = 4 steps per dispatch


def test_run_config_samples_stop_on_the_shipped_tokenizers_stop_ids():
  """#14 item 1: with the library defaults a completion ends at the shipped tokenizer's EOS:
  RunConfig().sampler.eos_id is empty, and the job fills it from the run's tokenizer and model."""
  # pylint: disable=import-outside-toplevel
  from rlax_pipe.model import Transformer
  from rlax_pipe.pipeline import job as job_lib
  from rlax_pipe.pipeline.run import RunConfig
  from rlax_pipe.tokenizer import default_tokenizer
  cfg, tok = RunConfig(), default_tokenizer()
  assert cfg.sampler.stop_ids == ()
  model_cfg, _ = job_lib.load_initial_params(cfg.init)
  stops = normalize_stop_ids(job_lib.stop_ids_for(cfg, tok, Transformer(model_cfg)))
  assert tok.eos_id in stops and set(tok.stop_ids) <= set(stops)
