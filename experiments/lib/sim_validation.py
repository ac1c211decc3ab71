"""Validates the calibrated simulator against real pipeline runs (reproducible mode).

For each `ValidationCase`: run the real pipeline (`rlax_pipe.pipeline.run.run`, a tiny model,
the reproducible driver whose virtual clock follows the case's `CostModel`), calibrate the
simulator from the run directory (`calibration.calibrate_run`), simulate the same configuration
for the same number of steps with several length seeds, and compare over the same window
(steps after `warmup_steps`): throughput (trained completion tokens/s; target within 10%) and
mean per-token staleness (target within 0.3 steps).

Three predictions per case, differing only in the length distribution:
  * "metrics": everything from the run directory; lengths are the log-normal matched to the
    per-step means of metrics.jsonl (the only length information run.py logs);
  * "recorded": the trained samples' exact lengths, recorded while the real run executes by
    wrapping `Trainer.train_on` (run.py's metrics carry per-step totals only), resampled by
    whole prompt groups (`distributions.GroupedEmpirical`);
  * "replay": the recorded groups in training order (`distributions.Replay`), one simulation.
    For round-based drivers (and pipelines that train groups in start order) the simulator
    then reproduces the run exactly, so this column isolates the simulator's mechanics from
    length sampling.

JAX and the real pipeline are imported inside the functions that run it, so the rest of
`rlax_pipe.sim` stays JAX-free.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile
from typing import Any, Sequence

import numpy as np

from rlax_pipe.pipeline.config import CostModel
from rlax_pipe.sim import calibration, distributions
from rlax_pipe.sim import simulator as sim_lib

MAX_SEQ = 64
THROUGHPUT_TOL = 0.10  # relative
STALENESS_TOL = 0.3  # optimizer steps


@dataclasses.dataclass(frozen=True)
class ValidationCase:
  """One real run to compare with the simulator.

  Attributes:
    name: label in the table.
    driver: "sync", "async-batch" or "pipeline".
    max_lag: staleness bound (None = unbounded), policy `policy`.
    slots: sampler decode slots.
    groups_per_step, group_size: learner batch = groups_per_step * group_size samples.
    num_steps: learner steps of the real run (and of the simulation).
    warmup_steps: steps excluded from both measurements.
    policy: staleness policy.
    cost_model: the reproducible driver's virtual-clock costs.
  """

  name: str
  driver: str
  max_lag: int | None
  slots: int
  groups_per_step: int = 2
  group_size: int = 4
  num_steps: int = 30
  warmup_steps: int = 5
  policy: str = "block"
  cost_model: CostModel = CostModel()


# Rollout-bound pipelines at two bounds, a train-bound pipeline, and the two round drivers.
DEFAULT_CASES: tuple[ValidationCase, ...] = (
    ValidationCase("pipeline_lag1", "pipeline", 1, slots=16),
    ValidationCase("pipeline_lag4", "pipeline", 4, slots=16),
    ValidationCase("pipeline_lag4_trainbound", "pipeline", 4, slots=16,
                   cost_model=CostModel(train_per_token_s=0.002)),
    ValidationCase("async_batch_lag1", "async-batch", 1, slots=8),
    ValidationCase("sync", "sync", 0, slots=8),
)


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
  from rlax_pipe.pipeline import run as run_lib  # pylint: disable=import-outside-toplevel
  if (run_lib.builtin_warm_start_path() / "config.json").exists():
    return run_lib.BUILTIN_INIT
  path = pathlib.Path(work_dir) / "tiny_init"
  if not (path / "config.json").exists():
    write_tiny_init(path)
  return str(path)


def run_config(case: ValidationCase, init: str, run_dir: str, seed: int = 0):
  """The `RunConfig` of a case: tiny sampler/learner meshes (2 + 4 CPU devices), arithmetic
  task with 3-4 terms, reproducible mode, evaluation and checkpoints only at the ends."""
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
  g = case.groups_per_step
  pipe = pconfig.PipelineConfig(
      driver=case.driver, mode="reproducible", num_steps=case.num_steps, group_size=case.group_size, seq_len=MAX_SEQ,
      staleness=staleness.StalenessConfig(case.policy, case.max_lag, g),
      eval_every=10 * case.num_steps, eval_problems=2, checkpoint_every=10 * case.num_steps,
      cost_model=case.cost_model, seed=seed)
  pages_per_seq = -(-MAX_SEQ // 8)
  sampler = SamplerConfig(num_slots=case.slots, page_size=8, num_pages=case.slots * pages_per_seq,
                          max_seq_len=MAX_SEQ, max_new_tokens=MAX_SEQ, min_prefill_bucket=16,
                          eos_id=tok.eos_id, sampling=SamplingConfig(temperature=1.0), seed=seed)
  learner = LearnerConfig(mesh_axes=(("fsdp", 2), ("tp", 2)), seed=seed,
                          optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=0),
                          checkpoint=CheckpointConfig(async_save=False))
  return run_lib.RunConfig(
      run_dir=run_dir, init=init, sampler_mesh_axes=(("tp", 2),), learner=learner,
      objective=objectives.ObjectiveConfig(name="tis_pg"), sampler=sampler, pipeline=pipe,
      eval_slots=4, task_config=tasks.ArithmeticConfig(max_terms=4))


class LengthRecorder:
  """Step hook of the real job: records the completion length of every trained sample."""

  def __init__(self):
    self.lengths: list[int] = []

  def on_step(self, job, result, time_s) -> None:
    del job, time_s
    self.lengths.extend(r.num_completion_tokens for r in result.rollouts)

  def on_end(self, job, time_s) -> None:
    del job, time_s


RECORDED_LENGTHS = "recorded_lengths.json"


def run_real(case: ValidationCase, init: str, run_dir: str) -> list[int]:
  """Runs the real pipeline for `case`; returns the trained samples' completion lengths (group
  by group, in training order), also written to run_dir/recorded_lengths.json."""
  from rlax_pipe.pipeline import run as run_lib  # pylint: disable=import-outside-toplevel
  recorder = LengthRecorder()
  run_lib.run(run_config(case, init, run_dir), hooks=[recorder])
  (pathlib.Path(run_dir) / RECORDED_LENGTHS).write_text(json.dumps(recorder.lengths))
  return list(recorder.lengths)


def read_recorded(run_dir: str) -> list[int] | None:
  """The lengths `run_real` recorded for a run directory, or None."""
  path = pathlib.Path(run_dir) / RECORDED_LENGTHS
  return json.loads(path.read_text()) if path.exists() else None


def predict(config: dict, cal: calibration.Calibration, num_steps: int, warmup_steps: int,
            seeds: Sequence[int]) -> dict[str, float]:
  """Mean over `seeds` of the simulator's predictions for the run's configuration."""
  results = [sim_lib.simulate(calibration.sim_config_for_run(
      config, cal, num_steps, warmup_steps, seed)) for seed in seeds]
  keys = ("tokens_per_s", "samples_per_s", "lag_mean", "idle_sampler", "idle_learner",
          "slot_occupancy", "sample_lag_mean")
  out = {k: float(np.mean([getattr(r, k) for r in results])) for k in keys}
  out["lag_max"] = int(max(r.lag_max for r in results))
  return out


def compare(run_dir: str, warmup_steps: int, recorded: Sequence[int] | None = None,
            seeds: Sequence[int] = tuple(range(8)), name: str | None = None
            ) -> dict[str, Any]:
  """One table row: a run's measured numbers and the predictions of its calibrated simulator.

  Args:
    run_dir: a run directory (timeline.jsonl, metrics.jsonl, config.json) of any driver/mode.
    warmup_steps: learner steps excluded from both sides.
    recorded: the trained samples' lengths group by group (adds the "recorded" and "replay"
      predictions), e.g. from `run_real`.
    seeds: simulator seeds averaged per prediction.
    name: label of the row (default: the directory name).

  Returns:
    JSON-ready dict: configuration, "measured", and per length source "calibration_*",
    "predicted_*", "throughput_rel_err_*", "lag_mean_abs_err_*", "pass_*".
  """
  spans, rows, config = calibration.read_run(run_dir)
  p = config["pipeline"]
  meas = calibration.measured(rows, spans, warmup_steps)
  num_steps = len(calibration.train_rows(rows))
  row: dict[str, Any] = {"case": name or pathlib.Path(run_dir).name, "driver": p["driver"],
                         "mode": p["mode"], "max_lag": p["staleness"]["max_lag"],
                         "policy": p["staleness"]["policy"],
                         "slots": config["sampler"]["num_slots"],
                         "batch_samples": p["staleness"]["groups_per_step"] * p["group_size"],
                         "steps": num_steps, "warmup_steps": warmup_steps, "measured": meas}
  sources = {"metrics": None}
  if recorded:
    sources["recorded"] = distributions.GroupedEmpirical.of(recorded, p["group_size"])
    sources["replay"] = distributions.Replay.of(recorded, p["group_size"])
  for name, lengths in sources.items():
    cal = calibration.calibrate(spans, rows, lengths, calibration.completion_budget(config),
                                p["group_size"])
    pred = predict(config, cal, num_steps, warmup_steps,
                   seeds[:1] if name == "replay" else seeds)
    row[f"calibration_{name}"] = cal.to_dict()
    row[f"predicted_{name}"] = pred
    tput_err = pred["tokens_per_s"] / meas["tokens_per_s"] - 1.0
    lag_err = pred["lag_mean"] - meas["lag_mean"]
    row[f"throughput_rel_err_{name}"] = tput_err
    row[f"lag_mean_abs_err_{name}"] = lag_err
    row[f"pass_{name}"] = bool(abs(tput_err) <= THROUGHPUT_TOL and abs(lag_err) <= STALENESS_TOL)
  return row


def validate(cases: Sequence[ValidationCase] = DEFAULT_CASES, init: str | None = None,
             work_dir: str | None = None, seeds: Sequence[int] = tuple(range(8)),
             reuse_runs: bool = False) -> list[dict[str, Any]]:
  """Runs each case for real, calibrates the simulator from it, and compares (module docstring).

  Args:
    cases: the configurations (at least three recommended, spanning drivers and bounds).
    init: initial policy ("builtin", an HF checkpoint dir), default `default_init`.
    work_dir: where run directories go (default: a fresh temporary directory).
    seeds: simulator length seeds averaged per prediction.
    reuse_runs: compare against run directories already in work_dir (written by an earlier
      call) instead of running the pipeline again.

  Returns:
    One dict per case (see `compare`), JSON-ready.
  """
  work = pathlib.Path(work_dir or tempfile.mkdtemp(prefix="rlax_pipe_validate_"))
  work.mkdir(parents=True, exist_ok=True)
  init = init or ("reused" if reuse_runs else default_init(work))
  table = []
  for case in cases:
    run_dir = str(work / case.name)
    recorded = read_recorded(run_dir) if reuse_runs else run_real(case, init, run_dir)
    row = compare(run_dir, case.warmup_steps, recorded, seeds, case.name)
    row["init"] = init
    row["run_dir"] = run_dir
    table.append(row)
  return table
