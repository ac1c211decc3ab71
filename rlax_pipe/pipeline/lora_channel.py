"""The weight channel of a LoRA run: adapters only over the wire, merged on the sampler.

With LoRA (`LearnerConfig.lora.rank` >= 1) the base weights never change, so after the sampler
holds one copy of the base, a new policy version is fully described by its adapters A, B
(`rlax_pipe.model.lora`). `LoraWeightChannel` therefore:

  1. at construction copies the learner's frozen base once onto the sampler shardings (device to
     device, through a one-off `WeightChannel` of the full params manifest; `base_bytes`);
  2. is itself the `WeightChannel` of the adapters: every `push(WeightUpdate(version, adapters))`
     moves only them (`manifest` and `stats().bytes_per_version` are the adapters');
  3. on `try_take` / `take` checks the landed adapters against the learner's checksums (exact),
     merges W' = W + (alpha / r) B A on the sampler mesh (a jitted `LoraAdapters.merge` with the
     sampler's out_shardings; the base copy is read, never modified) and hands the engine an
     ordinary `WeightUpdate` of the merged params, with the checksums of that merged tree so the
     engine's own check (`sampler.weight_check`) still proves it decodes with what it was given.
     So the sampler thread pays, once per version instead of the full-params transfer, one jitted
     pass reading the base and writing the merged tree, plus a rank-r matmul per adapted weight.

The engine swaps the merged tree in at a step boundary exactly like a full update, so every token
keeps the exact version of the weights that produced it (merged, not unmerged, adapters: the
decode step runs the plain model on merged weights, at no per-token cost). Sampler memory: the
base copy plus at most the channel's own bound of merged copies (running, pending, in transit).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh

from rlax_pipe import param_checksum
from rlax_pipe import sharding as sharding_lib
from rlax_pipe.model.lora import LoraAdapters
from rlax_pipe.pipeline.weight_channel import WeightChannel, delete_all
from rlax_pipe.types import WeightUpdate


def sampler_target(tree_axes: Any, abstract: Any, mesh: Mesh) -> Any:
  """`abstract` (ShapeDtypeStructs) carrying `SAMPLER_RULES` shardings of `tree_axes` on `mesh`."""
  shardings = sharding_lib.logical_to_sharding(tree_axes, mesh, sharding_lib.SAMPLER_RULES,
                                               shapes=abstract)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      abstract, shardings)


class LoraWeightChannel(WeightChannel):
  """Adapters-only weight channel with a sampler-side merge (see the module docstring).

  Example:
    channel = LoraWeightChannel(learner.lora, learner.base_params, sampler_mesh)
    channel.push(WeightUpdate(learner.version, learner.params))  # the adapters: A, B of each target
    update = channel.take()                          # merged params, for SamplerEngine
  """

  def __init__(self, lora: LoraAdapters, base: Any, mesh: Mesh, *,
               verify: Callable[[Any, int], None] | None = None, debug: bool = False):
    """Copies the base onto the sampler mesh once and opens the adapters channel.

    Args:
      lora: the learner's adapter space (`Learner.lora`).
      base: the learner's frozen base params (`Learner.base_params`, learner-sharded).
      mesh: the sampler mesh.
      verify: optional `verify(merged_sampler_params, version)`, run after each merge when
        `debug` is True (e.g. the job's probe-logits comparison); it should raise on a mismatch.
      debug: run `verify` after each merge.

    Raises:
      ManifestError: if `base` does not match the model's params.
    """
    base_target = sampler_target(lora.model.param_axes(), lora.model.abstract_params(), mesh)
    once = WeightChannel(base_target)
    once.push(WeightUpdate(0, base))
    self._base = once.take().params
    once.close()
    self.base_bytes = once.stats().bytes_per_version
    super().__init__(sampler_target(lora.param_axes(), lora.abstract_params(), mesh))
    self._merge = jax.jit(lora.merge, out_shardings=jax.tree.map(lambda t: t.sharding, base_target))
    self._verify_merged = verify if debug else None  # (the adapters' pushes are not verified)

  def try_take(self) -> WeightUpdate | None:
    """The newest version, merged, if its adapters have landed; else None (non-blocking)."""
    update = super().try_take()
    return None if update is None else self._merged(update)

  def take(self, timeout: float | None = None) -> WeightUpdate:
    """Blocking `WeightChannel.take` of the adapters, then the merge."""
    return self._merged(super().take(timeout))

  def _merged(self, update: WeightUpdate) -> WeightUpdate:
    """Checks the landed adapters, merges them into the base copy, frees them."""
    if update.checksum is not None:
      param_checksum.compare(update.checksum, param_checksum.checksum(update.params),
                             update.version, names=[spec.name for spec in self.manifest],
                             got_from="the sampler's landed adapters")
    merged = self._merge(self._base, update.params)
    jax.block_until_ready(merged)
    delete_all(jax.tree.leaves(update.params))
    if self._verify_merged is not None:
      self._verify_merged(merged, update.version)
    return WeightUpdate(update.version, merged, donated=True,
                        checksum=param_checksum.checksum(merged))

  def close(self) -> None:
    """Frees the version in transit and the sampler's base copy."""
    super().close()
    delete_all(jax.tree.leaves(self._base))
