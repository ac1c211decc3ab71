"""The sharded Learner on 8 virtual CPU devices: shardings, recompiles, equivalences, faults."""

import logging
import os

import jax
import numpy as np
import pytest

from experiments.lib.learner_bench import synthetic_batch
from rlax_pipe import learner as learner_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import transformer
from rlax_pipe.objectives import ObjectiveConfig

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64)
OBJECTIVE = ObjectiveConfig(name="tis_pg", max_lag=4)
SAMPLING = SamplingConfig(temperature=0.7)
# Backend optimization level 0 compiles ~3x faster on CPU; results stay within fp32 tolerance.
FAST = (("xla_backend_optimization_level", 0),)
SINGLE = (("fsdp", 1), ("tp", 1))
FSDP_TP = (("fsdp", 2), ("tp", 2))
B, L = 8, 32


def make_cfg(mesh_axes, checkpoint_dir=None, keep_checkpoints=3, **kwargs):
  # Adam divides by sqrt(v) + eps, amplifying the fp32 reduction-order noise of near-zero
  # gradient entries by up to lr / eps; eps = 1e-4 keeps that < 1e-8 so params compare tightly.
  kwargs = {"micro_batch_rows": B, **kwargs}
  return learner_lib.LearnerConfig(
      mesh_axes=mesh_axes, compiler_options=FAST,
      optimizer=learner_lib.OptimizerConfig(learning_rate=1e-3, adam_eps=1e-4, warmup_steps=0),
      checkpoint=learner_lib.CheckpointConfig(directory=checkpoint_dir, keep=keep_checkpoints),
      **kwargs)


def make_learner(mesh_axes, devices, params, restore=False, **kwargs):
  return learner_lib.Learner(TINY, make_cfg(mesh_axes, **kwargs), OBJECTIVE, SAMPLING,
                             devices=devices, params=params, restore=restore)


@pytest.fixture(scope="module")
def host_params():
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(np.float32),
                      transformer.abstract_params(TINY))


def batches(n, seed=1, version=0):
  rng = np.random.default_rng(seed)
  return [synthetic_batch(rng, B, L, TINY.vocab_size, version=version, max_lag=3)
          for _ in range(n)]


def assert_state_sharded_as(learner):
  arrays = jax.tree_util.tree_flatten_with_path(learner.state)[0]
  for (path, x), want in zip(arrays, jax.tree.leaves(learner.state_shardings)):
    assert x.sharding.is_equivalent_to(want, x.ndim), jax.tree_util.keystr(path)


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def test_sharded_step_equals_single_device_and_does_not_recompile(host_params):
  single = make_learner(SINGLE, jax.devices()[:1], host_params)
  sharded = make_learner(FSDP_TP, jax.devices()[:4], host_params)
  assert_state_sharded_as(sharded)
  wq = sharded.params["layers"]["wq"].sharding
  assert tuple(wq.spec)[:3] == (None, "fsdp", "tp") and len(wq.device_set) == 4
  assert single.version == sharded.version == 0

  first, second = batches(2)
  for learner in (single, sharded):
    assert learner.train_step(first) is None
  m_single, m_sharded = single.flush(), sharded.flush()
  assert bool(m_sharded["is_finite"]) and int(m_sharded["version"]) == 1
  for name in ("loss", "grad_norm", "update_norm", "ratio_mean", "ess", "entropy", "kl_k3"):
    np.testing.assert_allclose(m_sharded[name], m_single[name], rtol=1e-5, err_msg=name)
  np.testing.assert_array_equal(m_sharded["lag_hist"], m_single["lag_hist"])
  assert int(m_sharded["tokens"]) == int((first.loss_mask > 0).sum())
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               host(sharded.params), host(single.params))
  assert_state_sharded_as(sharded)

  # A second step with a new batch of the same shape reuses the compiled program, and the
  # hot loop makes only explicit host<->device transfers (batch in, metrics out).
  with jax.transfer_guard("disallow"):
    sharded.train_step(second)
    assert int(sharded.flush()["version"]) == 2
  assert sharded.version == 2
  assert sharded.compile_counts()["accumulate"] == 1
  assert_state_sharded_as(sharded)


