"""Every public name of rlax_pipe.sampler is documented."""

import inspect

from rlax_pipe import sampler


def test_public_names_have_docstrings():
  for name in sampler.__all__:
    obj = getattr(sampler, name)
    assert inspect.getdoc(obj), f"rlax_pipe.sampler.{name} has no docstring"
    if inspect.isclass(obj):
      for attr, member in vars(obj).items():
        if not attr.startswith("_") and callable(member):
          assert inspect.getdoc(member), f"{name}.{attr} has no docstring"
