"""The tiny-MoE preset runs the main job end to end on CPU: experiments/pipeline_rl.py with
--config=...:tiny_moe (the SFT warm start upcycled to 4 experts, top-2), pipeline driver with
in-flight updates, router load-balance / z-loss metrics in every train row."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a subprocess compiling sampler, learner and evaluation (CPU time in
# /work/notes/hspeed.md); kept to the fewest: 1 step, 1 shared device, 1 eval problem, 16 tokens
def test_tiny_moe_preset_runs_the_main_job(tmp_path):
  # LLVM at -O0: the run is compile-bound (the same programs, compiled ~30% faster)
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=1 "
                       "--xla_backend_optimization_level=0")
  out = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "pipeline_rl.py"),
       "--config=experiments/configs/pipeline_rl.py:tiny_moe", f"--config.run_dir={tmp_path}",
       "--config.pipeline.num_steps=1", "--config.pipeline.eval_problems=1",
       "--config.sampler.max_new_tokens=16"],
      env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary["steps"] == 1 and summary["driver"] == "pipeline"
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in rows if r["kind"] == "train"]
  assert len(train) == 1
  for r in train:
    assert math.isfinite(r["moe_load_balance_loss"]) and r["moe_z_loss"] > 0
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["init"] == "builtin_moe"
