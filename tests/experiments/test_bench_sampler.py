"""experiments/bench_sampler.py runs where only jax, flax, optax, numpy and absl are installed
(the accelerator machine): it must not import optional libraries."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCKED = ("ml_collections", "tokenizers", "sentencepiece", "safetensors", "transformers",
           "torch", "orbax", "hypothesis", "pytest")

_SCRIPT = f"""
import runpy, sys
class Block:
  def find_spec(self, name, path, target=None):
    if name.split('.')[0] in {BLOCKED!r}:
      raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
sys.path.insert(0, {str(ROOT / 'experiments')!r})
runpy.run_path({str(ROOT / 'experiments' / 'bench_sampler.py')!r}, run_name='bench')
from lib import sampler_presets, sampler_scaling  # everything the suites call
from rlax_pipe.sampler import kernels
print('IMPORTS-OK')
"""


def test_bench_imports_only_jax_flax_numpy_absl():
  out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
                       timeout=300, check=False)
  assert "IMPORTS-OK" in out.stdout, out.stderr[-2000:]
