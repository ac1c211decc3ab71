"""LoRA adapters on any `api.Model`: which weights, their shapes and axes, init, and the merge.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3) replaces a
frozen weight W (input width I, output width O) by

    W' = W + s * B A,    A: [r, I],  B: [O, r],  s = alpha / r,

and trains only A and B. A starts uniform in [-1/sqrt(I), 1/sqrt(I)] (PEFT's default:
Kaiming-uniform with a = sqrt(5)), B at zero, so W' = W at initialization.

Design (stated once, used by learner, weight channel and sampler): adapters are applied
**merged**. `LoraAdapters.merge(base, adapters)` is a pure function returning the full params
tree with every targeted W replaced by W + s B A (the delta computed in float32, added in W's
dtype); the model's own `forward` then runs unchanged, so any `api.Model` (the built-in
transformer, an NNX module) gets LoRA without knowing about it. The learner differentiates the
loss through the merge with respect to the adapters only; the sampler keeps one copy of the
frozen base, receives only A and B per version, merges on its own devices and swaps the merged
tree in at a step boundary like any other weight update (so per-token versions stay exact).

Layout: a targeted parameter of shape [*S, *In, *Out] (S: leading stacked axes named "layers";
In: its first `n_in` axes after them, 1 unless the model says otherwise through a
`lora_input_dims` mapping, e.g. the built-in "wo" [H, D, E] has In = (H, D)) gets

    lora_a: [*S, r, *In]   logical axes (*S axes, "lora_rank", *In axes)
    lora_b: [*S, *Out, r]  logical axes (*S axes, *Out axes, "lora_rank")

so A and B shard like the weight they adapt. The adapters tree is a flat dict
{"layers/wq": {"lora_a": A, "lora_b": B}, ...} keyed by the base parameter's path joined by "/".

Letters: S stacked, I input width (product of In), O output width (product of Out), r rank.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import sharding as sharding_lib
from rlax_pipe.config import LoraConfig
from rlax_pipe.model import api

A_NAME, B_NAME = "lora_a", "lora_b"


class AdapterSpec(NamedTuple):
  """One adapted weight.

  Attributes:
    name: the base parameter's path joined by "/" (the adapters dict key).
    path: that path as a tuple of keys.
    target: the `LoraConfig.target_modules` entry it matched.
    stack: number of leading stacked ("layers") axes.
    n_in: number of input axes after the stacked ones.
    shape: the base weight's shape.
    axes: the base weight's logical axes.
  """

  name: str
  path: tuple[str, ...]
  target: str
  stack: int
  n_in: int
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]

  @property
  def in_shape(self) -> tuple[int, ...]:
    return self.shape[self.stack:self.stack + self.n_in]

  @property
  def out_shape(self) -> tuple[int, ...]:
    return self.shape[self.stack + self.n_in:]


def _key(k: Any) -> str:
  return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def _is_axes(x: Any) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


@dataclasses.dataclass(frozen=True)
class LoraAdapters:
  """The adapter space of `model` under `cfg` (hashable: a static jit argument / cache key).

  Offers the same three methods as an `api.Model` for its trainable params (`abstract_params`,
  `param_axes`, `init_params`, all about the adapters), so the learner's state, optimizer and
  shardings are built from it exactly as from a model, plus `merge`.

  Attributes:
    model: the base model (`api.Model`).
    cfg: the LoRA configuration (`cfg.rank` >= 1).

  Example:
    >>> lora = LoraAdapters(Transformer(ModelConfig()), LoraConfig(rank=8))
    >>> adapters = lora.init_params(jax.random.key(0))
    >>> logits, _ = lora.model.forward(lora.merge(base, adapters), tokens_BT, positions_BT)
  """

  model: api.Model
  cfg: LoraConfig

  def __post_init__(self):
    if not self.cfg.enabled:
      raise ValueError("LoraAdapters needs LoraConfig.rank >= 1 (rank 0 means LoRA off).")
    self.specs  # pylint: disable=pointless-statement  (validates the targets now)

  @functools.cached_property
  def specs(self) -> tuple[AdapterSpec, ...]:
    """Every adapted weight, in the params tree's flattening order.

    Raises:
      ValueError: if a target module matches no adaptable weight (the message lists the
        weight names that exist), or the rank exceeds a matched weight's input or output width.
    """
    abstract = self.model.abstract_params()
    axes_leaves = jax.tree_util.tree_flatten(self.model.param_axes(), is_leaf=_is_axes)[0]
    in_dims = dict(getattr(self.model, "lora_input_dims", {}) or {})
    targets, found, seen, out = self.cfg.target_modules, set(), [], []
    for (path, leaf), axes in zip(jax.tree_util.tree_flatten_with_path(abstract)[0],
                                  axes_leaves):
      keys = tuple(_key(k) for k in path)
      axes = tuple(axes) if axes is not None else (None,) * len(leaf.shape)
      stack = 0
      while stack < len(axes) and axes[stack] == sharding_lib.LAYERS:
        stack += 1
      if len(leaf.shape) - stack >= 2:
        seen.append("/".join(keys))
      hit = next((t for t in targets if t in keys), None)
      if hit is None or len(leaf.shape) - stack < 2:
        continue
      n_in = int(in_dims.get(hit, 1))
      spec = AdapterSpec("/".join(keys), keys, hit, stack, n_in, tuple(leaf.shape), axes)
      width = min(math.prod(spec.in_shape), math.prod(spec.out_shape))
      if self.cfg.rank > width:
        raise ValueError(f"LoraConfig.rank={self.cfg.rank} exceeds the smallest width {width} "
                         f"of weight {spec.name} {spec.shape}; use rank <= {width}.")
      found.add(hit)
      out.append(spec)
    missing = [t for t in targets if t not in found]
    if missing:
      raise ValueError(f"LoraConfig.target_modules {missing} match no weight matrix of "
                       f"{type(self.model).__name__}; its weight matrices are {seen}.")
    return tuple(out)

  @property
  def scale(self) -> float:
    """s = alpha / r."""
    return self.cfg.scale

  def _shapes(self, spec: AdapterSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    s, r = spec.shape[:spec.stack], self.cfg.rank
    return (*s, r, *spec.in_shape), (*s, *spec.out_shape, r)

  def abstract_params(self) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """Adapters tree of `jax.ShapeDtypeStruct` (the base weight's dtype), no allocation."""
    dtypes = {"/".join(_key(k) for k in p): leaf.dtype for p, leaf in
              jax.tree_util.tree_flatten_with_path(self.model.abstract_params())[0]}
    out = {}
    for spec in self.specs:
      a, b = self._shapes(spec)
      dt = dtypes[spec.name]
      out[spec.name] = {A_NAME: jax.ShapeDtypeStruct(a, dt), B_NAME: jax.ShapeDtypeStruct(b, dt)}
    return out

  def param_axes(self) -> dict[str, dict[str, tuple[str | None, ...]]]:
    """Logical axes of each adapter: A (*S, lora_rank, *In), B (*S, *Out, lora_rank)."""
    out = {}
    for spec in self.specs:
      s = spec.axes[:spec.stack]
      ins, outs = spec.axes[spec.stack:spec.stack + spec.n_in], spec.axes[spec.stack + spec.n_in:]
      out[spec.name] = {A_NAME: (*s, sharding_lib.LORA_RANK, *ins),
                        B_NAME: (*s, *outs, sharding_lib.LORA_RANK)}
    return out

  def init_params(self, rng: jax.Array) -> dict[str, dict[str, jax.Array]]:
    """Fresh adapters: A ~ U(-1/sqrt(I), 1/sqrt(I)) (PEFT default), B = 0 (so W' = W). Pure."""
    abstract = self.abstract_params()
    keys = jax.random.split(rng, max(len(self.specs), 1))
    out = {}
    for key, spec in zip(keys, self.specs):
      a, b = abstract[spec.name][A_NAME], abstract[spec.name][B_NAME]
      bound = 1.0 / math.sqrt(math.prod(spec.in_shape))
      out[spec.name] = {
          A_NAME: jax.random.uniform(key, a.shape, jnp.float32, -bound, bound).astype(a.dtype),
          B_NAME: jnp.zeros(b.shape, b.dtype)}
    return out

  def delta(self, spec: AdapterSpec, a: jax.Array, b: jax.Array) -> jax.Array:
    """s * B A in the base weight's layout [*S, *In, *Out], float32.

    Args:
      spec: the adapted weight.
      a: [*S, r, *In] adapter A.
      b: [*S, *Out, r] adapter B.

    Raises:
      ValueError: on shapes that do not match `spec` and the rank.
    """
    want_a, want_b = self._shapes(spec)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
      raise ValueError(f"adapters of {spec.name}: A {tuple(a.shape)} / B {tuple(b.shape)}, "
                       f"expected {want_a} / {want_b}.")
    s, r = spec.shape[:spec.stack], self.cfg.rank
    i, o = math.prod(spec.in_shape), math.prod(spec.out_shape)
    a_sri = a.astype(jnp.float32).reshape(*s, r, i)
    b_sor = b.astype(jnp.float32).reshape(*s, o, r)
    d_sio = jnp.einsum("...ri,...or->...io", a_sri, b_sor)
    return (self.scale * d_sio).reshape(spec.shape)

  def merge(self, base: Any, adapters: dict[str, dict[str, jax.Array]]) -> Any:
    """The full params tree with W' = W + s B A for every adapted weight (pure, jittable).

    Differentiable with respect to `adapters`; `base` is used as given (the learner stops no
    gradient: it differentiates with respect to the adapters argument only).

    Args:
      base: params tree of `model` (any placement).
      adapters: tree of `abstract_params()`'s structure.

    Returns:
      A params tree of `base`'s structure and dtypes.

    Raises:
      ValueError: if `adapters` lacks an adapted weight or holds an unknown one.
    """
    names = {spec.name for spec in self.specs}
    if set(adapters) != names:
      raise ValueError(f"adapters hold {sorted(adapters)}, expected {sorted(names)}.")
    by_name = {spec.name: spec for spec in self.specs}

    def one(path, w):
      spec = by_name.get("/".join(_key(k) for k in path))
      if spec is None:
        return w
      ad = adapters[spec.name]
      return (w.astype(jnp.float32) + self.delta(spec, ad[A_NAME], ad[B_NAME])).astype(w.dtype)
    return jax.tree_util.tree_map_with_path(one, base)


def adapters_for(model: api.Model, cfg: LoraConfig) -> LoraAdapters | None:
  """`LoraAdapters(model, cfg)` when LoRA is on (cfg.rank >= 1), else None."""
  return LoraAdapters(model, cfg) if cfg.enabled else None


def adapter_bytes(adapters: Any) -> int:
  """Total bytes of an adapters tree (arrays or `ShapeDtypeStruct`s)."""
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(adapters)))
