"""Validates the simulator against measured runs (no self-calibration).

`compare(run_dir)`: one threaded run directory (its cost_records.jsonl timed every operation):
the cost model fitted to those records (or a given one), the simulator with the run's logged
completion and prompt lengths resampled by group, against what the run measured over the steps
after `warmup_steps`: trained samples/s and tokens/s (target within 10%), per-sample staleness
(the lag of each sample's oldest token; target within 0.3 steps) and per-token staleness.

`validate()`: the three drivers measured in fresh processes and predicted by the virtual clock
and the simulator with one cost model fitted to all of them (`bench_drivers.compare_drivers`),
on a small configuration of the shipped warm start (or a tiny random model).

An earlier validation calibrated the simulator from reproducible runs' spans, which the virtual
clock had produced from hand-set constants: the fit recovered the constants exactly and the
comparison checked the model against itself. Reproducible runs are refused here.

JAX and the real pipeline are imported inside the functions that run it, so the rest of
`rlax_pipe.sim` stays JAX-free.
"""

from __future__ import annotations

import pathlib
import tempfile
from typing import Any, Sequence

import numpy as np

from rlax_pipe import costs as costs_lib
from rlax_pipe.sim import calibration
from rlax_pipe.sim import simulator as sim_lib

MAX_SEQ = 64
THROUGHPUT_TOL = 0.10  # relative
STALENESS_TOL = 0.3  # optimizer steps


def write_tiny_init(path: str | pathlib.Path, seed: int = 0) -> str:
  """Writes a tiny random Llama-style checkpoint (HF format) for the shipped tokenizer."""
  import jax  # pylint: disable=import-outside-toplevel
  from rlax_pipe.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from rlax_pipe.model import hf_io, transformer  # pylint: disable=import-outside-toplevel
  from rlax_pipe.tokenizer import default_tokenizer  # pylint: disable=import-outside-toplevel
  tok = default_tokenizer()
  cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                    head_dim=8, d_ff=64, max_seq_len=MAX_SEQ)
  hf_io.save_hf_checkpoint(path, jax.device_get(transformer.init_params(
      cfg, jax.random.key(seed))), cfg)
  return str(path)


def default_init(work_dir: str | pathlib.Path) -> str:
  """The shipped SFT warm start if present, else a tiny random model written under work_dir."""
  from rlax_pipe.pipeline import job as job_lib  # pylint: disable=import-outside-toplevel
  if (job_lib.builtin_warm_start_path() / "config.json").exists():
    return job_lib.BUILTIN_INIT
  path = pathlib.Path(work_dir) / "tiny_init"
  if not (path / "config.json").exists():
    write_tiny_init(path)
  return str(path)


def small_config(init: str, run_dir: str, steps: int = 16, seed: int = 0):
  """A small `RunConfig`: 2 + 4 CPU devices, 16 slots, 2 groups x 4 samples per step,
  64-token sequences, arithmetic with 3-4 terms, learner-wait max_lag 2."""
  # pylint: disable=import-outside-toplevel
  from rlax_pipe import objectives, tasks
  from rlax_pipe.learner import CheckpointConfig, LearnerConfig, OptimizerConfig
  from rlax_pipe.logprobs import SamplingConfig
  from rlax_pipe.pipeline import config as pconfig
  from rlax_pipe.pipeline import run as run_lib
  from rlax_pipe.pipeline import staleness
  from rlax_pipe.sampler import SamplerConfig
  from rlax_pipe.tokenizer import default_tokenizer
  tok = default_tokenizer()
  pipe = pconfig.PipelineConfig(
      num_steps=steps, group_size=4, seq_len=MAX_SEQ, eval_problems=2,
      staleness=staleness.StalenessConfig("learner-wait", 2, 2))
  sampler = SamplerConfig(num_slots=16, page_size=8, num_pages=16 * MAX_SEQ // 8,
                          max_seq_len=MAX_SEQ, max_new_tokens=MAX_SEQ, min_prefill_bucket=16,
                          eos_id=tok.eos_id, sampling=SamplingConfig(temperature=1.0), seed=seed)
  learner = LearnerConfig(mesh_axes=(("fsdp", 2), ("tp", 2)), seed=seed,
                          optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=0),
                          checkpoint=CheckpointConfig(async_save=False))
  return run_lib.RunConfig(
      run_dir=run_dir, init=init, sampler_mesh_axes=(("tp", 2),), learner=learner,
      objective=objectives.ObjectiveConfig(name="tis_pg"), sampler=sampler, pipeline=pipe,
      eval_slots=4, task_config=tasks.ArithmeticConfig(max_terms=4))


