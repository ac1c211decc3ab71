"""Tests for the device-to-device, versioned weight channel."""

import threading

import jax
from jax._src import array as jax_array
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import sharding as sh_lib
from rlax_pipe.pipeline import weight_channel as wc
from rlax_pipe.types import WeightUpdate

AXES = {
    "embed": ("vocab", "embed"),
    "layers": {"wq": ("layers", "embed", "heads", "head_dim"),
               "w_up": ("layers", "embed", "mlp")},
    "norm": ("embed",),
    "step_count": (),
}


def _abstract():
  f32 = np.float32
  return {
      "embed": jax.ShapeDtypeStruct((16, 8), f32),
      "layers": {"wq": jax.ShapeDtypeStruct((2, 8, 4, 4), f32),
                 "w_up": jax.ShapeDtypeStruct((2, 8, 12), jnp.bfloat16)},
      "norm": jax.ShapeDtypeStruct((8,), f32),
      "step_count": jax.ShapeDtypeStruct((), np.int32),
  }


def _values(seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: np.asarray(rng.normal(size=s.shape) * 100).astype(s.dtype), _abstract())


def _setup(learner_devs, learner_axes, sampler_devs, sampler_axes):
  lmesh = sh_lib.make_mesh(learner_devs, learner_axes, sh_lib.LEARNER_RULES)
  smesh = sh_lib.make_mesh(sampler_devs, sampler_axes, sh_lib.SAMPLER_RULES)
  abstract = _abstract()
  lsh = sh_lib.logical_to_sharding(AXES, lmesh, sh_lib.LEARNER_RULES, abstract)
  ssh = sh_lib.logical_to_sharding(AXES, smesh, sh_lib.SAMPLER_RULES, abstract)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, ssh)
  return lsh, ssh, target


@pytest.fixture
def host_reads(monkeypatch):
  """Counts host materialisations of jax arrays (ArrayImpl._value)."""
  calls = []
  original = jax_array.ArrayImpl._value

  def counting(self):
    calls.append(self.shape)
    return original.fget(self)

  monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(counting))
  return calls


def _push_and_check(lsh, ssh, target, host_reads):
  values = _values(0)
  params = jax.device_put(values, lsh)
  jax.block_until_ready(params)
  channel = wc.WeightChannel(target)
  host_reads.clear()
  channel.push(WeightUpdate(1, params))
  got = channel.take(timeout=10)
  jax.block_until_ready(got.params)
  assert host_reads == [], f"host round trip for leaves of shape {host_reads}"
  assert got.version == 1
  for leaf, sh in zip(jax.tree.leaves(got.params), jax.tree.leaves(ssh)):
    assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)
    assert {d.id for d in leaf.devices()} == {d.id for d in sh.device_set}
  for got_leaf, want in zip(jax.tree.leaves(got.params), jax.tree.leaves(values)):
    np.testing.assert_array_equal(np.asarray(got_leaf), want)  # bitwise (exact) equality
  return channel, params, got


def test_counter_detects_naive_cross_mesh_device_put(host_reads):
  lsh, ssh, _ = _setup(jax.devices()[:4], {"fsdp": 2, "tp": 2}, jax.devices()[4:], {"tp": 4})
  x = jax.device_put(_values(0)["embed"], lsh["embed"])
  host_reads.clear()
  jax.block_until_ready(jax.device_put(x, ssh["embed"]))
  assert host_reads, "the counter must see the host fallback of a non-congruent device_put"


def test_push_2x2_to_4way_tp_is_device_to_device(host_reads):
  lsh, ssh, target = _setup(jax.devices()[:4], {"fsdp": 2, "tp": 2}, jax.devices()[4:], {"tp": 4})
  assert lsh["layers"]["wq"].spec != ssh["layers"]["wq"].spec
  _push_and_check(lsh, ssh, target, host_reads)


def test_push_4_to_2_devices(host_reads):
  lsh, ssh, target = _setup(jax.devices()[:4], {"fsdp": 2, "tp": 2}, jax.devices()[6:], {"tp": 2})
  _push_and_check(lsh, ssh, target, host_reads)


@pytest.mark.parametrize("sampler_axes,num_refined", [({"data": 2, "tp": 2}, 0), ({"tp": 4}, 3)])
def test_push_2_to_4_devices(host_reads, sampler_axes, num_refined):
  lsh, ssh, target = _setup(jax.devices()[:2], {"fsdp": 2}, jax.devices()[4:], sampler_axes)
  channel, _, _ = _push_and_check(lsh, ssh, target, host_reads)
  (plans, _, _, _, hop3), = channel._plans.values()  # pylint: disable=protected-access
  # 4 distinct tp shards (embed, wq, w_up) cannot come from 2 learner devices: land 2, slice.
  assert sum(p.refine for p in plans) == num_refined and (hop3 is None) == (num_refined == 0)


def test_same_device_shared_copy_is_independent(host_reads):
  dev = jax.devices()[:1]
  lsh, ssh, target = _setup(dev, {"fsdp": 1}, dev, {"tp": 1})
  _, params, update = _push_and_check(lsh, ssh, target, host_reads)
  want = np.asarray(update.params["embed"])
  jax.tree.map(lambda x: x.delete(), params)  # the learner donates / drops its copy
  np.testing.assert_array_equal(np.asarray(update.params["embed"]), want)


