"""The pipeline package's public surface: every exported name exists and has a docstring."""

import inspect

import rlax_pipe.pipeline as pipeline
from rlax_pipe import timeline


def test_public_names_have_docstrings():
  missing = []
  for module in (pipeline, timeline):
    names = getattr(module, "__all__", None) or [
        n for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__]
    for name in names:
      obj = getattr(module, name)
      if (inspect.isclass(obj) or inspect.isfunction(obj)) and not inspect.getdoc(obj):
        missing.append(f"{module.__name__}.{name}")
  assert not missing, missing
