"""Kernel launches and matmul FLOPs of a compiled program, read from its optimized HLO text with
loop trip counts (issue #28 items 4-5).

`compiled.cost_analysis()` on TPU counts a while-loop body ONCE (the same FLOPs for 2 or 28
scanned layers), and no analysis says how many kernels one decode step launches. Both follow
from the HLO: every computation's multiplicity is the sum, over the instructions that call it,
of the caller's multiplicity times the call's repeat count (a while body's
`known_trip_count`, 1 otherwise). A while loop without a known trip count (the decode dispatch's
step loop) counts its body once: totals are then per iteration of that loop (per decode step).

The TPU writes batched matmuls as convolutions whose windows use strides, lhs dilation and
padding to stand for batch dims; a convolution's FLOPs count only the window taps that land on
real input elements (XLA's own rule), so such windows are not over-counted.

- Kernels: instructions of a non-fused computation (entry, while bodies and conditions, called
  computations) that XLA emits as a device kernel: everything but parameters, constants,
  tuples, get-tuple-element, bitcasts and control flow (while, call, conditional). On a GPU
  without command buffers each is one launch (a Triton/cuBLAS/custom-call kernel or fusion).
- Matmul FLOPs: 2 x (output elements) x (contracted elements) of every `dot` and
  `convolution`-as-matmul, fused or not (Kaplan et al. 2020's 2 FLOPs per multiply-add).
- Bytes: the memory traffic of every kernel, the rule of XLA's own `HloCostAnalysis` (bytes
  accessed = operands read + outputs written), with its two refinements that matter for a KV
  pool or a stacked-layer weight: an operand that a (fused) slice, dynamic-slice or gather reads
  counts only the part read, and a buffer that a dynamic-update-slice or scatter writes in place
  counts only the update (read 0, written = the update). Weighted by the loop trip counts like
  the kernels. Pallas kernels (Mosaic `tpu_custom_call` on TPU, Triton / Mosaic GPU) are
  opaque: their operands + outputs are counted apart (`kernel_bytes`), an upper bound for a kernel that reads
  only some pages of an operand (paged attention), a lower bound for one that re-reads blocks.
  Arrays are counted padded to their layout's tiles (TPU T(8,128) tiles), as the TPU's own
  `cost_analysis()` counts them. Checked (issue #28 notes): with every loop counted once, these
  rules give XLA's "bytes accessed" exactly for CPU programs, and within 1-2% of it for the
  TPU-compiled decode dispatch (reference and pallas_tpu; Mosaic kernels excluded).
"""

from __future__ import annotations

import re
from typing import Any

_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INST = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")
_ARRAY = re.compile(r"\b(pred|bf16|token|[suf]\d+|f8\w*|c64|c128)\[([\d,]*)\](\{[^}]*\})?")
_ITEM_BYTES = {"pred": 1, "bf16": 2, "token": 0, "c64": 8, "c128": 16}
_SLICING = frozenset({"slice", "dynamic-slice", "gather"})   # read only what they return
_IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})    # write only the update
# TPU custom calls that move no data: buffer allocation, a concatenation of adjacent buffers,
# an index-range promise.
# Pallas kernels, opaque to XLA: Mosaic (TPU), Triton and Mosaic GPU.
_OPAQUE_KERNELS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "triton_kernel_call",
                   "mosaic_gpu")
_NO_TRAFFIC_CALLS = ("AllocateBuffer", "ConcatBitcast", "AssumeGatherIndicesInBound")
_NOT_KERNELS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                          "while", "call", "conditional", "after-all", "partition-id",
                          "replica-id", "opt-barrier", "copy-done", "all-gather-done",
                          "all-reduce-done", "collective-permute-done", "send-done",
                          "recv-done", "async-done", "add-dependency"})