def test_random_init_is_created_sharded_and_layout_independent():
  with jax.transfer_guard("disallow"):  # no implicit host<->device copies: built on the mesh
    sharded = learner_lib.Learner(TINY, make_cfg(FSDP_TP, seed=3), OBJECTIVE, SAMPLING,
                                  devices=jax.devices()[4:])
  assert_state_sharded_as(sharded)
  single = learner_lib.Learner(TINY, make_cfg(SINGLE, seed=3), OBJECTIVE, SAMPLING,
                               devices=jax.devices()[:1])
  jax.tree.map(np.testing.assert_array_equal, host(sharded.params), host(single.params))


def test_gradient_accumulation_equals_one_big_batch(host_params):
  """4 micro-batches of 2 rows (token_mean over the whole step's tokens) == one batch of 8."""
  whole = make_learner(SINGLE, jax.devices()[:1], host_params)
  accumulated = make_learner(SINGLE, jax.devices()[:1], host_params, micro_batch_rows=2)
  rng = np.random.default_rng(7)
  for version in range(3):  # lags 0..version: the batch was sampled by older policies
    batch = synthetic_batch(rng, B, L, TINY.vocab_size, version=version, max_lag=2)
    for learner in (whole, accumulated):
      learner.train_step(batch)
    m_whole, m_acc = whole.flush(), accumulated.flush()
    for name in ("loss", "grad_norm", "update_norm", "ratio_mean", "ratio_var", "ess",
                 "frac_truncated", "entropy", "kl_k3"):
      np.testing.assert_allclose(m_acc[name], m_whole[name], rtol=1e-5, atol=1e-7,
                                 err_msg=name)
    np.testing.assert_array_equal(m_acc["lag_hist"], m_whole["lag_hist"])
    assert int(m_acc["negative_lag_tokens"]) == 0
  assert m_acc["lag_hist"][1:3].sum() > 0 and int(m_acc["version"]) == 3
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               host(accumulated.params), host(whole.params))


def test_nonfinite_steps_are_skipped_then_stop_with_a_checkpoint(host_params, tmp_path):
  learner = make_learner(SINGLE, jax.devices()[:1], host_params, max_consecutive_nonfinite=2,
                         checkpoint_dir=str(tmp_path / "ckpt"))
  good, nan_adv, nan_padding, nan_mu = batches(4, seed=3)
  completion = nan_adv.loss_mask > 0
  nan_adv.advantages[np.argwhere(completion)[0][0], np.argwhere(completion)[0][1]] = np.nan
  nan_padding.advantages[nan_padding.loss_mask == 0] = np.nan  # never read by the loss
  nan_mu.behavior_logprobs[nan_mu.loss_mask > 0] = np.nan

  assert learner.train_step(good) is None
  assert bool(learner.train_step(nan_adv)["is_finite"])  # metrics of `good`
  params_v1 = host(learner.params)
  skipped = learner.train_step(nan_padding)  # metrics of `nan_adv`
  assert not bool(skipped["is_finite"]) and not bool(skipped["loss_finite"])
  assert not bool(skipped["inputs_finite"])
  assert int(skipped["version"]) == 1 and int(skipped["nonfinite_consecutive"]) == 1
  recovered = learner.train_step(nan_mu)  # metrics of `nan_padding`: masked NaNs are harmless
  assert bool(recovered["is_finite"]) and int(recovered["version"]) == 2
  assert int(recovered["nonfinite_consecutive"]) == 0
  params_v2 = host(learner.params)
  assert not np.array_equal(params_v1["embed"], params_v2["embed"])
  learner.train_step(nan_adv)  # metrics of `nan_mu`: skipped (1 in a row)
  with pytest.raises(learner_lib.NonFiniteError, match=r"2 consecutive .*steps 4\.\.5.*loss"):
    learner.flush()  # `nan_adv` again: 2 in a row -> checkpoint + stop

  # Skipped steps left params, optimizer state and version at version 2.
  assert learner.version == 2 and learner.step == 5
  jax.tree.map(np.testing.assert_array_equal, host(learner.params), params_v2)
  assert learner.checkpointer.steps() == [5]
  resumed = make_learner(SINGLE, jax.devices()[:1], host_params,
                         checkpoint_dir=str(tmp_path / "ckpt"))
  extra = resumed.restore()
  assert extra["stopped_on"] == "nonfinite" and resumed.version == 2
  jax.tree.map(np.testing.assert_array_equal, host(resumed.params), params_v2)


