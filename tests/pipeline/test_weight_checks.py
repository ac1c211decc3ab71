"""Is the sampler really using the weights of the version it tags tokens with? (issue #14 item
10): exact layout-independent checksums, the engine's check after every swap, catching a channel
that lands old arrays and an engine that keeps old weights; a failed push can be retried.
Issue #27 item 3: the check reads what each decode dispatch was given (an engine whose dispatch
reads a stale copy is caught), and a step without lag-0 tokens says it compared nothing."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import model, param_checksum
from rlax_pipe import sharding as sh_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.pipeline import weight_channel as wc
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine
from rlax_pipe.sampler import weights as engine_weights
from rlax_pipe.types import WeightUpdate

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=48, max_seq_len=32)
CFG = SamplerConfig(num_slots=2, page_size=4, num_pages=16, max_seq_len=32, max_new_tokens=12,
                    min_prefill_bucket=16, decode_steps_per_dispatch=2,
                    sampling=SamplingConfig(temperature=1.0))


def _params(seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: rng.normal(0.0, 0.4, a.shape).astype(np.float32),
                      model.abstract_params(MODEL))


def _meshes():
  lmesh = sh_lib.make_mesh(jax.devices()[:4], {"fsdp": 2, "tp": 2}, sh_lib.LEARNER_RULES)
  smesh = sh_lib.make_mesh(jax.devices()[4:6], {"tp": 2}, sh_lib.SAMPLER_RULES)
  m = model.as_model(MODEL)
  abstract = m.abstract_params()
  lsh = sh_lib.logical_to_sharding(m.param_axes(), lmesh, sh_lib.LEARNER_RULES, abstract)
  ssh = sh_lib.logical_to_sharding(m.param_axes(), smesh, sh_lib.SAMPLER_RULES, abstract)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, ssh)
  return lsh, smesh, target


def test_checksum_is_exact_across_layouts_and_sees_a_permutation():
  tree = {"w": np.arange(48, dtype=np.float32).reshape(8, 6) / 7,
          "b": jnp.arange(16, dtype=jnp.bfloat16), "n": np.arange(5, dtype=np.int32),
          "flag": np.array(True)}
  want = param_checksum.host(param_checksum.checksum(tree))
  mesh = sh_lib.make_mesh(jax.devices()[:4], {"fsdp": 2, "tp": 2})
  spread = {"w": jax.device_put(tree["w"], jax.NamedSharding(mesh, jax.P("tp", "fsdp"))),
            "b": jax.device_put(tree["b"], jax.NamedSharding(mesh, jax.P(("fsdp", "tp")))),
            "n": tree["n"], "flag": tree["flag"]}
  np.testing.assert_array_equal(param_checksum.host(param_checksum.checksum(spread)), want)
  # Same values in another order (a transposed copy, a swapped pair): the leaf's sum changes.
  swapped = dict(tree, w=tree["w"].copy())
  swapped["w"][[0, 1]] = swapped["w"][[1, 0]]
  got = param_checksum.host(param_checksum.checksum(swapped))  # leaves b, flag, n, w
  assert got[3] != want[3] and np.array_equal(got[:3], want[:3])
  with pytest.raises(param_checksum.WeightMismatchError, match="version 7.*1 of 4 leaf"):
    param_checksum.compare(want, got, 7, names=["b", "flag", "n", "w"])


def _engine_with(channel, lsh, smesh, version_params):
  channel.push(WeightUpdate(0, jax.device_put(version_params, lsh)))
  engine = SamplerEngine(MODEL, CFG, channel.take(timeout=30), mesh=smesh)
  for i in range(2):
    engine.submit(Request(prompt_tokens=np.array([1, 5, 7]), sample_id=i))
  return engine


def test_a_channel_that_lands_old_arrays_under_a_new_version_is_caught(monkeypatch):
  lsh, smesh, target = _meshes()
  channel = wc.WeightChannel(target)
  v0, v1 = _params(0), _params(1)
  engine = _engine_with(channel, lsh, smesh, v0)
  engine.step()
  assert engine.weight_checks == 1  # the initial weights were checked too
  # A broken channel: version 1 lands version 0's values.
  real = channel._transfer  # pylint: disable=protected-access
  monkeypatch.setattr(channel, "_transfer",
                      lambda leaves: real(jax.tree.leaves(jax.device_put(v0, lsh))))
  channel.push(WeightUpdate(1, jax.device_put(v1, lsh)))
  engine.update_weights(channel.take(timeout=30))
  with pytest.raises(param_checksum.WeightMismatchError,
                     match=r"version 1 on the sampler engine's decode dispatch \(replica 0\) "
                           r"are not the learner's version 1"):
    for _ in range(3):
      engine.step()


def test_an_engine_that_keeps_decoding_with_old_weights_is_caught(monkeypatch):
  lsh, smesh, target = _meshes()
  channel = wc.WeightChannel(target)
  engine = _engine_with(channel, lsh, smesh, _params(0))
  engine.step()

  def stale_swap(self):  # a broken swap: new version number and checksum, old arrays
    with self.lock:
      pending, self.pending = self.pending, None
      if pending is None:
        return False
      self.running = WeightUpdate(pending.version, self.running.params, False, pending.checksum)
    return True

  monkeypatch.setattr(engine_weights.EngineWeights, "swap", stale_swap)
  channel.push(WeightUpdate(1, jax.device_put(_params(1), lsh)))
  engine.update_weights(channel.take(timeout=30))
  with pytest.raises(param_checksum.WeightMismatchError, match="version 1"):
    for _ in range(3):
      engine.step()


def _stale_views_swap(self):
  """A broken swap (issue #27 item 3): the engine stores the new version (running weights,
  version number, checksums) but its dispatches keep being given the old per-replica views."""
  with self.lock:
    pending, self.pending = self.pending, None
    if pending is None:
      return False
    self.running = pending  # self.views not refreshed: decode reads the old copy
  return True


def test_an_engine_whose_dispatch_reads_a_stale_copy_is_caught(monkeypatch):
  """The stored weights are right, so a check of them passes; the arrays the decode dispatch
  is given are not, and that is what the check reads now."""
  lsh, smesh, target = _meshes()
  channel = wc.WeightChannel(target)
  engine = _engine_with(channel, lsh, smesh, _params(0))
  engine.step()
  monkeypatch.setattr(engine_weights.EngineWeights, "swap", _stale_views_swap)
  channel.push(WeightUpdate(1, jax.device_put(_params(1), lsh)))
  engine.update_weights(channel.take(timeout=30))
  with pytest.raises(param_checksum.WeightMismatchError,
                     match=r"version 1 on the sampler engine's decode dispatch \(replica 0\)"):
    for _ in range(3):
      engine.step()
  # What the engine stores is the learner's version 1 (a check of it passes, as before #27):
  # only the dispatch read old arrays.
  running = engine.weights.running
  assert running.version == 1
  np.testing.assert_array_equal(param_checksum.host(param_checksum.checksum(running.params)),
                                param_checksum.host(running.checksum))


def test_a_version_that_never_ran_a_dispatch_is_checked_on_what_the_next_would_read(
    monkeypatch):
  lsh, smesh, target = _meshes()
  channel = wc.WeightChannel(target)
  engine = _engine_with(channel, lsh, smesh, _params(0))
  engine.step()
  channel.push(WeightUpdate(1, jax.device_put(_params(1), lsh)))
  engine.update_weights(channel.take(timeout=30))
  engine.check_weights()  # an engine about to stop: version 1 never decoded
  assert engine.weight_checks == 2 and engine.last_weight_check[0] == 1
  monkeypatch.setattr(engine_weights.EngineWeights, "swap", _stale_views_swap)
  channel.push(WeightUpdate(2, jax.device_put(_params(2), lsh)))
  engine.update_weights(channel.take(timeout=30))
  with pytest.raises(param_checksum.WeightMismatchError, match="version 2"):
    engine.check_weights()


def test_a_version_swapped_out_before_any_dispatch_is_checked():
  """An idle engine installs versions 1 and 2 without decoding: each is still checked (on what
  the next dispatch would have read) before it is swapped out, or when the engine stops."""
  lsh, smesh, target = _meshes()
  channel = wc.WeightChannel(target)
  engine = _engine_with(channel, lsh, smesh, _params(0))
  engine.run_to_completion()
  assert engine.weight_checks == 1
  for v in (1, 2):
    channel.push(WeightUpdate(v, jax.device_put(_params(v), lsh)))
    engine.update_weights(channel.take(timeout=30))
    engine.step()  # nothing to decode: the swap only
  assert engine.weight_checks == 2 and engine.last_weight_check[0] == 1
  engine.check_weights()
  assert engine.weight_checks == 3 and engine.last_weight_check[0] == 2


def test_a_reader_that_polls_late_gets_every_checked_version():
  """Several checks can complete between two reads (a replica process reports once per loop
  iteration; CI once saw version 4's check overwritten by version 5's before it was sent):
  `weight_checks_since` hands out each version with its checksums, not only the last."""
  lsh, smesh, target = _meshes()
  channel = wc.WeightChannel(target)
  engine = _engine_with(channel, lsh, smesh, _params(0))
  engine.run_to_completion()
  seen = engine.weight_checks
  assert [v for v, _ in engine.weight_checks_since(0)] == [0]
  for v in (1, 2, 3):
    channel.push(WeightUpdate(v, jax.device_put(_params(v), lsh)))
    engine.update_weights(channel.take(timeout=30))
    engine.step()
  engine.check_weights()
  got = engine.weight_checks_since(seen)
  assert [v for v, _ in got] == [1, 2, 3] and engine.last_weight_check[0] == 3
  for v, sums in got:
    np.testing.assert_array_equal(sums, param_checksum.host(param_checksum.checksum(_params(v))))
  assert engine.weight_checks_since(engine.weight_checks) == []


def test_a_correct_in_flight_update_passes_the_check():
  lsh, smesh, target = _meshes()
  channel = wc.WeightChannel(target)
  engine = _engine_with(channel, lsh, smesh, _params(0))
  engine.step()
  channel.push(WeightUpdate(1, jax.device_put(_params(1), lsh)))
  engine.update_weights(channel.take(timeout=30))
  for _ in range(3):
    engine.step()
  assert engine.version == 1 and engine.weight_checks == 2


def test_a_rejected_push_can_be_retried_with_the_same_version():
  lsh, _, target = _meshes()
  calls = []

  def verify(params, version):  # the receiver rejects the first copy of version 5
    calls.append(version)
    if len(calls) == 1:
      raise RuntimeError("probe logits differ")

  channel = wc.WeightChannel(target, verify=verify, debug=True)
  params = jax.device_put(_params(0), lsh)
  with pytest.raises(RuntimeError, match="probe logits differ"):
    channel.push(WeightUpdate(5, params))
  channel.push(WeightUpdate(5, params))  # the retry of version 5 is not refused as "not newer"
  channel.push(WeightUpdate(5, params))  # nor a second copy of the pending version (replaces it)
  update = channel.take(timeout=30)
  assert update.version == 5 and calls == [5, 5, 5]
  np.testing.assert_array_equal(param_checksum.host(update.checksum),
                                param_checksum.host(param_checksum.checksum(params)))
  with pytest.raises(ValueError, match="not newer than the version the sampler took"):
    channel.push(WeightUpdate(5, params))  # version 5 was taken: now it is old
  with pytest.raises(ValueError, match="not newer"):
    channel.push(WeightUpdate(4, params))


def test_lag0_logprob_mismatch_alarm():
  from rlax_pipe.pipeline import trainer  # pylint: disable=import-outside-toplevel
  # Issue #14 item 10: a sampler on the wrong weights drove the lag-0 mismatch to 0.37.
  assert trainer.lag0_alarm({"logp_mismatch_mean": np.float32(0.37)}, 0.05, 6) == {
      "lag0_logp_alarm": 1}
  # Measured on healthy runs: 0.0018 (stale-KV keep), 0.0022 (bf16 sampler).
  assert trainer.lag0_alarm({"logp_mismatch_mean": 0.0022}, 0.05, 6) == {"lag0_logp_alarm": 0}
  assert trainer.lag0_alarm({"logp_mismatch_mean": 0.37}, None, 6) == {}


@pytest.mark.parametrize("metrics", [
    {"logp_mismatch_mean": np.float32(np.nan), "mismatch_tokens": np.int32(0)},  # NaN mean
    {"mismatch_tokens": np.int32(0)},  # the learner drops statistics of nothing
    {"logp_mismatch_mean": np.float32(np.nan)},
    {},
])
def test_a_step_without_lag0_tokens_says_nothing_was_compared(metrics, caplog):
  """Issue #27 item 3: such a step reported alarm 0 (or a NaN mismatch) as if it had passed."""
  from rlax_pipe.pipeline import trainer  # pylint: disable=import-outside-toplevel
  with caplog.at_level(logging.DEBUG):  # debug: pipeline runs often have no lag-0 token
    assert trainer.lag0_alarm(metrics, 0.05, 6) == {"lag0_tokens": 0}
  assert "no lag-0 token" in caplog.text
  counted = {"logp_mismatch_mean": np.float32(0.01), "mismatch_tokens": np.int32(40)}
  assert trainer.lag0_alarm(counted, 0.05, 6) == {"lag0_tokens": 40, "lag0_logp_alarm": 0}
  counted["logp_mismatch_mean"] = np.float32(0.37)
  assert trainer.lag0_alarm(counted, 0.05, 6) == {"lag0_tokens": 40, "lag0_logp_alarm": 1}
