"""Tests for rlax_pipe.sharding: device split, the mesh builder, logical-axis rules per role."""

import jax
from jax.sharding import AxisType, PartitionSpec as P
import numpy as np
import pytest

from rlax_pipe import sharding as shd

LEARNER, SAMPLER, CACHE = shd.LEARNER_RULES, shd.SAMPLER_RULES, shd.CACHE_RULES


def _learner_mesh(devices=None, axes=None):
  devices = jax.devices()[:4] if devices is None else devices
  return shd.make_mesh(devices, axes or {"fsdp": 2, "tp": 2}, LEARNER)


def test_split_devices_learner_first():
  split = shd.split_devices(jax.devices(), num_sampler=4, num_learner=4)
  assert [d.id for d in split.learner] == [0, 1, 2, 3]
  assert [d.id for d in split.sampler] == [4, 5, 6, 7]
  assert not split.shared


def test_split_devices_too_many_lists_devices():
  with pytest.raises(ValueError, match=r"8 device\(s\) found \(8 x cpu:cpu\)"):
    shd.split_devices(jax.devices(), num_sampler=6, num_learner=4)
  with pytest.raises(ValueError, match=">= 1"):
    shd.split_devices(jax.devices(), num_sampler=0, num_learner=4)


def test_split_single_device_shares_and_logs(caplog):
  dev = jax.devices()[:1]
  with caplog.at_level("INFO"):
    split = shd.split_devices(dev, num_sampler=1, num_learner=1)
  assert split.shared and split.learner == split.sampler == tuple(dev)
  assert any("share" in r.getMessage() for r in caplog.records)
  with pytest.raises(ValueError, match="single device"):
    shd.split_devices(dev, num_sampler=2, num_learner=2)


def test_meshes_are_auto_and_on_given_devices():
  split = shd.split_devices(jax.devices(), 4, 4)
  lm = _learner_mesh(split.learner)
  sm = shd.make_mesh(split.sampler, {"data": 2, "tp": 2}, SAMPLER)
  assert lm.axis_types == (AxisType.Auto,) * 2 and sm.axis_types == (AxisType.Auto,) * 2
  assert dict(lm.shape) == {"fsdp": 2, "tp": 2} and dict(sm.shape) == {"data": 2, "tp": 2}
  assert {d.id for d in lm.devices.flat} == {0, 1, 2, 3}
  assert {d.id for d in sm.devices.flat} == {4, 5, 6, 7}
  with pytest.raises(ValueError, match="needs 8 devices"):
    shd.make_mesh(split.learner, {"fsdp": 4, "tp": 2})
  with pytest.raises(ValueError, match=r"axes \['fsdp'\] are not used by the rules"):
    shd.make_mesh(split.sampler, {"fsdp": 4}, SAMPLER)


def test_keep_device_order_lays_devices_out_row_major():
  devs = jax.devices()[::-1][:4]
  mesh = shd.make_mesh(devs, {"a": 2, "b": 2}, keep_device_order=True)
  assert [d.id for d in mesh.devices.flat] == [d.id for d in devs]
  assert mesh.axis_types == (AxisType.Auto,) * 2


def test_logical_to_spec_rules_and_divisibility():
  lm = _learner_mesh()
  sm = shd.make_mesh(jax.devices()[4:], {"data": 2, "tp": 2}, SAMPLER)
  axes = ("layers", "embed", "heads", "head_dim")
  assert shd.logical_to_spec(axes, (2, 8, 4, 16), lm, LEARNER) == P(None, "fsdp", "tp", None)
  assert shd.logical_to_spec(axes, (2, 8, 4, 16), sm, SAMPLER) == P(None, None, "tp", None)
  # 3 kv heads do not divide over tp=2: that dim is replicated.
  assert shd.logical_to_spec(("embed", "kv_heads"), (8, 3), lm, LEARNER) == P("fsdp", None)
  # batch maps to (data, fsdp); data is absent on this mesh, so fsdp only.
  assert shd.logical_to_spec(("batch", None), (4, 5), lm, LEARNER) == P("fsdp", None)
  # a mesh axis splits at most one dim: the second "mlp" stays whole.
  assert shd.logical_to_spec(("mlp", "mlp"), (4, 4), lm, LEARNER) == P("tp", None)
  # canonical form drops trailing replicated dims (as jit reports output shardings).
  assert shd.logical_to_spec(("mlp", "embed", "layers"), (4, 3, 2), lm, LEARNER,
                             canonical=True) == P("tp")
  with pytest.raises(ValueError, match="unknown logical axis 'embd'"):
    shd.logical_to_spec(("embd",), (4,), lm, LEARNER)
  with pytest.raises(ValueError, match="rank 2"):
    shd.logical_to_spec(("embed", "mlp"), (4,), lm, LEARNER)


