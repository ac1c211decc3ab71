"""The public surface of rlax_pipe.sim: every exported name is documented."""

import rlax_pipe.sim as sim


def test_public_names_have_docstrings():
  for name in sim.__all__:
    obj = getattr(sim, name)
    assert obj.__doc__ and obj.__doc__.strip(), name


def test_simulator_does_not_need_jax_compute():
  # The simulator module's imports are numpy + the pipeline's pure policy code.
  import rlax_pipe.sim.simulator as simulator  # pylint: disable=import-outside-toplevel
  src = open(simulator.__file__).read()
  assert "import jax" not in src and "jnp." not in src
