"""Kernel launches and matmul FLOPs of a compiled program, read from its optimized HLO text with
loop trip counts (issue #28 items 4-5).

`compiled.cost_analysis()` on TPU counts a while-loop body ONCE (the same FLOPs for 2 or 28
scanned layers), and no analysis says how many kernels one decode step launches. Both follow
from the HLO: every computation's multiplicity is the sum, over the instructions that call it,
of the caller's multiplicity times the call's repeat count (a while body's
`known_trip_count`, 1 otherwise). A while loop without a known trip count (the decode dispatch's
step loop) counts its body once: totals are then per iteration of that loop (per decode step).

Known limit (measured): the TPU writes batched matmuls as convolutions whose windows use
strides, lhs dilation and padding to stand for batch dims; only the plain "padded by size-1"
form is recognised, so other windows' taps are over-counted. The TPU-compiled decode matched
the model's matmul FLOPs exactly; the TPU-compiled tiny learner step (single chip, remat none)
read 48.6 GFLOP against 7.65 GFLOP from its CPU-compiled HLO (dots only, exact trip counts):
take learner FLOP ratios from CPU-compiled HLO. (Loop bounds read from TPU conditions were
checked correct there: 4 attention blocks of 64 in 256 tokens.)

- Kernels: instructions of a non-fused computation (entry, while bodies and conditions, called
  computations) that XLA emits as a device kernel: everything but parameters, constants,
  tuples, get-tuple-element, bitcasts and control flow (while, call, conditional). On a GPU
  without command buffers each is one launch (a Triton/cuBLAS/custom-call kernel or fusion).
- Matmul FLOPs: 2 x (output elements) x (contracted elements) of every `dot` and
  `convolution`-as-matmul, fused or not (Kaplan et al. 2020's 2 FLOPs per multiply-add).
"""

from __future__ import annotations

import re
from typing import Any

_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INST = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")
_NOT_KERNELS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                          "while", "call", "conditional", "after-all", "partition-id",
                          "replica-id", "opt-barrier", "copy-done", "all-gather-done",
                          "all-reduce-done", "collective-permute-done", "send-done",
                          "recv-done", "async-done", "add-dependency"})


def _dims(type_text: str) -> tuple[int, ...]:
  m = _SHAPE.search(type_text)
  return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def parse(hlo: str) -> dict[str, dict[str, Any]]:
  """Computations of `hlo`: name -> {fused, lines: [(name, type, opcode, rest)], shapes}."""
  comps, cur = {}, None
  for line in hlo.splitlines():
    if not line.startswith(" ") and line.rstrip().endswith("{") and "=" not in line.split("(")[0]:
      m = _COMP.match(line.strip())
      if m:
        cur = comps.setdefault(m.group(1), {"fused": "fused" in m.group(1) or "wrapped" in
                                            m.group(1), "lines": [], "shapes": {},
                                            "entry": line.startswith("ENTRY")})
        continue
    m = _INST.match(line) if cur is not None else None
    if m:
      name, type_text, opcode, rest = m.groups()
      cur["lines"].append((name, type_text, opcode, rest))
      cur["shapes"][name] = _dims(type_text)
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


def _conv_flops(type_text: str, rest: str, shapes: dict[str, tuple[int, ...]]) -> float:
  """A convolution, the TPU's spelling of a (batched) matmul: 2 x output elements x input
  features x contracted window taps. The TPU writes a batched matmul as a window padded by
  size-1 on both sides (one real tap per output): such dims are not multiplied in."""
  operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
  labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
  if len(operands) < 2 or labels is None or operands[1] not in shapes:
    return 0.0
  rhs = shapes[operands[1]]
  window = re.search(r"window=\{size=([\dx]+)(?: pad=([\d_x]+))?", rest)
  sizes = [int(x) for x in window.group(1).split("x")] if window else []
  pads = (window.group(2).split("x") if window and window.group(2) else ["0_0"] * len(sizes))
  # A spatial dim padded by size-1 on both sides is a batch dim in disguise (one real tap per
  # output); otherwise the window is contracted.
  batched = [sum(map(int, p.split("_"))) == 2 * (n - 1) and n > 1 for n, p in zip(sizes, pads)]
  per_out, spatial = 1, 0
  for size, label in zip(rhs, labels.group(1)):
    if label == "i":
      per_out *= size
    elif label.isdigit():
      if spatial < len(batched) and not batched[spatial]:
        per_out *= size
      spatial += 1
  out = 1
  for d in _dims(type_text):
    out *= d
  return 2.0 * out * per_out


def costs(hlo: str) -> dict[str, float]:
  """Kernels and matmul FLOPs of one run of `hlo`'s entry computation, loop trip counts applied
  (a loop of unknown trip count counted once: per iteration).

  Returns:
    kernels (launches), matmul_flops, dots (matmul instructions executed), loops_known,
    loops_unknown (while loops with / without a known trip count).
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
  kernel_comp = {name: False for name in comps}
  mult[entry] = 1.0
  ready = [n for n, d in indegree.items() if d == 0]
  while ready:
    name = ready.pop()
    for callee, n, inside_kernel in edges[name]:
      mult[callee] += mult[name] * n
      kernel_comp[callee] = kernel_comp[callee] or inside_kernel or kernel_comp[name]
      indegree[callee] -= 1
      if indegree[callee] == 0:
        ready.append(callee)
  kernels = flops = dots = 0.0
  for name, c in comps.items():
    m = mult[name]
    if not m:
      continue
    for _, type_text, opcode, rest in c["lines"]:
      if not kernel_comp[name] and opcode not in _NOT_KERNELS:
        kernels += m
      if opcode == "dot":
        flops += m * _dot_flops(type_text, rest, c["shapes"])
        dots += m
      elif opcode == "convolution":
        flops += m * _conv_flops(type_text, rest, c["shapes"])
        dots += m

  return {"kernels": kernels, "matmul_flops": flops, "dots": dots, "loops_known": known,
          "loops_unknown": unknown}
