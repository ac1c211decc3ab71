"""What a compiled SPMD program communicates: its collectives, over which mesh axes, how big.

Reads the optimized HLO text of a compiled program (`jax.jit(...).lower(...).compile()
.as_text()`) and names, for every collective instruction (all-gather, all-reduce,
reduce-scatter, all-to-all, collective-permute, and their async -start forms), the mesh axes its
replica groups span, its result shapes and bytes, and whether it sits in a loop body or the
backward pass (from XLA's op_name metadata). Replica groups come in three spellings, all parsed:
explicit `{{0,2},{1,3}}`, iota `[2,2]<=[2,2]T(1,0)`, and Shardy's
`mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`; device ids are positions in the program's device
assignment, i.e. in `mesh.devices.flat` for programs jitted with shardings on `mesh`.

Used at run time by `rlax_pipe.aot` (the collectives of every compiled program it reports) and by
the learner benchmark (`experiments/lib/learner_bench.py`) and tests.

Two facts about XLA used by the readers of this module:
  * GSPMD writes "reduce to a sharded result" as an all-reduce whose result each device then
    slices to its shard (dynamic-slice by partition id). XLA's GPU and TPU pipelines fuse the
    pair into a reduce-scatter (ReduceScatterCreator); the CPU pipeline has no such pass, so on
    CPU a gradient reduce-scatter appears as an all-reduce of the gradient. `Collective.sliced`
    says whether every use of the all-reduce's result is such a slice.
  * Static instruction counts: an instruction in a while body runs once per iteration.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any, Iterable

import numpy as np
from jax.sharding import Mesh

COLLECTIVE_OPS: tuple[str, ...] = (
    "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s+"
    r"(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\((?P<operands>[^)]*)\)(?P<attrs>.*)$")
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=(\{\{[\d,{} ]*\}\}|\{\}"
                     r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                     r"|mesh\[[^\]]*\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{[^}]*\})")
_PAIRS = re.compile(r"source_target_pairs=\{([\d,{} ]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled program.

  Attributes:
    name: HLO instruction name.
    op: one of COLLECTIVE_OPS.
    axes: mesh axes its device groups span (sorted by mesh order); () = no communication.
    shapes: result array shapes (several for a combined / tuple collective).
    nbytes: result bytes on one device, per execution.
    in_loop: inside a while-loop body (runs once per iteration).
    backward: part of the backward pass (XLA op_name metadata contains "transpose(").
    sliced: per result element (one per shape): an all-reduce result that is only ever
      dynamic-sliced to a shard (a reduce-scatter in the CPU pipeline's spelling, see the
      module docstring); False for other ops.
  """

  name: str
  op: str
  axes: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  nbytes: int
  in_loop: bool
  backward: bool
  sliced: tuple[bool, ...] = ()


def _shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, tuple(int(d) for d in dims.split(",") if d))
          for dt, dims in _SHAPE.findall(type_text)]


