"""The learner's train state: a pytree passed explicitly to (and donated by) the jitted step."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import optax

from rlax_pipe.learner import sharding as sharding_lib
from rlax_pipe.model import ModelLike, as_model
from rlax_pipe.model.lora import LoraAdapters

# What the optimizer trains: a model's params, or the LoRA adapters of one.
Trainable = ModelLike | LoraAdapters


def trainable_space(model: Trainable) -> Any:
  """`model` as the object whose `abstract_params` / `param_axes` are the trained params."""
  return model if isinstance(model, LoraAdapters) else as_model(model)


class TrainState(NamedTuple):
  """Everything the learner carries from one optimizer step to the next.

  Attributes:
    params: the trained parameter tree, learner-sharded: the model's params
      (`Model.abstract_params()` layout), or with LoRA the adapters only
      (`LoraAdapters.abstract_params()`; the frozen base is held by the learner outside).
    opt_state: optax state of `optimizer.make_optimizer(cfg)`.
    version: int32 scalar policy version of `params`: initial weights are version 0 and every
      learner batch with at least one applied optimizer update makes v + 1, however many
      minibatch updates it made (a batch whose updates were all skipped, for non-finite values
      or for having no token that contributes to the loss, leaves it unchanged).
    rng: uint32[2] raw PRNG key data, fold_in(key(seed), 1) at init (random init of the params
      uses key(seed) itself); advanced with the version; reserved for stochastic parts.
    step: int32 scalar number of `train_step` calls (learner batches), applied or skipped
      (checkpoint step id).
    nonfinite_consecutive: int32 scalar, skipped steps in a row up to now (0 after a good step).
    nonfinite_total: int32 scalar, skipped steps since initialization.
  """

  params: Any
  opt_state: Any
  version: jax.Array
  rng: jax.Array
  step: jax.Array
  nonfinite_consecutive: jax.Array
  nonfinite_total: jax.Array


def init_state(params: Any, tx: optax.GradientTransformation,
               seed: int | jax.Array) -> TrainState:
  """Fresh train state around `params` (version 0, zero counters). Pure; jit it.

  Args:
    params: parameter tree.
    tx: optimizer.
    seed: PRNG seed (int or int32 scalar array).

  Returns:
    TrainState.
  """
  zero = jnp.zeros((), jnp.int32)
  return TrainState(
      params=params,
      opt_state=tx.init(params),
      version=zero,
      rng=jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 1)),
      step=zero,
      nonfinite_consecutive=zero,
      nonfinite_total=zero,
  )


def abstract_state(model: Trainable, tx: optax.GradientTransformation) -> TrainState:
  """TrainState of `jax.ShapeDtypeStruct` leaves (no allocation); `model` may be a
  `LoraAdapters` (then the state trains the adapters)."""
  return jax.eval_shape(lambda p: init_state(p, tx, 0), trainable_space(model).abstract_params())


def state_shardings(model: Trainable, tx: optax.GradientTransformation, mesh: Mesh) -> TrainState:
  """TrainState of NamedShardings on the learner mesh, derived from the abstract state."""
  abstract = abstract_state(model, tx)
  params = sharding_lib.param_shardings(model, mesh)
  rep = sharding_lib.replicated(mesh)
  return TrainState(
      params=params,
      opt_state=sharding_lib.opt_state_shardings(tx, abstract.opt_state, params, mesh),
      version=rep, rng=rep, step=rep, nonfinite_consecutive=rep, nonfinite_total=rep)


def sharded_abstract_state(model: Trainable, tx: optax.GradientTransformation,
                           mesh: Mesh) -> TrainState:
  """Abstract state whose leaves carry their target sharding (an orbax restore target)."""
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract_state(model, tx), state_shardings(model, tx, mesh))
