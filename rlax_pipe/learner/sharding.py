"""Learner shardings, all derived from abstract shapes before anything is allocated.

Params follow the model's logical axes through `rlax_pipe.sharding.LEARNER_RULES` (FSDP on embed,
tensor parallel on heads / mlp / vocab); optimizer moments inherit their parameter's sharding
(`rlax_pipe.sharding.opt_state_shardings`); scalars are replicated; batch rows are split over the
(data, fsdp) axes. The forward / backward computes with `rlax_pipe.sharding.compute_constraint`
(`LEARNER_COMPUTE_RULES`): weights gathered per layer, gradients reduce-scattered, activations
split over the batch axes only.
"""

from __future__ import annotations

from typing import Any, Sequence

from jax.sharding import Mesh, NamedSharding

from rlax_pipe import sharding as sharding_lib
from rlax_pipe.learner.config import LearnerConfig
from rlax_pipe.model import ModelLike, as_model
from rlax_pipe.model.lora import LoraAdapters
# One definition each, in rlax_pipe.sharding; re-exported for the learner's modules.
from rlax_pipe.sharding import (  # pylint: disable=unused-import
    compute_constraint, opt_state_shardings, replicated)

BATCH_AXES: tuple[str, str] = (sharding_lib.BATCH, sharding_lib.LENGTH)


def learner_mesh(devices: Sequence[Any], cfg: LearnerConfig) -> Mesh:
  """Builds the learner mesh (``AxisType.Auto``) over `devices` with `cfg.mesh_axes`.

  Raises:
    ValueError: if the device count differs from the product of the axis sizes, or an axis
      name is not one of the learner rules' mesh axes (data, fsdp, tp).
  """
  return sharding_lib.make_mesh(devices, cfg.mesh_shape, sharding_lib.LEARNER_RULES)


def param_shardings(model: ModelLike | LoraAdapters, mesh: Mesh,
                    rules: sharding_lib.Rules = sharding_lib.LEARNER_RULES) -> Any:
  """NamedSharding per parameter, from `model.param_axes()` and its abstract shapes (a
  `LoraAdapters`: per adapter, from their logical axes)."""
  model = model if isinstance(model, LoraAdapters) else as_model(model)
  return sharding_lib.logical_to_sharding(model.param_axes(), mesh, rules,
                                          shapes=model.abstract_params())


def batch_sharding(mesh: Mesh, shape: tuple[int, int],
                   rules: sharding_lib.Rules = sharding_lib.LEARNER_RULES) -> NamedSharding:
  """Sharding of one [B, L] batch array: rows over (data, fsdp) when they divide B."""
  return NamedSharding(mesh, sharding_lib.logical_to_spec(BATCH_AXES, shape, mesh, rules))
