"""Every public name re-exported by a package has a docstring (STYLE: small, documented surface)."""

import importlib
import inspect

import pytest

PACKAGES = ["rlax_pipe.model", "rlax_pipe.sampler", "rlax_pipe.learner", "rlax_pipe.pipeline",
            "rlax_pipe.tasks", "rlax_pipe.sim", "rlax_pipe.tokenizer",
            "rlax_pipe.costs", "rlax_pipe.envs"]


@pytest.mark.parametrize("package", PACKAGES)
def test_public_names_have_docstrings(package):
  mod = importlib.import_module(package)
  assert mod.__doc__, f"{package} has no module docstring"
  names = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
  missing = []
  for name in names:
    obj = getattr(mod, name)
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
      if not inspect.getdoc(obj):
        missing.append(name)
  assert not missing, f"{package}: no docstring on {missing}"
