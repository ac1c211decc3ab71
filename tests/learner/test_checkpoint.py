"""Checkpointer on a toy sharded state: keep-last-N, commit marker, fallback, errors."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from rlax_pipe.learner import checkpoint
from rlax_pipe import sharding as sh_lib


@pytest.fixture(scope="module")
def mesh():
  return sh_lib.make_mesh(jax.devices()[:4], {"fsdp": 2, "tp": 2}, sh_lib.LEARNER_RULES)


def toy_state(mesh, value):
  w = jax.device_put(np.full((4, 4), value, np.float32), NamedSharding(mesh, P("fsdp", "tp")))
  return {"w": w, "version": jax.device_put(jnp.int32(value), NamedSharding(mesh, P()))}


def target(mesh):
  return {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=NamedSharding(mesh, P("tp"))),
          "version": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}


def saved_checkpointer(path, mesh, steps, keep=3):
  ckpt = checkpoint.Checkpointer(str(path), keep=keep)
  for s in steps:
    ckpt.save(s, toy_state(mesh, s), {"step": s, "nested": {"ids": [s, s + 1]}})
  ckpt.wait()
  return ckpt


def test_keeps_the_last_n_and_round_trips_extra(tmp_path, mesh):
  ckpt = saved_checkpointer(tmp_path / "c", mesh, [1, 2, 3, 4], keep=2)
  assert ckpt.steps() == [3, 4]
  restored = ckpt.restore(target(mesh))
  assert restored.step == 4 and restored.skipped == ()
  assert restored.extra == {"step": 4, "nested": {"ids": [4, 5]}}
  np.testing.assert_array_equal(restored.state["w"], np.full((4, 4), 4.0))
  assert restored.state["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("tp")), 2)
  ckpt.save(4, toy_state(mesh, 40), {"step": 40})  # same step again: replaced
  assert ckpt.restore(target(mesh), step=4).extra == {"step": 40}
  with pytest.raises(TypeError, match="JSON"):
    ckpt.save(5, toy_state(mesh, 5), {"bad": object()})
  ckpt.close()


def test_newest_without_commit_marker_falls_back_with_a_log_line(tmp_path, mesh, caplog):
  ckpt = saved_checkpointer(tmp_path / "c", mesh, [1, 2])
  os.remove(tmp_path / "c" / "2" / checkpoint.COMMIT_MARKER)
  with pytest.raises(checkpoint.CheckpointError, match="commit marker"):
    ckpt.restore(target(mesh), step=2)  # an explicit bad step is an error, not a fallback
  with caplog.at_level(logging.ERROR):
    restored = ckpt.restore(target(mesh))
  assert restored.step == 1 and restored.skipped == (2,)
  assert any("step 2" in r.getMessage() and "falling back" in r.getMessage()
             for r in caplog.records)
  assert ckpt.steps() == [1, 2]  # the bad step is left in place ...
  ckpt.save(2, toy_state(mesh, 22), {"step": 22})  # ... and replaced when training saves it
  restored = ckpt.restore(target(mesh))
  assert restored.step == 2 and restored.extra == {"step": 22} and restored.skipped == ()


def test_no_usable_checkpoint_raises(tmp_path, mesh):
  empty = checkpoint.Checkpointer(str(tmp_path / "empty"))
  with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
    empty.restore(target(mesh))
  ckpt = saved_checkpointer(tmp_path / "c", mesh, [1])
  os.remove(tmp_path / "c" / "1" / checkpoint.COMMIT_MARKER)
  with pytest.raises(checkpoint.CheckpointError, match="step 1"):
    ckpt.restore(target(mesh))


def test_missing_corrupt_and_mismatched_are_told_apart(tmp_path, mesh, caplog):
  """Issue #14 item 11: each failure has its own error; a fallback is loud and reported."""
  ckpt = saved_checkpointer(tmp_path / "c", mesh, [1, 2, 3])
  with pytest.raises(checkpoint.CheckpointNotFoundError, match=r"step 7 .* steps \[1, 2, 3\]"):
    ckpt.restore(target(mesh), step=7)
  os.remove(tmp_path / "c" / "3" / checkpoint.COMMIT_MARKER)
  with pytest.raises(checkpoint.CheckpointCorruptError, match="commit marker"):
    ckpt.restore(target(mesh), step=3)
  # Another model: a leaf of another shape, or a leaf the checkpoint lacks. Raised at once, not
  # a reason to fall back to step 1 (which would not fit either).
  wider = dict(target(mesh), w=jax.ShapeDtypeStruct((4, 8), jnp.float32,
                                                     sharding=NamedSharding(mesh, P("tp"))))
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"w: saved \(4, 4\) float32, target \(4, 8\) float32"):
    ckpt.restore(wider, step=2)
  more = dict(target(mesh), bias=jax.ShapeDtypeStruct((4,), jnp.float32,
                                                      sharding=NamedSharding(mesh, P())))
  with pytest.raises(checkpoint.CheckpointMismatchError, match=r"missing from it \['bias'\]"):
    ckpt.restore(more)
  with caplog.at_level(logging.ERROR):
    restored = ckpt.restore(target(mesh))
  assert restored.step == 2 and restored.skipped == (3,)
  assert len(restored.skip_reasons) == 1 and "commit marker" in restored.skip_reasons[0]
  assert any("falling back" in r.getMessage() for r in caplog.records)
  assert ckpt.restore_extra(step=2) == {"step": 2, "nested": {"ids": [2, 3]}}
  assert isinstance(checkpoint.CheckpointMismatchError("x"), checkpoint.CheckpointError)


