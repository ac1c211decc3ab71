"""The public surface of rlax_pipe.sim: every exported name is documented."""

import os
import pathlib
import subprocess
import sys

import rlax_pipe.sim as sim


def test_public_names_have_docstrings():
  for name in sim.__all__:
    obj = getattr(sim, name)
    assert obj.__doc__ and obj.__doc__.strip(), name


def test_simulator_imports_no_jax():
  """In a fresh interpreter, importing the simulator loads no JAX: it shares only the
  pipeline's host rules (`pipeline.rules`, staleness, queue), never the engine or the learner
  (issue #25)."""
  code = ("import sys; import rlax_pipe.sim, rlax_pipe.sim.simulator, rlax_pipe.sim.whatif; "
          "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(pathlib.Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       check=True, timeout=300)
  assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