def test_congruence_check_rejects_mismatch():
  a = sh_lib.make_mesh(jax.devices()[:4], {"fsdp": 2, "tp": 2}, sh_lib.LEARNER_RULES)
  b = sh_lib.make_mesh(jax.devices()[4:], {"tp": 4}, sh_lib.SAMPLER_RULES)
  src = jax.sharding.NamedSharding(a, jax.P("fsdp", "tp"))
  dst = jax.sharding.NamedSharding(b, jax.P(None, "tp"))
  with pytest.raises(RuntimeError, match="not congruent"):
    wc.assert_congruent(src, dst, (8, 8), "w")


def test_versions_and_ownership():
  lsh, _, target = _setup(jax.devices()[:4], {"fsdp": 2, "tp": 2}, jax.devices()[4:], {"tp": 4})
  channel = wc.WeightChannel(target)
  assert channel.try_take() is None and channel.stats().current_version == -1
  p1 = jax.device_put(_values(1), lsh)
  channel.push(WeightUpdate(1, p1))
  first_incoming = channel._pending.leaves  # pylint: disable=protected-access
  # supersedes version 1 before it is taken:
  channel.push(WeightUpdate(2, jax.device_put(_values(2), lsh)))
  assert all(x.is_deleted() for x in first_incoming)
  taken2 = channel.take(timeout=10)
  assert taken2.version == 2 and taken2.donated and channel.stats().superseded == 1
  np.testing.assert_array_equal(np.asarray(taken2.params["norm"]), _values(2)["norm"])
  channel.push(WeightUpdate(3, jax.device_put(_values(3), lsh)))
  taken3 = channel.take(timeout=10)
  assert taken3.version == 3
  # A taken version belongs to its receiver: the channel never deletes it (the engine does,
  # when a newer version replaces it: tests/sampler/test_engine_state.py).
  assert not any(x.is_deleted() for x in jax.tree.leaves(taken2.params))
  assert not any(x.is_deleted() for x in jax.tree.leaves(p1))  # learner copies untouched
  with pytest.raises(ValueError, match="not newer"):
    channel.push(WeightUpdate(3, jax.device_put(_values(4), lsh)))
  s = channel.stats()
  assert (s.pushes, s.takes, s.current_version, s.pending_version) == (3, 2, 3, -1)
  assert s.bytes_per_version == 16 * 8 * 4 + 2 * 8 * 4 * 4 * 4 + 2 * 8 * 12 * 2 + 8 * 4 + 4
  with pytest.raises(TimeoutError, match="holds version 3"):
    channel.take(timeout=0.01)


def test_try_take_waits_for_readiness(monkeypatch):
  lsh, _, target = _setup(jax.devices()[:4], {"fsdp": 2, "tp": 2}, jax.devices()[4:], {"tp": 4})
  channel = wc.WeightChannel(target)
  channel.push(WeightUpdate(1, jax.device_put(_values(1), lsh)))
  monkeypatch.setattr(wc, "_all_ready", lambda arrays: False)
  assert channel.try_take() is None
  monkeypatch.undo()
  jax.block_until_ready(channel._pending.leaves)  # pylint: disable=protected-access
  assert channel.try_take().version == 1 and channel.try_take() is None


def test_second_push_does_not_recompile():
  lsh, _, target = _setup(jax.devices()[:4], {"fsdp": 2, "tp": 2}, jax.devices()[4:], {"tp": 4})
  channel = wc.WeightChannel(target)
  for v in range(1, 4):
    channel.push(WeightUpdate(v, jax.device_put(_values(v), lsh)))
    channel.take(timeout=10)
  (plans, _, hop1, _, hop3), = channel._plans.values()  # pylint: disable=protected-access
  assert hop1 is not None and hop1._cache_size() == 1  # pylint: disable=protected-access
  assert hop3 is None


def test_manifest_errors_name_the_leaf():
  lsh, _, target = _setup(jax.devices()[:4], {"fsdp": 2, "tp": 2}, jax.devices()[4:], {"tp": 4})
  channel = wc.WeightChannel(target)
  good = _values(0)
  bad_shape = dict(good, norm=np.zeros((9,), np.float32))
  with pytest.raises(wc.ManifestError, match=r"\['norm'\] has shape \(9,\)"):
    channel.push(WeightUpdate(1, bad_shape))
  bad_dtype = dict(good, layers=dict(good["layers"], w_up=good["layers"]["w_up"].astype(
      np.float32)))
  with pytest.raises(wc.ManifestError, match=r"\['layers'\]\['w_up'\].*dtype float32.*bfloat16"):
    channel.push(WeightUpdate(1, bad_dtype))
  missing = {k: v for k, v in good.items() if k != "norm"}
  with pytest.raises(wc.ManifestError, match=r"missing leaves \[\"\['norm'\]\"\]"):
    channel.push(WeightUpdate(1, missing))
  # a failed push did not consume the version:
  channel.push(WeightUpdate(1, jax.device_put(good, lsh)))
  assert channel.take(timeout=10).version == 1


