"""The reference policy of the KL term (`ObjectiveConfig.kl`): a frozen copy of the initial (or a
given HF model directory's) params on the learner shardings, in the model's compute dtype.

The learner holds it beside its state (`Learner.reference_params`); the train step scores the
batch under it for k3 KL(pi || pi_ref) (Schulman 2020, "Approximating KL divergence").
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh
import numpy as np

from rlax_pipe.learner import sharding as sharding_lib
from rlax_pipe.model import Model, ModelLike, as_model
from rlax_pipe.model import hf_io


def _reference_dtype(model: Model, dtype: Any) -> Any:
  """The reference copy's dtype of a param leaf: the model's compute dtype for floating leaves
  (the built-in model casts params to it anyway), unchanged otherwise or for a model without
  a `compute_dtype`."""
  cdt = getattr(model, "compute_dtype", None)
  return np.dtype(cdt) if cdt is not None and np.issubdtype(dtype, np.floating) else dtype


def abstract_reference(model: ModelLike, mesh: Mesh) -> Any:
  """The reference params (`ObjectiveConfig.kl`) as abstract arrays: the params' shapes and
  learner shardings, in the model's compute dtype (nothing allocated)."""
  model = as_model(model)
  shardings = sharding_lib.param_shardings(model, mesh)
  return jax.tree.map(
      lambda a, sh: jax.ShapeDtypeStruct(a.shape, _reference_dtype(model, a.dtype), sharding=sh),
      model.abstract_params(), shardings)


def reference_bytes(model: ModelLike, mesh: Mesh) -> dict[str, int]:
  """Memory of the reference params: total bytes and the largest per-device share (bytes)."""
  ref = abstract_reference(model, mesh)
  total = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(ref))
  per_device = sum(
      int(np.prod(a.sharding.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize
      for a in jax.tree.leaves(ref))
  return {"reference_bytes": total, "reference_bytes_per_device": per_device}


def make_reference(model: Model, mesh: Mesh, params: Any) -> Any:
  """A copy of `params` on the learner shardings in the compute dtype (a new buffer: the
  learner's own params are donated by every step, the reference never changes)."""
  target = abstract_reference(model, mesh)
  cast = jax.jit(lambda p: jax.tree.map(lambda x, t: x.astype(t.dtype), p, target),
                 out_shardings=jax.tree.map(lambda t: t.sharding, target))
  ref = cast(params)
  if any(r is p for r, p in zip(jax.tree.leaves(ref), jax.tree.leaves(params))):
    ref = jax.tree.map(lambda x: x.copy(), ref)  # an identity cast may alias the input
  return ref


def load_reference_params(model: Model, path: str) -> Any:
  """Host params of an HF-format model directory (`ObjectiveConfig.kl_reference`).

  Raises:
    ValueError: if the directory cannot be read or its params do not match the model's tree
      and shapes (the message names the field, the path and the difference).
  """
  try:
    _, params = hf_io.load_hf_checkpoint(path)
  except (ValueError, FileNotFoundError, OSError) as e:
    raise ValueError(f"ObjectiveConfig.kl_reference={path!r}: {e}") from None
  want = jax.tree.map(lambda a: a.shape, model.abstract_params())
  got = jax.tree.map(lambda a: tuple(np.shape(a)), params)
  if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
    raise ValueError(f"ObjectiveConfig.kl_reference={path!r}: its params do not match the "
                     "learner's model (tree or shapes differ); pass a checkpoint of the same "
                     "architecture.")
  return params


def reference_shardings(model: ModelLike, mesh: Mesh) -> Any:
  """Learner shardings of the reference params (the full model's params, also under LoRA)."""
  return jax.tree.map(lambda t: t.sharding, abstract_reference(model, mesh))