def _iota_or_list(text: str) -> list[int]:
  """Device ids from an iota spelling `[dims]T(perm)` / `<=[dims]T(perm)`, or a plain list."""
  m = re.search(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  if not m or "<=" not in text and not text.lstrip().startswith("["):
    return [int(x) for x in re.findall(r"\d+", text)]
  dims = [int(x) for x in m.group(1).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(2):
    ids = np.transpose(ids, [int(x) for x in m.group(2).split(",")])
  return ids.reshape(-1).tolist()


def _groups(text: str, num_devices: int) -> list[list[int]]:
  """Device groups of a replica_groups attribute (any of the three spellings)."""
  if text.startswith("mesh["):
    sizes = [(n, int(s)) for n, s in re.findall(r"'([^']+)'=(\d+)", text.split("]")[0])]
    chosen = set(re.findall(r"'([^']+)'", text.rsplit("{", 1)[1]))
    order = np.arange(num_devices)
    perm = re.search(r"device_ids=\(((?:[^()]|\([^()]*\))*)\)", text)
    if perm:  # the mesh's positions hold these device ids (iota spelling, or a list)
      order = np.asarray(_iota_or_list(perm.group(1)), int).reshape(-1)
    ids = order.reshape([s for _, s in sizes])
    keep = [i for i, (n, _) in enumerate(sizes) if n in chosen]
    other = [i for i in range(len(sizes)) if i not in keep]
    ids = np.transpose(ids, other + keep).reshape(-1, int(np.prod([sizes[i][1] for i in keep])))
    return ids.tolist()
  if text.startswith("["):
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    shape = [int(x) for x in m.group(1).split(",")]
    return np.asarray(_iota_or_list(text[text.index("<="):]), int).reshape(shape).tolist()
  groups = re.findall(r"\{([\d, ]*)\}", text[1:-1])
  return [[int(x) for x in g.split(",") if x.strip()] for g in groups if g.strip()] or [
      list(range(num_devices))]


def _axes_of(groups: Iterable[Iterable[int]], mesh: Mesh) -> tuple[str, ...]:
  """Mesh axes along which device coordinates vary within some group."""
  shape = tuple(mesh.devices.shape)
  varying = set()
  for group in groups:
    coords = np.array([np.unravel_index(i, shape) for i in group])
    if len(coords) > 1:
      varying.update(int(a) for a in np.flatnonzero(coords.max(0) != coords.min(0)))
  return tuple(mesh.axis_names[a] for a in sorted(varying))


def _uses(lines: list[str], name: str) -> list[str]:
  pattern = re.compile(rf"%{re.escape(name)}\b")
  return [ln for ln in lines if pattern.search(ln.split("=", 1)[-1]) and
          not ln.lstrip().startswith(f"%{name} ")]


def _computations(lines: list[str]) -> dict[str, str]:
  """{computation name: its body text} of an HLO module."""
  out, name, body = {}, None, []
  for line in lines:
    m = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
    if m:
      name, body = m.group(1), []
    elif line.startswith("}") and name is not None:
      out[name] = "\n".join(body)
      name = None
    elif name is not None:
      body.append(line)
  return out


def _only_sliced(lines: list[str], comps: dict[str, str], name: str, depth: int = 0) -> bool:
  """Whether every use of %name keeps only a slice of it: a dynamic-slice, or a fusion whose
  computation dynamic-slices (looking through get-tuple-element, bitcast and copy)."""
  uses = _uses(lines, name)
  if not uses or depth > 3:
    return False
  for use in uses:
    m = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\S+\s+([\w\-]+)", use)
    if not m:
      return False
    target, op = m.groups()
    if op == "dynamic-slice":
      continue
    calls = re.search(r"calls=%([\w.\-]+)", use)
    if op == "fusion" and calls and " dynamic-slice(" in comps.get(calls.group(1), ""):
      continue
    if op in ("get-tuple-element", "bitcast", "copy") and _only_sliced(lines, comps, target,
                                                                        depth + 1):
      continue
    return False
  return True


def _sliced_elements(lines, comps, name, n) -> tuple[bool, ...]:
  """`_only_sliced` for each element of a (possibly tuple-shaped) result."""
  if n == 1:
    return (_only_sliced(lines, comps, name),)
  out = []
  for k in range(n):
    gte = [re.match(r"^\s*%([\w.\-]+)", ln).group(1) for ln in _uses(lines, name)
           if "get-tuple-element(" in ln and re.search(rf"index={k}\b", ln)]
    out.append(bool(gte) and all(_only_sliced(lines, comps, g) for g in gte))
  return tuple(out)


def collectives(hlo_text: str, mesh: Mesh) -> list[Collective]:
  """Every collective instruction of an optimized HLO module, with the mesh axes it spans.

  Args:
    hlo_text: `compiled.as_text()` of a program jitted with shardings on `mesh`.
    mesh: that mesh.

  Returns:
    list of `Collective`, in program order.
  """
  lines = hlo_text.splitlines()
  comps = _computations(lines)
  n = mesh.devices.size
  out = []
  for line in lines:
    m = _INSTR.match(line)
    if not m:
      continue
    attrs = m.group("attrs")
    g = _GROUPS.search(attrs)
    if g:
      groups = _groups(g.group(1), n)
    else:
      p = _PAIRS.search(attrs)
      pairs = re.findall(r"\{(\d+),(\d+)\}", p.group(1)) if p else []
      groups = [[int(a), int(b)] for a, b in pairs] or [list(range(n))]
    shapes = _shapes(m.group("type"))
    op = m.group("op")
    out.append(Collective(
        name=m.group("name"), op=op, axes=_axes_of(groups, mesh),
        shapes=tuple(s for _, s in shapes),
        nbytes=sum(_BYTES.get(dt, 4) * int(np.prod(s)) for dt, s in shapes),
        in_loop="/while/body/" in attrs, backward="transpose(" in attrs,
        sliced=_sliced_elements(lines, comps, m.group("name"), len(shapes)) if op == "all-reduce"
        else (False,) * len(shapes)))
  return out


def summarize(found: Iterable[Collective]) -> dict[str, dict[str, int]]:
  """{"op@axis+axis": {"count": static instructions, "bytes": result bytes per device summed
  over them (each counted once, loops not unrolled), "in_loop": how many sit in a loop body}}."""
  out: dict[str, dict[str, int]] = {}
  for c in found:
    key = f"{c.op}@{'+'.join(c.axes) or 'none'}"
    row = out.setdefault(key, {"count": 0, "bytes": 0, "in_loop": 0})
    row["count"] += 1
    row["bytes"] += c.nbytes
    row["in_loop"] += int(c.in_loop)
  return dict(sorted(out.items()))


def weight_shapes(param_shapes: Iterable[tuple[int, ...]],
                  shard_factors: Iterable[int]) -> set[tuple[int, ...]]:
  """Shapes a weight (or its gradient) may take in a per-device program: each param shape,
  with or without its leading layer axis (or a layer axis of 1), with any dimension divided by
  any of `shard_factors` (tensor / FSDP splits), in any order of dimensions (XLA emits the
  gradient of a contraction in whatever dimension order its dot produces)."""
  factors = sorted({1, *shard_factors})
  out = set()
  for shape in param_shapes:
    for base in (shape, shape[1:], (1,) + shape[1:]):
      if not base:
        continue
      options = [[d // f for f in factors if d % f == 0] for d in base]
      for combo in itertools.product(*options):
        out.update(itertools.permutations(combo))
  return out


def collective_findings(hlo: str, param_shapes: Iterable[tuple[int, ...]],
                        mesh: Mesh) -> dict[str, Any]:
  """What the collectives over the `fsdp` axis of a compiled learner micro-batch program move.

  A collective over fsdp is a weight all-gather when every result shape is a weight's (see
  `weight_shapes`, with the tp, fsdp and tp x fsdp splits of `mesh`), a gradient
  reduce-scatter when it is in the backward pass and reduces a weight-shaped array (a
  reduce-scatter op, or an all-reduce whose every use is a per-device slice: the CPU spelling),
  and an activation collective when it moves an array that is neither weight-shaped nor a few
  (<= 64) elements (goal: none).

  Args:
    hlo: optimized HLO text (`compiled.as_text()`) of a program jitted with shardings on `mesh`
      (a CPU mesh or a TPU topology mesh).
    param_shapes: the model's parameter shapes (global, unsharded).
    mesh: that mesh; its axes named `fsdp` / `tp` (absent axes count as size 1).

  Returns:
    JSON-able dict: mesh (axis sizes), summary (`summarize`), weight_all_gathers_over_fsdp,
    gradient_reduce_scatters_over_fsdp, activation_collectives_over_fsdp, how many of those run
    inside a loop (`..._in_loops`: once per layer or chunk) and each one's op, shapes, bytes,
    pass (forward / backward) and whether it is in a loop (`..._detail`).
  """
  found = collectives(hlo, mesh)
  sizes = dict(mesh.shape)
  tp, fsdp = sizes.get("tp", 1), sizes.get("fsdp", 1)
  weights = weight_shapes(param_shapes, [tp, fsdp, tp * fsdp])
  over = [c for c in found if "fsdp" in c.axes]
  small = lambda shape: int(np.prod(shape)) <= 64
  activations = [c for c in over if any(s not in weights and not small(s) for s in c.shapes)]
  return {
      "mesh": {k: int(v) for k, v in sizes.items()},
      "summary": summarize(found),
      "weight_all_gathers_over_fsdp": sum(
          c.op == "all-gather" and all(s in weights for s in c.shapes) for c in over),
      "gradient_reduce_scatters_over_fsdp": sum(
          c.backward and any(s in weights and (c.op == "reduce-scatter" or sl)
                             for s, sl in zip(c.shapes, c.sliced)) for c in over),
      "activation_collectives_over_fsdp": len(activations),
      "activation_collectives_over_fsdp_in_loops": sum(c.in_loop for c in activations),
      "activation_collectives_over_fsdp_detail": [
          {"op": c.op, "shapes": c.shapes, "bytes": c.nbytes,
           "pass": "backward" if c.backward else "forward", "in_loop": c.in_loop}
          for c in activations],
  }
