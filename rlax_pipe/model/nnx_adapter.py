"""`NnxModel`: a user's flax NNX decoder behind `api.Model`.

The module is split once with `nnx.split` into a graph definition (static, hashable) and its
`nnx.Param` state. The state travels as a plain nested dict of arrays with string keys (the
`nnx.to_pure_dict` form, list indices written as strings), so the optimizer, the weight channel,
the checkpoint and the sampler handle it exactly like the built-in params; `forward` rebuilds the
module inside the jitted function (`nnx.replace_by_pure_dict` + `nnx.merge`) and calls it.

The module must be called as
  `module(tokens_BT, positions_BT, *, segment_ids_BT=None, cache=None, valid_BT=None)
   -> (logits [B, T, V], cache or None)`
and honour the KV-cache contract of `api` (use `api.attend_with_cache` once per layer, and
`api.packed_causal_mask` without a cache). Logits are cast to float32 here. Every piece of the
module's state must be an `nnx.Param` (deterministic decoders: no dropout RNG, no batch stats).

Logical axes (for the shardings) come, per parameter, from the `nnx.Param` sharding metadata
(`nnx.with_partitioning(init, ("embed", "mlp"), eager_sharding=False)`, or `sharding_names=`),
which must name logical axes of `rlax_pipe.sharding.LOGICAL_AXES`; or from `axes`, a tree of the
params' structure (or a callable `(path, shape) -> axes`). A parameter with neither is kept
whole on every device (replicated).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp

from rlax_pipe import sharding as sharding_lib

_METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")
AxesFn = Callable[[str, tuple[int, ...]], "tuple[str | None, ...] | None"]


def _to_str_keys(tree: Any) -> Any:
  if isinstance(tree, Mapping):
    return {str(k): _to_str_keys(v) for k, v in tree.items()}
  return tree


def _to_module_keys(template: Any, tree: Any) -> Any:
  """`tree` (string keys) with the key types of `template` (an `nnx.to_pure_dict` result)."""
  if isinstance(template, Mapping):
    return {k: _to_module_keys(v, tree[str(k)]) for k, v in template.items()}
  return tree


def _metadata_axes(var: nnx.Variable) -> tuple | None:
  meta = var.get_metadata()
  for key in _METADATA_KEYS:
    axes = meta.get(key)
    if isinstance(axes, (tuple, list)) and all(a is None or isinstance(a, str) for a in axes):
      return tuple(axes)
  return None


def _check_axes(name: str, axes: tuple, shape: tuple[int, ...]) -> tuple:
  if len(axes) != len(shape):
    raise ValueError(f"NnxModel: parameter {name} has shape {shape} but logical axes {axes}; give "
                     "one name (or None) per dimension.")
  unknown = [a for a in axes if a is not None and a not in sharding_lib.LOGICAL_AXES]
  if unknown:
    raise ValueError(
        f"NnxModel: parameter {name} names axes {unknown}, which are not logical axes; use "
        f"names from rlax_pipe.sharding.LOGICAL_AXES {sharding_lib.LOGICAL_AXES} (mesh axes "
        "come from the rules tables), or pass axes= to NnxModel.create.")
  return axes


@dataclasses.dataclass(frozen=True)
class NnxModel:
  """A flax NNX decoder as an `api.Model`. Build it with `NnxModel.create`.

  Attributes:
    graphdef: the module's `nnx.GraphDef` (static structure; hashable).
    factory: `factory(rngs: nnx.Rngs) -> nnx.Module`, used by `init_params`.
    vocab_size, max_seq_len, n_layers, n_kv_heads, head_dim: see `api.Model`.
  """

  graphdef: Any
  factory: Callable[[nnx.Rngs], nnx.Module]
  vocab_size: int
  max_seq_len: int
  n_layers: int
  n_kv_heads: int
  head_dim: int
  _abstract_state: Any = dataclasses.field(compare=False, repr=False)
  _pure_template: Any = dataclasses.field(compare=False, repr=False)
  _axes: Any = dataclasses.field(compare=False, repr=False)

  @classmethod
  def create(cls, factory: Callable[[nnx.Rngs], nnx.Module], *, vocab_size: int,
             max_seq_len: int, n_layers: int, n_kv_heads: int, head_dim: int,
             axes: Any | AxesFn = None) -> "NnxModel":
    """Wraps the modules `factory` builds (abstractly evaluated once; nothing is allocated).

    Args:
      factory: `factory(rngs) -> nnx.Module`, e.g. `lambda rngs: MyDecoder(cfg, rngs=rngs)`.
      vocab_size, max_seq_len, n_layers, n_kv_heads, head_dim: see `api.Model`; the KV geometry
        must match the keys / values the module passes to `api.attend_with_cache`.
      axes: logical axes for parameters without sharding metadata: a tree of the params'
        structure with tuple leaves, or a callable `(path, shape) -> tuple or None` where path
        is the `jax.tree_util.keystr` of the parameter (e.g. "['blocks']['0']['wq']['kernel']").

    Raises:
      ValueError: if the module has non-`nnx.Param` state, or axes have the wrong rank or name
        non-logical axes (the message names the parameter).
    """
    abstract_module = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
    graphdef, state, rest = nnx.split(abstract_module, nnx.Param, ...)
    if jax.tree.leaves(rest):
      raise ValueError(
          "NnxModel: the module has state that is not nnx.Param "
          f"({sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=_is_var)})}); "
          "only deterministic decoders whose whole state is nnx.Param are supported.")
    template = nnx.to_pure_dict(state)
    axes_tree = cls._logical_axes(state, axes)
    return cls(graphdef, factory, vocab_size, max_seq_len, n_layers, n_kv_heads, head_dim,
               state, template, axes_tree)

  @staticmethod
  def _logical_axes(state: nnx.State, axes: Any | AxesFn) -> Any:
    var_tree = _to_str_keys(_var_dict(state))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(var_tree, is_leaf=_is_var)
    given = None
    if axes is not None and not callable(axes):
      given = treedef.flatten_up_to(axes)
    out, replicated = [], []
    for i, (path, var) in enumerate(leaves):
      name, shape = jax.tree_util.keystr(path), tuple(var.get_value().shape)
      ax = _metadata_axes(var)
      if ax is None and given is not None:
        ax = given[i]
      elif ax is None and callable(axes):
        ax = axes(name, shape)
      if ax is None:
        replicated.append(name)
        ax = (None,) * len(shape)
      out.append(_check_axes(name, tuple(ax), shape))
    if replicated:
      logging.info("NnxModel: %d parameter(s) without logical axes are replicated: %s",
                   len(replicated), replicated)
    return jax.tree_util.tree_unflatten(treedef, out)

  def abstract_params(self) -> Any:
    """String-keyed dict of `jax.ShapeDtypeStruct`, one per `nnx.Param`."""
    return _to_str_keys(self._pure_template)

  def param_axes(self) -> Any:
    """Logical axes per parameter (metadata, else `axes`, else replicated)."""
    return self._axes

  def init_params(self, rng: jax.Array) -> Any:
    """Fresh params of `factory(nnx.Rngs(rng))` (pure; jittable)."""
    _, state = nnx.split(self.factory(nnx.Rngs(rng)), nnx.Param)
    return _to_str_keys(nnx.to_pure_dict(state))

  def params_of(self, module: nnx.Module) -> Any:
    """The params pytree of an existing module of this model (e.g. a pretrained one).

    Raises:
      ValueError: if its parameter shapes differ from this model's.
    """
    _, state = nnx.split(module, nnx.Param)
    params = _to_str_keys(nnx.to_pure_dict(state))
    want = jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), self.abstract_params())
    got = jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), params)
    if want != got:
      raise ValueError(f"NnxModel.params_of: the module's params {got} differ from the "
                       f"model's {want}.")
    return params

  def module(self, params: Any) -> nnx.Module:
    """The module with `params` (inside jit: tracers), via `nnx.merge`."""
    state = jax.tree.map(lambda v: v, self._abstract_state, is_leaf=_is_var)  # fresh copy
    nnx.replace_by_pure_dict(state, _to_module_keys(self._pure_template, params))
    return nnx.merge(self.graphdef, state)

  def forward(self, params, tokens_BT, positions_BT, *, segment_ids_BT=None, cache=None,
              valid_BT=None, remat=False):
    """Calls the merged module (api contract); `remat` rematerialises the whole call."""
    def call(p):
      return self.module(p)(tokens_BT, positions_BT, segment_ids_BT=segment_ids_BT,
                            cache=cache, valid_BT=valid_BT)

    logits, new_cache = (jax.checkpoint(call) if remat else call)(params)
    return logits.astype(jnp.float32), new_cache


def _is_var(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _var_dict(state: nnx.State) -> Any:
  """Nested dict of the state's `nnx.Variable`s (keys as in `nnx.to_pure_dict`)."""
  out: dict = {}
  for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)[0]:
    node = out
    keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = var
  return out
