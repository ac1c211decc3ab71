"""Which devices the sampler and the learner of a run get, and their mesh shapes.

`RunConfig.sampler_mesh_axes` and `RunConfig.learner.mesh_axes` may each be () ("choose for me",
the default) or explicit (axis, size) pairs. `plan_devices` resolves the () ones from the
devices present: one device is shared by both roles; of n >= 2 devices the learner gets
floor(n / 2) and the sampler the rest (2 -> 1 + 1, 3 -> 1 + 2, 8 -> 4 + 4), shaped by
`learner_axes_for` (4 devices: fsdp 2 x tp 2, the default run's layout) and `sampler_axes_for`.
An explicit side keeps its shape and the other side gets the remaining devices. Every error
names the config fields (and their command-line spelling) that fix it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Sequence

from rlax_pipe import sharding as sharding_lib
from rlax_pipe.config_dict import ConfigError

MAX_SAMPLER_TP = 8
SAMPLER_FIELD = "RunConfig.sampler_mesh_axes"
LEARNER_FIELD = "RunConfig.learner.mesh_axes"

Axes = tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class DevicePlan:
  """The resolved device use of a run.

  Attributes:
    sampler_mesh_axes: sampler mesh shape, (axis, size) pairs.
    learner_mesh_axes: learner mesh shape, (axis, size) pairs.
    split: the devices of each role (`sharding.DeviceSplit`; `shared` when one device serves
      both).
    chosen: which of the two shapes were chosen here ("sampler", "learner"), not given.
  """

  sampler_mesh_axes: Axes
  learner_mesh_axes: Axes
  split: sharding_lib.DeviceSplit
  chosen: tuple[str, ...]

  def describe(self) -> str:
    """One line for the log: shapes, device ids, and what was chosen automatically."""
    def ids(ds):
      return [getattr(d, "id", d) for d in ds]

    how = f" (chosen for the devices present: {', '.join(self.chosen)})" if self.chosen else ""
    shared = "; one device shared by both" if self.split.shared else ""
    return (f"learner mesh {dict(self.learner_mesh_axes)} on devices {ids(self.split.learner)}, "
            f"sampler mesh {dict(self.sampler_mesh_axes)} on devices {ids(self.split.sampler)}"
            f"{shared}{how}")


def learner_axes_for(n: int) -> Axes:
  """Learner mesh for n devices: ("fsdp", n / t), ("tp", t), t the largest power of two with
  t * t <= n that divides n."""
  t = 1
  while (2 * t) * (2 * t) <= n and n % (2 * t) == 0:
    t *= 2
  return (("fsdp", n // t), ("tp", t))


def sampler_axes_for(n: int) -> Axes:
  """Sampler mesh for n devices: ("tp", n) up to MAX_SAMPLER_TP (one accelerator host's fast
  interconnect), else ("data", n / t), ("tp", t), t the largest divisor of n <= MAX_SAMPLER_TP."""
  if n <= MAX_SAMPLER_TP:
    return (("tp", n),)
  t = max(d for d in range(1, MAX_SAMPLER_TP + 1) if n % d == 0)
  return (("data", n // t), ("tp", t))


def _size(axes: Axes) -> int:
  return math.prod(size for _, size in axes)


def _found(devices: Sequence[Any]) -> str:
  kinds = collections.Counter(getattr(d, "platform", "?") for d in devices)
  return f"{len(devices)} device(s) found ({', '.join(f'{n} {k}' for k, n in kinds.items())})"


def plan_devices(sampler_mesh_axes: Axes, learner_mesh_axes: Axes,
                 devices: Sequence[Any]) -> DevicePlan:
  """Resolves the () mesh shapes and splits `devices` (module docstring).

  Args:
    sampler_mesh_axes: `RunConfig.sampler_mesh_axes` (() = choose).
    learner_mesh_axes: `RunConfig.learner.mesh_axes` (() = choose).
    devices: the devices present, e.g. `jax.devices()`.

  Returns:
    A `DevicePlan`.

  Raises:
    ConfigError: when the given shapes need more devices than exist, or leave none for the
      side to choose; the message names both fields and the fix.
  """
  devices = tuple(devices)
  n = len(devices)
  if n == 0:
    raise ConfigError("no device found (jax.devices() is empty).")
  sampler, learner = tuple(sampler_mesh_axes), tuple(learner_mesh_axes)
  chosen = tuple(name for name, axes in (("sampler", sampler), ("learner", learner)) if not axes)
  if not sampler and not learner:
    n_l = max(1, n // 2)
    learner, sampler = learner_axes_for(n_l), sampler_axes_for(max(1, n - n_l))
  elif not sampler or not learner:
    given, field = (learner, LEARNER_FIELD) if learner else (sampler, SAMPLER_FIELD)
    rest = n - _size(given)
    if rest < 1 and not (n == 1 and _size(given) == 1):
      other = SAMPLER_FIELD if learner else LEARNER_FIELD
      raise ConfigError(
          f"{field}={given!r} takes {_size(given)} devices and leaves none for {other}; "
          f"{_found(devices)}. Give {field.split('.', 1)[1]} fewer devices, or set it to () "
          "too (both chosen from the devices present).")
    rest = max(rest, 1)
    if learner:
      sampler = sampler_axes_for(rest)
    else:
      learner = learner_axes_for(rest)
  shared = n == 1 and _size(sampler) == 1 and _size(learner) == 1
  need = _size(sampler) + _size(learner)
  if not shared and need > n:
    cpu = all(getattr(d, "platform", "") == "cpu" for d in devices)
    hint = (f" On a CPU-only machine, XLA_FLAGS=--xla_force_host_platform_device_count={need} "
            "gives that many virtual devices." if cpu else "")
    raise ConfigError(
        f"{LEARNER_FIELD}={learner!r} ({_size(learner)} devices) + {SAMPLER_FIELD}={sampler!r} "
        f"({_size(sampler)} devices) need {need} devices, but {_found(devices)}. Set both to () "
        "(--config.learner.mesh_axes=\"()\" --config.sampler_mesh_axes=\"()\") to split the "
        "devices present automatically, or give smaller shapes." + hint)
  return DevicePlan(sampler_mesh_axes=sampler, learner_mesh_axes=learner, chosen=chosen,
                    split=sharding_lib.split_devices(devices, _size(sampler), _size(learner)))


def make_meshes(plan: DevicePlan):
  """(learner mesh, sampler mesh) of a plan.

  Raises:
    ConfigError: when an axis name does not fit its role (names the field).
  """
  meshes = []
  for field, axes, devs, rules in (
      (LEARNER_FIELD, plan.learner_mesh_axes, plan.split.learner, sharding_lib.LEARNER_RULES),
      (SAMPLER_FIELD, plan.sampler_mesh_axes, plan.split.sampler, sharding_lib.SAMPLER_RULES)):
    try:
      meshes.append(sharding_lib.make_mesh(devs, dict(axes), rules))
    except ValueError as e:
      raise ConfigError(f"{field}={axes!r}: {e}") from None
  return tuple(meshes)
