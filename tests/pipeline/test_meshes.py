"""Tests for device splitting, mesh building and logical-axis sharding rules."""

import jax
from jax.sharding import AxisType, PartitionSpec as P
import numpy as np
import pytest

from rlax_pipe.pipeline import meshes


def test_split_devices_learner_first():
  split = meshes.split_devices(jax.devices(), num_sampler=4, num_learner=4)
  assert [d.id for d in split.learner] == [0, 1, 2, 3]
  assert [d.id for d in split.sampler] == [4, 5, 6, 7]
  assert not split.shared


def test_split_devices_too_many_lists_devices():
  with pytest.raises(ValueError, match=r"8 device\(s\) found \(8 x cpu:cpu\)"):
    meshes.split_devices(jax.devices(), num_sampler=6, num_learner=4)
  with pytest.raises(ValueError, match=">= 1"):
    meshes.split_devices(jax.devices(), num_sampler=0, num_learner=4)


def test_split_single_device_shares_and_logs(caplog):
  dev = jax.devices()[:1]
  with caplog.at_level("INFO"):
    split = meshes.split_devices(dev, num_sampler=1, num_learner=1)
  assert split.shared and split.learner == split.sampler == tuple(dev)
  assert any("share" in r.getMessage() for r in caplog.records)
  with pytest.raises(ValueError, match="single device"):
    meshes.split_devices(dev, num_sampler=2, num_learner=2)


def test_meshes_are_auto_and_on_given_devices():
  split = meshes.split_devices(jax.devices(), 4, 4)
  lm = meshes.make_learner_mesh(split.learner, {"fsdp": 2, "tp": 2})
  sm = meshes.make_sampler_mesh(split.sampler, {"data": 2, "tp": 2})
  assert lm.axis_types == (AxisType.Auto,) * 2 and sm.axis_types == (AxisType.Auto,) * 2
  assert dict(lm.shape) == {"fsdp": 2, "tp": 2} and dict(sm.shape) == {"data": 2, "tp": 2}
  assert {d.id for d in lm.devices.flat} == {0, 1, 2, 3}
  assert {d.id for d in sm.devices.flat} == {4, 5, 6, 7}
  with pytest.raises(ValueError, match="needs 8 devices"):
    meshes.make_mesh(split.learner, {"fsdp": 4, "tp": 2})
  with pytest.raises(ValueError, match="not used by the sampler rules"):
    meshes.make_sampler_mesh(split.sampler, {"fsdp": 4})


def test_logical_to_spec_rules_and_divisibility():
  lm = meshes.make_learner_mesh(jax.devices()[:4], {"fsdp": 2, "tp": 2})
  sm = meshes.make_sampler_mesh(jax.devices()[4:], {"data": 2, "tp": 2})
  axes = ("layers", "embed", "heads", "head_dim")
  assert meshes.logical_to_spec(axes, (2, 8, 4, 16), lm, meshes.LEARNER_RULES) == P(
      None, "fsdp", "tp", None)
  assert meshes.logical_to_spec(axes, (2, 8, 4, 16), sm, meshes.SAMPLER_RULES) == P(
      None, None, "tp", None)
  # 3 kv heads do not divide over tp=2: that dim is replicated.
  assert meshes.logical_to_spec(("embed", "kv_heads"), (8, 3), lm, meshes.LEARNER_RULES) == P(
      "fsdp", None)
  # batch maps to (data, fsdp); data is absent on this mesh, so fsdp only.
  assert meshes.logical_to_spec(("batch", None), (4, 5), lm, meshes.LEARNER_RULES) == P("fsdp", None)
  # a mesh axis splits at most one dim: the second "mlp" stays whole.
  assert meshes.logical_to_spec(("mlp", "mlp"), (4, 4), lm, meshes.LEARNER_RULES) == P(
      "tp", None)
  with pytest.raises(ValueError, match="unknown logical axis 'embd'"):
    meshes.logical_to_spec(("embd",), (4,), lm, meshes.LEARNER_RULES)
  with pytest.raises(ValueError, match="rank 2"):
    meshes.logical_to_spec(("embed", "mlp"), (4,), lm, meshes.LEARNER_RULES)


def test_multi_axis_rule_uses_longest_dividing_prefix():
  mesh = meshes.make_learner_mesh(jax.devices(), {"data": 2, "fsdp": 2, "tp": 2})
  rules = meshes.LEARNER_RULES
  assert meshes.logical_to_spec(("batch",), (8,), mesh, rules) == P(("data", "fsdp"))
  assert meshes.logical_to_spec(("batch",), (6,), mesh, rules) == P("data")
  assert meshes.logical_to_spec(("batch",), (3,), mesh, rules) == P(None)


def test_logical_to_sharding_tree():
  mesh = meshes.make_learner_mesh(jax.devices()[:4], {"fsdp": 2, "tp": 2})
  axes = {"embed": ("vocab", "embed"), "layers": [{"wq": ("layers", "embed", "heads", None)}],
          "scale": ()}
  shapes = {"embed": jax.ShapeDtypeStruct((10, 8), np.float32),
            "layers": [{"wq": jax.ShapeDtypeStruct((2, 8, 4, 16), np.float32)}],
            "scale": jax.ShapeDtypeStruct((), np.float32)}
  sh = meshes.logical_to_sharding(axes, mesh, meshes.LEARNER_RULES, shapes)
  assert sh["embed"].spec == P("tp", "fsdp")
  assert sh["layers"][0]["wq"].spec == P(None, "fsdp", "tp", None)
  assert sh["scale"].spec == P() and sh["scale"].mesh == mesh
  # The shardings place real arrays.
  x = jax.device_put(np.zeros((10, 8), np.float32), sh["embed"])
  assert x.sharding.spec == P("tp", "fsdp")
  with pytest.raises(ValueError, match=r"\['layers'\]\[0\]\['wq'\].*rank"):
    meshes.logical_to_sharding({"layers": [{"wq": ("layers", "embed")}]}, mesh,
                               meshes.LEARNER_RULES, {"layers": [{"wq": (2, 8, 4)}]})