def _dims(type_text: str) -> tuple[int, ...]:
  m = _SHAPE.search(type_text)
  return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def parse(hlo: str) -> dict[str, dict[str, Any]]:
  """Computations of `hlo`: name -> {fused, entry, lines: [(name, type, opcode, rest)],
  shapes (name -> dims of its first array), types (name -> type text), root (name)}."""
  comps, cur = {}, None
  for line in hlo.splitlines():
    if not line.startswith(" ") and line.rstrip().endswith("{") and "=" not in line.split("(")[0]:
      m = _COMP.match(line.strip())
      if m:
        cur = comps.setdefault(m.group(1), {"fused": "fused" in m.group(1) or "wrapped" in
                                            m.group(1), "lines": [], "shapes": {},
                                            "types": {}, "root": None,
                                            "entry": line.startswith("ENTRY")})
        continue
    m = _INST.match(line) if cur is not None else None
    if m:
      root, name, type_text, opcode, rest = m.groups()
      cur["lines"].append((name, type_text, opcode, rest))
      cur["shapes"][name] = _dims(type_text)
      cur["types"][name] = type_text
      if root:
        cur["root"] = name
  return comps


def _cond_bound(comps: dict[str, dict[str, Any]], name: str, depth: int = 0) -> int | None:
  """N of a loop condition `counter < N` with N a constant (in the condition or a computation
  it calls); None when the bound is not a constant (a data-dependent loop)."""
  if name not in comps or depth > 3:
    return None
  consts = {}
  for inst, type_text, opcode, rest in comps[name]["lines"]:
    if opcode == "constant" and re.match(r"[su]\d+\[\]", type_text):  # an integer scalar
      m = re.match(r"(-?\d+)\)", rest)
      if m:
        consts[inst] = int(m.group(1))
  for _, _, opcode, rest in comps[name]["lines"]:
    if opcode == "compare" and "direction=LT" in rest:
      operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
      if len(operands) == 2 and operands[1] in consts:
        return consts[operands[1]]
    for callee, _, _ in _callees(opcode, rest, comps, depth + 1):
      n = _cond_bound(comps, callee, depth + 1)
      if n is not None:
        return n
  return None


def _callees(opcode: str, rest: str, comps=None, depth: int = 0) -> list[tuple[str, int, bool]]:
  """(computation, repeat count, is a kernel body) called by one instruction. A while loop's
  count is its `known_trip_count` (GPU/CPU HLO) or its condition's constant bound (TPU HLO)."""
  out = []
  if opcode == "while":
    body = re.search(r"body=%?([\w.\-]+)", rest)
    cond = re.search(r"condition=%?([\w.\-]+)", rest)
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
    n = int(trip.group(1)) if trip else None
    if n is None and comps is not None and cond and depth == 0:
      n = _cond_bound(comps, cond.group(1))
    trip = n is not None
    n = n if trip else 1
    if body:
      out.append((body.group(1), n, False))
    if cond:
      out.append((cond.group(1), n + (1 if trip else 0), False))
    return out
  for key in ("calls", "to_apply", "branch_computations"):
    for m in re.finditer(key + r"=\{?([%\w.\-, ]+)\}?", rest):
      for name in m.group(1).split(","):
        out.append((name.strip().lstrip("%"), 1, opcode in ("fusion", "custom-call")))
  return out


def _dot_flops(type_text: str, rest: str, shapes: dict[str, tuple[int, ...]]) -> float:
  operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
  contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
  if not operands or contracting is None or operands[0] not in shapes:
    return 0.0
  lhs = shapes[operands[0]]
  k = 1
  for d in (int(x) for x in contracting.group(1).split(",") if x):
    k *= lhs[d]
  out = 1
  for d in _dims(type_text):
    out *= d
  return 2.0 * out * k


def _window(rest: str, key: str, n: int, default: int) -> list[int]:
  m = re.search(r"\b" + key + r"=([\dx]+)", rest.split("window={", 1)[1]) if "window={" in rest \
      else None
  if not m:
    return [default] * n
  return [int(x) for x in m.group(1).split("x")]


def _valid_taps(out: int, inp: int, size: int, stride: int, pad_lo: int, lhs_dil: int,
                rhs_dil: int) -> int:
  """(output position, window tap) pairs of one spatial dim that land on a real input element
  (not padding, not a hole of lhs dilation): the multiply-adds that dim contributes."""
  span = (inp - 1) * lhs_dil + 1
  n = 0
  for o in range(out):
    for k in range(size):
      pos = o * stride + k * rhs_dil - pad_lo
      n += 0 <= pos < span and pos % lhs_dil == 0
  return n