def test_target_needs_named_shardings():
  with pytest.raises(TypeError, match="NamedSharding"):
    wc.WeightChannel({"w": jax.ShapeDtypeStruct((2,), np.float32)})


def test_debug_verify_hook():
  lsh, _, target = _setup(jax.devices()[:4], {"fsdp": 2, "tp": 2}, jax.devices()[4:], {"tp": 4})
  seen = []

  def verify(sampler_params, version):
    seen.append(version)
    # Toy probe: the sampler copy must reproduce a reference computed on the host.
    got = np.asarray(jnp.tanh(sampler_params["norm"]))
    want = np.asarray(jnp.tanh(_values(version)["norm"]))
    if not np.array_equal(got, want):
      raise AssertionError(f"probe mismatch at version {version}")

  quiet = wc.WeightChannel(target, verify=verify, debug=False)
  quiet.push(WeightUpdate(1, jax.device_put(_values(1), lsh)))
  assert seen == []
  channel = wc.WeightChannel(target, verify=verify, debug=True)
  channel.push(WeightUpdate(1, jax.device_put(_values(1), lsh)))
  channel.push(WeightUpdate(2, jax.device_put(_values(2), lsh)))
  assert seen == [1, 2]
  with pytest.raises(AssertionError, match="probe mismatch at version 3"):
    channel.push(WeightUpdate(3, jax.device_put(_values(4), lsh)))  # wrong weights for version 3
  assert channel.take(timeout=10).version == 2  # the failed version was discarded


def test_threaded_push_and_poll():
  lsh, _, target = _setup(jax.devices()[:4], {"fsdp": 2, "tp": 2}, jax.devices()[4:], {"tp": 4})
  channel = wc.WeightChannel(target)
  versions = [jax.device_put(_values(v), lsh) for v in range(6)]
  taken = []

  def sampler():
    while not taken or taken[-1] < 5:
      w = channel.try_take()
      if w is not None:
        taken.append(w.version)
        assert float(w.params["norm"][0]) == float(_values(w.version)["norm"][0])

  t = threading.Thread(target=sampler)
  t.start()
  for v, p in enumerate(versions):
    channel.push(WeightUpdate(v, p))
  t.join(timeout=30)
  assert not t.is_alive()
  assert taken == sorted(taken) and taken[-1] == 5
  s = channel.stats()
  assert s.takes + s.superseded == 6


MOE_AXES = {"moe_layers": {"experts_gate": ("layers", "expert", "embed", "mlp"),
                           "experts_down": ("layers", "expert", "mlp", "embed"),
                           "router": ("layers", "embed", "expert")},
            "embed": ("vocab", "embed")}


@pytest.mark.parametrize("sampler_axes", [{"tp": 4}, {"expert": 2, "tp": 2}, {"data": 2,
                                                                              "expert": 2}],
                         ids=["tp4", "expert2_tp2", "data2_expert2"])
def test_expert_sharded_learner_weights_reach_another_sampler_layout(host_reads, sampler_axes):
  """MoE weights stored split over expert x fsdp on the learner land on a sampler mesh laid
  out otherwise (experts whole and split over tp, or split over its own expert axis), device
  to device and bit for bit."""
  f32 = np.float32
  abstract = {"moe_layers": {"experts_gate": jax.ShapeDtypeStruct((2, 4, 8, 12), f32),
                             "experts_down": jax.ShapeDtypeStruct((2, 4, 12, 8), f32),
                             "router": jax.ShapeDtypeStruct((2, 8, 4), f32)},
              "embed": jax.ShapeDtypeStruct((16, 8), f32)}
  lmesh = sh_lib.make_mesh(jax.devices()[:4], {"expert": 2, "fsdp": 2}, sh_lib.LEARNER_RULES)
  smesh = sh_lib.make_mesh(jax.devices()[4:], sampler_axes, sh_lib.SAMPLER_RULES)
  lsh = sh_lib.logical_to_sharding(MOE_AXES, lmesh, sh_lib.LEARNER_RULES, abstract)
  ssh = sh_lib.logical_to_sharding(MOE_AXES, smesh, sh_lib.SAMPLER_RULES, abstract)
  assert lsh["moe_layers"]["experts_gate"].spec == jax.sharding.PartitionSpec(
      None, "expert", "fsdp", None)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, ssh)
  rng = np.random.default_rng(0)
  values = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), abstract)
  params = jax.block_until_ready(jax.device_put(values, lsh))
  channel = wc.WeightChannel(target)
  host_reads.clear()
  channel.push(WeightUpdate(3, params))
  got = channel.take(timeout=10)
  jax.block_until_ready(got.params)
  assert host_reads == [], f"host round trip for leaves of shape {host_reads}"
  for leaf, sh in zip(jax.tree.leaves(got.params), jax.tree.leaves(ssh)):
    assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)
  for got_leaf, want in zip(jax.tree.leaves(got.params), jax.tree.leaves(values)):
    np.testing.assert_array_equal(np.asarray(got_leaf), want)
  channel.close()