def test_checkpoints_restore_onto_another_mesh_and_fall_back_past_a_corrupt_one(
    host_params, tmp_path, caplog):
  ckpt = str(tmp_path / "ckpt")
  saver = make_learner(FSDP_TP, jax.devices()[:4], host_params, checkpoint_dir=ckpt,
                       keep_checkpoints=2)
  snapshots = {}
  for i, batch in enumerate(batches(3, seed=11)):
    saver.train_step(batch)
    step = saver.save({"queue": [i, "x"], "consumed": i + 1})  # async; next step donates
    snapshots[step] = host(saver.state)
  saver.flush()
  saver.checkpointer.wait()
  assert saver.checkpointer.steps() == [2, 3]  # keep the last 2
  assert saver.compile_counts()["accumulate"] == 1

  # Same mesh: same shardings, same values, and the next step does not recompile.
  same = make_learner(FSDP_TP, jax.devices()[:4], None, checkpoint_dir=ckpt, restore=True)
  assert same.restored_extra == {"queue": [2, "x"], "consumed": 3} and same.version == 3
  assert_state_sharded_as(same)
  jax.tree.map(np.testing.assert_array_equal, host(same.state), snapshots[3])
  same.train_step(batches(1, seed=12, version=3)[0])
  assert int(same.flush()["version"]) == 4 and same.compile_counts()["accumulate"] == 1

  # Another mesh (4-way tp on devices 4-7): the state lands on the new layout.
  other = learner_lib.Learner(TINY, make_cfg((("tp", 4),), checkpoint_dir=ckpt), OBJECTIVE,
                              SAMPLING, devices=jax.devices()[4:], restore=True)
  assert other.version == 3 and other.restored_extra["consumed"] == 3
  assert_state_sharded_as(other)
  wq = other.params["layers"]["wq"].sharding
  assert tuple(wq.spec)[:3] == (None, None, "tp")
  assert {d.id for d in wq.device_set} == {4, 5, 6, 7}
  jax.tree.map(np.testing.assert_array_equal, host(other.state), snapshots[3])

  # Corrupt the newest checkpoint: restore falls back to step 2 and says so in the log.
  for root, _, files in os.walk(os.path.join(ckpt, "3", "state")):
    for name in files:
      open(os.path.join(root, name), "wb").close()
  with caplog.at_level(logging.ERROR):
    extra = other.restore()
  assert extra["consumed"] == 2 and other.version == 2
  jax.tree.map(np.testing.assert_array_equal, host(other.state), snapshots[2])
  assert any("step 3" in r.getMessage() and "incomplete or corrupt" in r.getMessage()
             for r in caplog.records)


def test_step_slice_resets_host_fields_to_the_class_defaults():
  """#25 step 5: step_slice reads its defaults from LearnerConfig (no second copy)."""
  default = learner_lib.LearnerConfig(mesh_axes=(("fsdp", 2),))
  custom = learner_lib.LearnerConfig(
      mesh_axes=(("fsdp", 2),), seed=5, max_consecutive_nonfinite=7,
      checkpoint=learner_lib.CheckpointConfig(directory="/elsewhere", keep=1))
  assert custom.step_slice() == default.step_slice() == default
  assert learner_lib.LearnerConfig(mesh_axes=(("fsdp", 4),)).step_slice() != default.step_slice()
