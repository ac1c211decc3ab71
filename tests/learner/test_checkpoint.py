"""Checkpointer on a toy sharded state: keep-last-N, commit marker, fallback, errors."""

import logging
import os

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
