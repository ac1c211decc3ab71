"""The frozen base of a LoRA learner (`LearnerConfig.lora`): placed once on the learner shardings,
merged with the trained adapters on demand, and fingerprinted so that a checkpoint of adapters is
only ever restored onto the base it was trained on.

The optimizer state trains the adapters only (Hu et al. 2021, "LoRA", eq. 3: W + alpha/r B A);
the base lives beside the state, never donated, never saved (a checkpoint holds the adapters and
the base's checksums under `LORA_BASE_KEY`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import Mesh

from rlax_pipe import param_checksum
from rlax_pipe.learner import sharding as sharding_lib
from rlax_pipe.model import Model
from rlax_pipe.model import lora as lora_lib

# Checkpoint extra key of a LoRA learner: the checksums of the frozen base the adapters belong to.
LORA_BASE_KEY = "lora_base_checksum"


@functools.lru_cache(maxsize=8)
def _compiled_base_init(model: Model, mesh: Mesh):
  """Jitted random init of a LoRA run's frozen base, straight into the learner shardings."""
  return jax.jit(lambda seed: model.init_params(jax.random.key(seed)),
                 out_shardings=sharding_lib.param_shardings(model, mesh))


@functools.lru_cache(maxsize=8)
def _compiled_merge(lora: lora_lib.LoraAdapters, mesh: Mesh):
  """Jitted `lora.merge(base, adapters)` into the model's learner shardings."""
  return jax.jit(lora.merge, out_shardings=sharding_lib.param_shardings(lora.model, mesh))


def place_base(model: Model, mesh: Mesh, params: Any, seed: jax.Array) -> Any:
  """The frozen base on the learner shardings: `params` (any placement) copied there, or with
  `params` None a random init from `seed` (an int32 scalar on the mesh) made in place."""
  if params is None:
    return _compiled_base_init(model, mesh)(seed)
  return jax.device_put(params, sharding_lib.param_shardings(model, mesh))


def merge(lora: lora_lib.LoraAdapters, mesh: Mesh, base: Any, adapters: Any) -> Any:
  """The full params W + alpha/r B A of every adapted weight (`LoraAdapters.merge`), as a new
  learner-sharded tree (base and adapters are left untouched)."""
  return _compiled_merge(lora, mesh)(base, adapters)


def base_checksum(base: Any) -> list[int]:
  """Exact per-leaf checksums of the base (`param_checksum`), as JSON-able ints."""
  return [int(x) for x in param_checksum.host(param_checksum.checksum(base))]