def compare(run_dir: str, warmup_steps: int, seeds: Sequence[int] = tuple(range(8)),
            cost_model: costs_lib.CostModel | None = None, name: str | None = None
            ) -> dict[str, Any]:
  """One table row: a threaded run's measured numbers and the simulator's prediction.

  Args:
    run_dir: a threaded run directory (timeline.jsonl, metrics.jsonl, config.json,
      cost_records.jsonl).
    warmup_steps: learner steps excluded from both sides.
    seeds: simulator seeds averaged.
    cost_model: the costs (default: fitted to this run's own timed operations).
    name: label of the row (default: the directory name).

  Returns:
    JSON-ready dict: configuration, "measured", "predicted", "cost_model",
    "throughput_rel_err", "sample_lag_abs_err", "token_lag_abs_err", "pass".

  Raises:
    ValueError: for a reproducible run (its times come from the virtual clock).
  """
  spans, rows, config = calibration.read_run(run_dir)
  p = config["pipeline"]
  if p["mode"] != "threaded":
    raise ValueError(f"compare: {run_dir} is a {p['mode']} run; the simulator is validated "
                     "against measured (threaded) runs only.")
  if cost_model is None:
    cost_model = calibration.calibrate_run(run_dir).cost_model
  meas = calibration.measured(rows, spans, warmup_steps, span_window=False)
  g = int(p["group_size"])
  lengths, _ = calibration.lengths_from_rows(rows, group_size=g)
  prompts, _ = calibration.lengths_from_rows(rows, group_size=g, key="prompt_lengths")
  records = costs_lib.read_records(pathlib.Path(run_dir) / calibration.COST_RECORDS)
  push = next((r.features.get("bytes", 0) for r in records if r.op == "push"), 0)
  num_steps = len(calibration.train_rows(rows))
  results = [sim_lib.simulate(calibration.sim_config_for_run(
      config, cost_model, lengths, prompts, num_steps, warmup_steps, s, push)) for s in seeds]
  pred = {k: float(np.mean([getattr(r, k) for r in results]))
          for k in ("tokens_per_s", "samples_per_s", "token_lag_mean", "sample_lag_mean",
                    "idle_sampler", "idle_learner", "slot_occupancy")}
  tput = pred["samples_per_s"] / meas["samples_per_s"] - 1.0
  lag = pred["sample_lag_mean"] - meas["sample_lag_mean"]
  return {"case": name or pathlib.Path(run_dir).name, "driver": p["driver"],
          "max_lag": p["staleness"]["max_lag"], "policy": p["staleness"]["policy"],
          "slots": config["sampler"]["num_slots"], "steps": num_steps,
          "warmup_steps": warmup_steps, "measured": meas, "predicted": pred,
          "cost_model": cost_model.to_dict(), "throughput_rel_err": tput,
          "sample_lag_abs_err": lag,
          "token_lag_abs_err": pred["token_lag_mean"] - meas["token_lag_mean"],
          "pass": bool(abs(tput) <= THROUGHPUT_TOL and abs(lag) <= STALENESS_TOL)}


def validate(init: str | None = None, work_dir: str | None = None,
             seeds: Sequence[int] = tuple(range(4)), steps: int = 16,
             drivers: Sequence[str] = ("sync", "async-batch", "pipeline"),
             warmup_steps: int = 3) -> dict[str, Any]:
  """The three drivers measured (fresh processes), the virtual clock and the simulator with one
  fitted cost model against them (`bench_drivers.compare_drivers` on `small_config`)."""
  from lib import bench_drivers  # pylint: disable=import-outside-toplevel
  work = pathlib.Path(work_dir or tempfile.mkdtemp(prefix="rlax_pipe_validate_"))
  work.mkdir(parents=True, exist_ok=True)
  init = init or default_init(work)
  base = small_config(init, str(work / "base"), steps)
  out = bench_drivers.compare_drivers(base, tuple(drivers), str(work), warmup_steps, seeds)
  out["init"] = init
  out["pass"] = bool(abs(out["virtual_vs_measured_throughput_error"]) <= THROUGHPUT_TOL
                     and abs(out["sim_vs_measured_throughput_error"]) <= THROUGHPUT_TOL
                     and abs(out["sim_vs_measured_staleness_error_steps"]) <= STALENESS_TOL)
  return out