@pytest.mark.parametrize("bad_target,named", [
    (None, r"no restore target \(NoneType"),
    ({}, r"no restore target \(dict"),
    ({"w": np.zeros((4, 4), np.float32), "version": np.int32(0)},
     r"not array descriptions: \['version: int32'\]"),
    ({"w": 0.0, "version": 0}, r"\['version: int', 'w: float'\]"),
])
def test_a_missing_target_is_named_not_called_another_tree(tmp_path, mesh, bad_target, named):
  """Issue #27 item 4: without a target the error said "another tree" with no missing leaf (or,
  for scalar leaves, "corrupt" and fell back to older steps)."""
  ckpt = saved_checkpointer(tmp_path / "c", mesh, [1, 2])
  with pytest.raises(checkpoint.CheckpointTargetError, match=named) as e:
    ckpt.restore(bad_target)
  assert "sharded_abstract_state" in str(e.value) and "another tree" not in str(e.value)
  assert not isinstance(e.value, (checkpoint.CheckpointMismatchError,
                                  checkpoint.CheckpointCorruptError))


_RESTORE_ON_4 = textwrap.dedent("""
    import importlib.util, json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    # the module alone (it imports no other rlax_pipe module): half the start-up of the package
    spec = importlib.util.spec_from_file_location("checkpoint", sys.argv[2])
    checkpoint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checkpoint)
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    ckpt = checkpoint.Checkpointer(sys.argv[1])
    out = {}
    try:
      ckpt.restore({"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)})
    except checkpoint.CheckpointError as e:
      out["unsharded"] = [type(e).__name__, str(e)]
    r = ckpt.restore({"w": jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                                sharding=NamedSharding(mesh, P("tp")))})
    out["sharded"] = [r.step, np.asarray(r.state["w"]).tolist()]
    print(json.dumps(out))
""")


def test_another_device_count_is_named_with_its_fix(tmp_path):
  """Issue #27 item 4: saved on 8 devices, restored in a 4-device process. A target without
  shardings used to read as a corrupt step (and fall back to older ones); it is now a topology
  error naming both device counts and the fix; with target shardings the restore works."""
  mesh8 = jax.make_mesh((4, 2), ("fsdp", "tp"), devices=jax.devices()[:8],
                        axis_types=(jax.sharding.AxisType.Auto,) * 2)
  w = np.arange(32, dtype=np.float32).reshape(8, 4)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "c"))
  ckpt.save(1, {"w": jax.device_put(w, NamedSharding(mesh8, P("fsdp", "tp")))})
  ckpt.close()
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _RESTORE_ON_4, str(tmp_path / "c"),
                         checkpoint.__file__],
                        capture_output=True, text=True, env=env, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  kind, message = out["unsharded"]
  assert kind == "CheckpointTopologyError", message
  assert "saved on 8 devices (mesh fsdp=4 x tp=2)" in message and "(4 devices" in message
  assert "['w']" in message and "sharded_abstract_state" in message
  assert out["sharded"] == [1, w.tolist()]
