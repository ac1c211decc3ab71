"""The Trainer owns the learner side's policy version (a host integer): what a step trained at
and produced, also after a skipped step, and at most one device-to-host transfer per step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import learner as learner_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.objectives import ObjectiveConfig
from rlax_pipe.pipeline import config as pconfig
from rlax_pipe.pipeline import rules
from rlax_pipe.pipeline import staleness
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.pipeline.trainer import Trainer, build_batch
from rlax_pipe.types import Rollout

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64)
STALENESS = staleness.StalenessConfig(policy="block", max_lag=4, groups_per_step=1)


class Sink:
  """A weight sink that records the versions pushed."""

  def __init__(self):
    self.versions = []

  def push(self, update):
    self.versions.append(update.version)


def _group(gid, version, rng, logprob=None):
  """Two samples with rewards 0 and 1 (a non-zero group advantage) sampled at `version`."""
  out = []
  for i, reward in enumerate((0.0, 1.0)):
    t = 5 + i
    lp = -rng.uniform(0.1, 2.0, t).astype(np.float32) if logprob is None else np.full(
        t, logprob, np.float32)
    out.append(Rollout(sample_id=2 * gid + i, group_id=gid,
                       prompt_tokens=rng.integers(1, 64, 4).astype(np.int32),
                       completion_tokens=rng.integers(1, 64, t).astype(np.int32),
                       behavior_logprobs=lp, policy_versions=np.full(t, version, np.int32),
                       finish_reason="eos", reward=reward))
  return tuple(out)


class TransferCounter:
  """Counts device-to-host reads: explicit `jax.device_get` calls and implicit conversions of a
  jax.Array (np.asarray, int, float, bool, item, tolist; CPU transfer guards see none of them)."""

  def __init__(self, monkeypatch):
    self.count, self._inside = 0, False
    real_get = jax.device_get

    def device_get(x):
      if any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x)):
        self.count += 1
      self._inside = True  # its own per-leaf conversions are part of this one transfer
      try:
        return real_get(x)
      finally:
        self._inside = False

    monkeypatch.setattr(jax, "device_get", device_get)
    array_type = type(jnp.zeros(()))
    for name in ("__array__", "__int__", "__float__", "__bool__", "__index__", "item", "tolist"):
      real = getattr(array_type, name)
      monkeypatch.setattr(array_type, name, self._counting(real))

  def _counting(self, real):
    def wrapper(*args, **kwargs):
      self.count += not self._inside
      return real(*args, **kwargs)
    return wrapper


@pytest.fixture(name="trainer")
def trainer_fixture():
  cfg = learner_lib.LearnerConfig(
      mesh_axes=(("fsdp", 2), ("tp", 2)), compiler_options=(("xla_backend_optimization_level", 0),),
      optimizer=learner_lib.OptimizerConfig(learning_rate=1e-3, warmup_steps=0))
  learner = learner_lib.Learner(TINY, cfg, ObjectiveConfig(name="tis_pg"),
                                SamplingConfig(temperature=1.0), devices=jax.devices()[:4])
  pcfg = pconfig.PipelineConfig(seq_len=16, group_size=2, staleness=STALENESS)
  return Trainer(learner, RolloutQueue(STALENESS, 2), Sink(), pcfg)


def test_version_owned_by_the_trainer_and_one_transfer_per_step(trainer, monkeypatch):
  rng = np.random.default_rng(0)
  trainer.train_on([_group(0, 0, rng)])  # compiles outside the count
  steps = [[_group(g, g, rng)] for g in (1, 2)]
  counter = TransferCounter(monkeypatch)
  results = [trainer.train_on(groups) for groups in steps]
  assert counter.count <= 2, f"{counter.count} device-to-host transfers in 2 steps"
  assert [(r.trained_at, r.produced) for r in results] == [(1, 2), (2, 3)]
  assert trainer.version == 3 and trainer.channel.versions == [1, 2, 3]
  lcfg = trainer.learner.cfg  # the step's shape is the plan the learner ran for the packed rows
  rows = [build_batch(groups, trainer.cfg)[0].tokens.shape[0] for groups in steps]
  assert [(r.micro_batches, r.processed_rows) for r in results] == [rules.micro_batch_plan(
      n, lcfg.micro_batch_rows, lcfg.num_minibatches) for n in rows] == [(1, 16)] * 2


def test_skipped_step_produces_the_version_it_trained_at(trainer):
  rng = np.random.default_rng(1)
  trainer.train_on([_group(0, 0, rng)])
  skipped = trainer.train_on([_group(1, 1, rng, logprob=np.nan)])  # non-finite input: skipped
  assert not bool(skipped.metrics["is_finite"])
  assert (skipped.trained_at, skipped.produced) == (1, 1)
  after = trainer.train_on([_group(2, 1, rng)])
  assert (after.trained_at, after.produced) == (1, 2)
  assert trainer.channel.versions == [1, 1, 2] and trainer.learner.version == 2