def _conv_flops(type_text: str, rest: str, shapes: dict[str, tuple[int, ...]]) -> float:
  """A convolution, the TPU's spelling of a (batched) matmul, counted as XLA's
  `HloCostAnalysis` counts one: 2 x output batch x output features x input features (per
  group) x, per spatial dim, the (output, tap) pairs that land on a real input element. The
  TPU writes batch dims as windows padded by size-1 (one real tap per output) and dilated /
  strided windows; only real taps are multiplied in."""
  operands = _operands(rest)
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
  if len(operands) < 2 or labels is None or operands[0] not in shapes \
      or operands[1] not in shapes:
    return 0.0
  lhs, rhs, out = shapes[operands[0]], shapes[operands[1]], _dims(type_text)
  lhs_l, rhs_l, out_l = labels.groups()
  spatial = [c for c in lhs_l if c.isdigit()]
  n = len(spatial)
  size = re.search(r"window=\{size=([\dx]+)", rest)
  sizes = [int(x) for x in size.group(1).split("x")] if size else [1] * n
  stride = _window(rest, "stride", n, 1)
  lhs_dil = _window(rest, "lhs_dilate", n, 1)
  rhs_dil = _window(rest, "rhs_dilate", n, 1)
  pad = re.search(r"\bpad=([\d_x\-]+)", rest)
  pad_lo = [int(p.split("_")[0]) for p in pad.group(1).split("x")] if pad else [0] * n
  total = 2.0
  for d, c in enumerate(out_l):
    if c in "bf":
      total *= out[d]
  total *= rhs[rhs_l.index("i")]
  for j, c in enumerate(sorted(spatial, key=int)):
    total *= _valid_taps(out[out_l.index(c)], lhs[lhs_l.index(c)], sizes[j], stride[j],
                         pad_lo[j], lhs_dil[j], rhs_dil[j])
  return total


