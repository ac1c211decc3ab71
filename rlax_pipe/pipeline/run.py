"""The RL job's entry point (the one `experiments/pipeline_rl.py` calls): `run(RunConfig)` builds
the job (`job.build_job`) and runs it with its step hooks (`run_job`, `driver.drive`, `hooks`).

On resume (what a checkpoint holds: `job`), samples that were being generated when a threaded
run died are counted as wasted and never trained; queued samples are restored and trained once.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from absl import logging

from rlax_pipe.model import ModelLike
from rlax_pipe.pipeline import driver as driver_lib
from rlax_pipe.pipeline import hooks as hooks_lib
from rlax_pipe.pipeline.config import RunConfig
from rlax_pipe.pipeline.job import Job, build_job


def run(cfg: RunConfig, *, model: ModelLike | None = None, params: Any = None,
        hooks: Sequence[hooks_lib.StepHook] = ()) -> dict:
  """Runs (or resumes) one RL job; returns the summary also written to run_dir/summary.json.

  Args:
    cfg: the run.
    model: the policy's model (`rlax_pipe.model.Model`, e.g. an `NnxModel`); None = the built-in
      transformer loaded from `cfg.init`.
    params: initial params of `model` (any placement); None = a random init from
      `cfg.learner.seed`. Ignored when `model` is None.
    hooks: extra step hooks (`hooks.StepHook`), run after logging, evaluation and checkpoints.

  With `cfg.distributed.num_learner_processes` > 0 this is one process's role in a
  multi-process job (`rlax_pipe.pipeline.multihost.run`; call it in every process after
  `rlax_pipe.cluster.initialize`); the summary is returned on process 0.

  Raises:
    ConfigError: a user's mistake found while building the job (names the field and the fix).
    Whatever a component raised, after a checkpoint (`run_job`'s checkpoint_on_error).
  """
  if cfg.distributed.multiprocess:
    from rlax_pipe.pipeline import multihost  # pylint: disable=import-outside-toplevel
    return multihost.run(cfg, model=model, params=params, hooks=hooks)
  job = build_job(cfg, model, params)
  clock = driver_lib.VirtualClocks() if job.reproducible else driver_lib.ThreadedClock()
  return run_job(job, clock, hooks)


def run_job(job: Job, clock: driver_lib.VirtualClocks | driver_lib.RealClock,
            hooks: Sequence[hooks_lib.StepHook] = (), *, checkpoint_on_error: bool = True,
            before_end: Callable[[], None] | None = None) -> dict:
  """Runs a built job to its end with the step hooks every job runs; returns the summary.

  The sequence: logging, evaluation, checkpoint and export hooks, then `hooks`, then the report;
  a first held-out evaluation unless the resumed checkpoint had one; `driver.drive`; then every
  hook's `on_end` at the end's run time.

  Args:
    job: a job from `build_job` (single process) or a multi-process job's lead.
    clock: `driver.VirtualClocks()`, `driver.ThreadedClock()` or a lead's `LeadClock`.
    hooks: step hooks run after checkpoints and before the report.
    checkpoint_on_error: on an error in `drive`, checkpoint learner and pipeline state before
      re-raising (a multi-process job cannot: its learner processes checkpoint together, and
      they stop on the fault; it resumes from its last periodic checkpoint).
    before_end: called after the last step, before the `on_end` hooks (a lead stops its
      replicas and collects their last rows here).

  Raises:
    Whatever `drive` or a hook raised.
  """
  logging.info("run directory: %s  (TensorBoard: tensorboard --logdir %s)", job.run_dir.path,
               job.run_dir.path / "tb")
  logging.info("run time is %s; wall-clock numbers are measured.",
               "VIRTUAL (reproducible mode: modelled by pipeline.cost_model)"
               if job.reproducible else "measured wall-clock (threaded mode)")
  eta = hooks_lib.Eta()
  evaluation = hooks_lib.Evaluation(job, eta)
  checkpoint, report = hooks_lib.Checkpoint(), hooks_lib.Report(evaluation)
  all_hooks = [hooks_lib.TrainLog(eta), evaluation, checkpoint, hooks_lib.Export(), *hooks, report]
  job.clock.wall0 = time.perf_counter()
  if job.last_eval is None:
    evaluation.evaluate(job, job.start_step, job.clock.offset)
  try:
    end = driver_lib.drive(job, clock, all_hooks)
  except BaseException:
    if not checkpoint_on_error:
      raise
    logging.error("run stopped by an error at learner step %d; checkpointing before re-raising.",
                  job.learner.step)
    try:  # what the checkpoint hook does at the end: save, then close learner and worker
      checkpoint.on_end(job, job.vstate.t_l if job.reproducible else job.clock.offset)
    except Exception as e:  # pylint: disable=broad-except
      logging.error("checkpoint after the error failed too: %s", e)
    raise
  if before_end is not None:
    before_end()
  time_s = job.clock.time_s(end)
  for hook in all_hooks:
    hook.on_end(job, time_s)
  return report.summary
