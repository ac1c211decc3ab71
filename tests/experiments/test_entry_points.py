"""What a user sees from experiments/pipeline_rl.py (issue #17 items 7 and 8): a one-line error
naming the --config field for a mistake (no traceback); on a one-device host the default run
shares the device; the run directory and TensorBoard command at start; a progress line per
learner step with a measured ETA; no orbax info lines; clock labels in rows and summary."""

import json
import logging
import os
import pathlib
import subprocess
import sys

from rlax_pipe import platform_setup
from rlax_pipe.tokenizer import EOS_ID

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(args, devices=8, timeout=600):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.run([sys.executable, str(ROOT / "experiments" / "pipeline_rl.py"), *args],
                        env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_issue_input_user_mistake_is_one_line_naming_the_flag():
  out = _run(["--config.pipeline.num_steps=-5"])
  assert out.returncode == 2
  assert "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == (
      "pipeline_rl.py: error: --config.pipeline.num_steps=-5 must be >= 1.")


def test_one_device_run_shares_it_and_reports_progress(tmp_path):
  run_dir = tmp_path / "one"
  out = _run(["--config=experiments/configs/pipeline_rl.py:tiny", f"--config.run_dir={run_dir}",
              "--config.pipeline.num_steps=2"], devices=1)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary["steps"] == 2 and summary["clock"] == "virtual"
  info = json.loads((run_dir / "run_info.json").read_text())
  assert "one device shared by both" in info["devices"]
  assert info["stop_ids"] == [EOS_ID]  # the shipped tokenizer's stop set, resolved by the job
  err = out.stderr
  assert f"run directory: {run_dir}  (TensorBoard: tensorboard --logdir {run_dir}/tb)" in err
  steps = [l for l in err.splitlines() if "] step " in l]
  assert len(steps) == 2 and "step 1/2 (50%)" in steps[0] and "step 2/2 (100%)" in steps[1]
  assert "ETA --" in steps[0] and "virtual t " in steps[0] and "(modelled)" in steps[0]
  assert "measured" in steps[1] and "ETA --" not in steps[1]
  assert "checkpoint_manager.py" not in err and "orbax" not in err  # orbax at warning level
  rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in rows if r["kind"] == "train"]
  assert all(r["clock"] == "virtual" and r["virtual_time_s"] == r["time_s"] for r in rows)
  assert train[0]["eta_s"] is None and train[1]["eta_s"] >= 0
  assert (run_dir / "hf" / "config.json").exists() and (run_dir / "hf" / "tokenizer.model").exists()


def test_library_log_filter():
  platform_setup.quiet_library_logging("warning")
  absl_logger = logging.getLogger("absl")
  filt = [f for f in absl_logger.filters if isinstance(f, platform_setup._LibraryFilter)]
  assert len(filt) == 1
  def record(path, level):
    return logging.LogRecord("absl", level, path, 1, "m", None, None)
  orbax_file = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "manager.py")
  assert not filt[0].filter(record(orbax_file, logging.INFO))
  assert filt[0].filter(record(orbax_file, logging.WARNING))
  assert filt[0].filter(record("/work/rlax_pipe/pipeline/hooks.py", logging.INFO))
  platform_setup.quiet_library_logging("info")  # back to showing everything for other tests
  assert len([f for f in absl_logger.filters
              if isinstance(f, platform_setup._LibraryFilter)]) == 1