def _tiled_dims(dims: list[int], layout: str) -> list[int]:
  """`dims` padded to the layout's tile: "{1,0:T(8,128)(2,1)}" pads the most-minor dim to 128
  and the next to 8 x 2 (the second tile packs 2 rows into a 32-bit word: bf16)."""
  m = re.match(r"\{([\d,]*)(?::(.*))?\}", layout)
  if not m or not m.group(2):
    return dims
  order = [int(x) for x in m.group(1).split(",") if x]
  tiles = re.findall(r"\(([\d,]+)\)", m.group(2).split("S(")[0])
  if not tiles or not m.group(2).startswith("T("):
    return dims
  tile = [int(x) for x in tiles[0].split(",")]
  pack = [int(x) for x in tiles[1].split(",")] if len(tiles) > 1 else []
  out = list(dims)
  for i, t in enumerate(reversed(tile)):  # i = 0: the most-minor physical dim
    if i < len(order):
      t *= pack[0] if (i == 1 and len(pack) == 2) else 1
      out[order[i]] = -(-out[order[i]] // t) * t
  return out


def nbytes(type_text: str, tiled: bool = True) -> int:
  """Bytes of an HLO type (an array or a tuple of arrays). With `tiled`, each array is padded
  to its layout's tiles (what the TPU stores and moves, and what its `cost_analysis()` counts);
  CPU/GPU layouts have no tiles."""
  total = 0
  for dtype, dims, layout in _ARRAY.findall(type_text):
    shape = [int(x) for x in dims.split(",") if x]
    if tiled and layout:
      shape = _tiled_dims(shape, layout)
    n = 1
    for d in shape:
      n *= d
    size = _ITEM_BYTES.get(dtype)
    if size is None:  # s32 -> 4, f8e4m3fn -> 1, s4 -> 0.5
      bits = re.match(r"[suf](\d+)", dtype)
      size = int(bits.group(1)) / 8 if bits else 0
    total += n * size
  return int(total)


def _operands(rest: str) -> list[str]:
  return re.findall(r"%([\w.\-]+)", rest.split(")")[0])


def _written(comp: dict[str, Any], name: str, depth: int = 0) -> int:
  """Bytes an instruction writes: an in-place update writes its update only; a tuple the sum
  of its elements'."""
  line = next((ln for ln in comp["lines"] if ln[0] == name), None)
  if line is None or depth > 8:
    return nbytes(comp["types"].get(name, ""))
  _, type_text, opcode, rest = line
  ops = _operands(rest)
  if opcode == "tuple":
    return sum(_written(comp, o, depth + 1) for o in ops)
  if opcode == "dynamic-update-slice" and len(ops) > 1:
    return nbytes(comp["types"].get(ops[1], type_text))
  if opcode == "scatter" and len(ops) > 2:
    return nbytes(comp["types"].get(ops[-1], type_text))
  if opcode == "bitcast" and ops:
    return _written(comp, ops[0], depth + 1)
  return nbytes(type_text)


def _users(comp: dict[str, Any]) -> dict[str, list[tuple[str, str, int, str]]]:
  """value -> [(user, opcode, operand position, rest of the user's line)] (cached)."""
  if "users" not in comp:
    users: dict[str, list[tuple[str, str, int, str]]] = {}
    for name, _, opcode, rest in comp["lines"]:
      for pos, o in enumerate(_operands(rest)):
        users.setdefault(o, []).append((name, opcode, pos, rest))
    comp["users"] = users
  return comp["users"]


def _param(comp: dict[str, Any], index: int) -> str | None:
  return next((name for name, _, opcode, rest in comp["lines"]
               if opcode == "parameter" and rest.startswith(f"{index})")), None)


def _read(comps: dict[str, dict[str, Any]], comp: dict[str, Any], name: str,
          depth: int = 0) -> int:
  """Bytes read of value `name` inside a fused computation: the parts its slicing users return
  (also inside a nested fusion), nothing for an in-place update's buffer, the whole value
  otherwise."""
  full = nbytes(comp["types"].get(name, ""))
  part = 0
  for user, opcode, pos, rest in _users(comp).get(name, []):
    if opcode in _SLICING and pos == 0:
      part += nbytes(comp["types"][user])
    elif opcode in _IN_PLACE and pos == 0:
      continue
    elif opcode == "bitcast" and depth < 8:
      part += _read(comps, comp, user, depth + 1)
    elif opcode == "fusion" and depth < 8:
      callee = re.search(r"calls=%?([\w.\-]+)", rest)
      inner = comps.get(callee.group(1)) if callee else None
      param = _param(inner, pos) if inner else None
      if param is None:
        return full
      part += _read(comps, inner, param, depth + 1)
    else:
      return full
  return min(part, full)


def _fusion_bytes(comps: dict[str, dict[str, Any]], comp: dict[str, Any]) -> int:
  """Bytes accessed by one run of a fused computation (its parameters read, its root written)."""
  params = [name for name, _, opcode, _ in comp["lines"] if opcode == "parameter"]
  return sum(_read(comps, comp, p) for p in params) + _written(comp, comp["root"])


def _tuple_elements(type_text: str) -> list[str]:
  """Top-level elements of a tuple type "(a, (b, c), d)" (a non-tuple: itself)."""
  text = type_text.strip()
  if not text.startswith("("):
    return [text]
  out, depth, cur = [], 0, ""
  for ch in text[1:text.rindex(")")]:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      out.append(cur)
      cur = ""
    else:
      cur += ch
  return out + [cur]


def _instruction_bytes(comp: dict[str, Any], comps: dict[str, dict[str, Any]],
                       line: tuple[str, str, str, str]) -> int:
  """Bytes accessed by one kernel of a non-fused computation (`fusion`: by its body). An async
  pair moves its data once, at the start: X-start's output tuple holds the operand, the result
  and a context, so only the result is written (copy-start: a copy of the operand; slice-start
  reads only the slice); X-done moves nothing."""
  name, type_text, opcode, rest = line
  if opcode.endswith("-done") or (opcode == "custom-call" and any(
      f'custom_call_target="{t}"' in rest for t in _NO_TRAFFIC_CALLS)):
    return 0
  if opcode.endswith("-start"):
    elements = _tuple_elements(type_text)
    result = nbytes(elements[1]) if len(elements) > 1 else nbytes(type_text)
    operands = sum(nbytes(comp["types"].get(o, "")) for o in _operands(rest))
    if opcode == "copy-start":
      return 2 * operands
    if opcode == "slice-start":
      return 2 * result
    return operands + result
  if opcode == "fusion":
    callee = re.search(r"calls=%?([\w.\-]+)", rest)
    if callee and callee.group(1) in comps and comps[callee.group(1)]["root"]:
      return _fusion_bytes(comps, comps[callee.group(1)])
  ops = _operands(rest)
  read = 0
  for pos, o in enumerate(ops):
    if opcode in _SLICING and pos == 0:
      read += nbytes(type_text)
    elif not (opcode in _IN_PLACE and pos == 0):
      read += nbytes(comp["types"].get(o, ""))
  return read + _written(comp, name)


def costs(hlo: str) -> dict[str, float]:
  """Kernels and matmul FLOPs of one run of `hlo`'s entry computation, loop trip counts applied
  (a loop of unknown trip count counted once: per iteration).

  Returns:
    kernels (launches), matmul_flops, dots (matmul instructions executed), bytes (accessed by
    XLA's kernels, Pallas kernels apart), kernel_bytes (operands + outputs of Pallas kernels),
    bytes_loop_bodies_once (`bytes` with every loop counted once: the convention of
    `cost_analysis()`, to compare with its "bytes accessed"), loops_known,
    loops_unknown (while loops with / without a known trip count).

  Raises:
    ValueError: when `hlo` has no ENTRY computation.
  """
  comps = parse(hlo)
  entry = next((n for n, c in comps.items() if c["entry"]), None)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text.")
  edges: dict[str, list[tuple[str, int, bool]]] = {}
  known = unknown = 0
  for name, c in comps.items():
    edges[name] = []
    for _, _, opcode, rest in c["lines"]:
      calls = [e for e in _callees(opcode, rest, comps) if e[0] in comps]
      if opcode == "while":
        if (calls and calls[0][1] > 1) or '"known_trip_count"' in rest:
          known += 1
        else:
          unknown += 1
      edges[name] += calls
  indegree = {name: 0 for name in comps}
  for name in comps:
    for callee, _, _ in edges[name]:
      indegree[callee] += 1
  # Kahn's order over the call graph (a DAG): a computation's multiplicity is final before it
  # passes it on.
  mult = {name: 0.0 for name in comps}
  once = {name: 0.0 for name in comps}  # every loop counted once (cost_analysis' convention)
  kernel_comp = {name: False for name in comps}
  mult[entry] = once[entry] = 1.0
  ready = [n for n, d in indegree.items() if d == 0]
  while ready:
    name = ready.pop()
    for callee, n, inside_kernel in edges[name]:
      mult[callee] += mult[name] * n
      once[callee] = max(once[callee], once[name])
      kernel_comp[callee] = kernel_comp[callee] or inside_kernel or kernel_comp[name]
      indegree[callee] -= 1
      if indegree[callee] == 0:
        ready.append(callee)
  kernels = flops = dots = xla_bytes = kernel_bytes = bytes_once = 0.0
  for name, c in comps.items():
    m = mult[name]
    if not m:
      continue
    for line in c["lines"]:
      _, type_text, opcode, rest = line
      if not kernel_comp[name] and opcode not in _NOT_KERNELS and not opcode.endswith("-done"):
        kernels += m
        b = _instruction_bytes(c, comps, line)
        if opcode == "custom-call" and any(f'custom_call_target="{t}' in rest
                                           for t in _OPAQUE_KERNELS):
          kernel_bytes += m * b
        else:
          xla_bytes += m * b
          bytes_once += once[name] * b
      if opcode == "dot":
        flops += m * _dot_flops(type_text, rest, c["shapes"])
        dots += m
      elif opcode == "convolution":
        flops += m * _conv_flops(type_text, rest, c["shapes"])
        dots += m

  return {"kernels": kernels, "matmul_flops": flops, "dots": dots, "bytes": xla_bytes,
          "kernel_bytes": kernel_bytes, "bytes_loop_bodies_once": bytes_once,
          "loops_known": known, "loops_unknown": unknown}