def test_multi_axis_rule_uses_longest_dividing_prefix():
  mesh = _learner_mesh(jax.devices(), {"data": 2, "fsdp": 2, "tp": 2})
  assert shd.logical_to_spec(("batch",), (8,), mesh, LEARNER) == P(("data", "fsdp"))
  assert shd.logical_to_spec(("batch",), (6,), mesh, LEARNER) == P("data")
  assert shd.logical_to_spec(("batch",), (3,), mesh, LEARNER) == P(None)


def test_cache_rules_split_kv_heads_like_the_sampler_weights_and_keep_pages_whole():
  sm = shd.make_mesh(jax.devices()[4:], {"data": 2, "tp": 2}, SAMPLER)
  pool_axes = ("layers", "kv_heads", "pages", "page_size", "head_dim")
  assert shd.logical_to_spec(pool_axes, (2, 4, 64, 16, 8), sm, CACHE, canonical=True) == P(
      None, "tp")
  # The k / v projections and the pool split kv heads the same way: attention needs no reshard.
  assert CACHE["kv_heads"] == SAMPLER["kv_heads"]
  # Weight tables do not know cache axes, and the cache table does not know batch axes.
  with pytest.raises(ValueError, match="unknown logical axis 'pages'"):
    shd.logical_to_spec(pool_axes, (2, 4, 64, 16, 8), sm, SAMPLER)
  with pytest.raises(ValueError, match="unknown logical axis 'batch'"):
    shd.logical_to_spec(("batch",), (4,), sm, CACHE)
  # Every role table only uses declared logical and mesh axis names.
  for rules in (LEARNER, SAMPLER, CACHE):
    assert set(rules) <= set(shd.LOGICAL_AXES)
    assert {a for axes in rules.values() for a in axes} <= {shd.DATA, shd.FSDP, shd.TP,
                                                               shd.EXPERT_AXIS}


def test_logical_to_sharding_tree():
  mesh = _learner_mesh()
  axes = {"embed": ("vocab", "embed"), "layers": [{"wq": ("layers", "embed", "heads", None)}],
          "scale": ()}
  shapes = {"embed": jax.ShapeDtypeStruct((10, 8), np.float32),
            "layers": [{"wq": jax.ShapeDtypeStruct((2, 8, 4, 16), np.float32)}],
            "scale": jax.ShapeDtypeStruct((), np.float32)}
  sh = shd.logical_to_sharding(axes, mesh, LEARNER, shapes)
  assert sh["embed"].spec == P("tp", "fsdp")
  assert sh["layers"][0]["wq"].spec == P(None, "fsdp", "tp", None)
  assert sh["scale"].spec == P() and sh["scale"].mesh == mesh
  assert sh["scale"] == shd.replicated(mesh)
  # The shardings place real arrays.
  x = jax.device_put(np.zeros((10, 8), np.float32), sh["embed"])
  assert x.sharding.spec == P("tp", "fsdp")
  with pytest.raises(ValueError, match=r"\['layers'\]\[0\]\['wq'\].*rank"):
    shd.logical_to_sharding({"layers": [{"wq": ("layers", "embed")}]}, mesh, LEARNER,
                            {"layers": [{"wq": (2, 8, 4)}]})
