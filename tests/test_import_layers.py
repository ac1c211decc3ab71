"""The package's import graph follows its declared layers: no module imports a higher layer or a
sibling of its own layer, and the library never imports experiment code."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "rlax_pipe"

# Lowest first. A unit (a top-level module or subpackage of rlax_pipe) may import units of lower
# layers only (and itself). Layer 0 is the foundation: messages, configs, sharding rules, I/O.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("types", "config", "config_dict", "sharding", "platform_setup", "run_dir", "timeline",
     "tokenizer", "logprobs", "advantages", "offpolicy", "kl_penalty", "plots", "param_checksum",
     "cluster", "hlo_costs", "hlo_collectives", "host_rules", "router_replay"),
    ("model", "objectives", "tasks", "costs"),
    ("sampler", "learner", "grading", "model_dir"),
    ("evaluation", "aot", "fidelity", "envs"),
    ("pipeline",),
    ("sft", "sim"),
)
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _unit(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
  return path.relative_to(package).parts[0].removesuffix(".py")


def _imports(path: pathlib.Path):
  """(line, imported dotted name) of every import in the file, function-level ones included."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module == "rlax_pipe":
        for alias in node.names:
          yield node.lineno, f"rlax_pipe.{alias.name}"
      else:
        yield node.lineno, node.module


def _edges(package: pathlib.Path):
  for path in sorted(package.rglob("*.py")):
    for line, name in _imports(path):
      parts = name.split(".")
      if parts[0] in ("lib", "experiments"):
        yield path, line, name, None
      elif parts[0] == "rlax_pipe" and len(parts) > 1:
        yield path, line, name, parts[1]


def test_every_unit_has_a_layer():
  units = {_unit(p) for p in PACKAGE.rglob("*.py") if _unit(p) != "__init__"}
  assert not units - set(LAYER), f"declare the layer of {sorted(units - set(LAYER))} in LAYERS"


def violations(package: pathlib.Path = PACKAGE) -> list[str]:
  """One line per import that goes to a higher (or the same) layer or to experiment code."""
  bad = []
  for path, line, name, target in _edges(package):
    source = _unit(path, package)
    where = f"{path.relative_to(package.parent)}:{line}"
    if source == "__init__":
      continue
    if target is None:
      bad.append(f"{where} imports experiment code {name}")
    elif target != source and LAYER[target] >= LAYER[source]:
      bad.append(f"{where} ({source}, layer {LAYER[source]}) imports {name} (layer "
                 f"{LAYER[target]})")
  return bad


def test_no_import_goes_up_or_sideways():
  bad = violations()
  assert not bad, "\n".join(bad)


def test_the_check_catches_violations(tmp_path):
  pkg = tmp_path / "rlax_pipe"
  (pkg / "learner").mkdir(parents=True)
  (pkg / "learner" / "ok.py").write_text("from rlax_pipe import sharding\nimport numpy\n")
  (pkg / "learner" / "bad.py").write_text(
      "from rlax_pipe.pipeline import meshes\n\ndef f():\n  from rlax_pipe import sampler\n")
  (pkg / "model.py").write_text("from lib import sweep\n")
  bad = violations(pkg)
  assert len(bad) == 3, bad
  assert "imports rlax_pipe.pipeline (layer 4)" in bad[0]
  assert "imports rlax_pipe.sampler (layer 2)" in bad[1]  # a sibling, inside a function
  assert "experiment code lib" in bad[2]
