"""Episodes in the pipeline: an environment task runs through the real job (reproducible
pipeline driver): episodes of several turns are trained (environment tokens masked), the
sampler checkpoint holds the episodes' state, and the calculator preset's config builds."""

import dataclasses

import numpy as np

from rlax_pipe import envs, tasks
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.tokenizer import default_tokenizer

from fake_tools import EchoArithmetic  # this directory; light, the tool workers import it


class Inspect:
  """Step hook: the rollouts the queue handed to each step, and the episode runner."""

  def __init__(self):
    self.results, self.engine = [], None

  def on_step(self, job, result, time_s):
    self.results.append(result)
    self.engine = job.engine

  def on_end(self, job, time_s):
    pass


def test_environment_task_trains_multi_turn_episodes(tmp_path, tiny_init, tiny_config,
                                                     train_rows, monkeypatch):
  monkeypatch.setitem(tasks.TASKS, "echo_arithmetic", (EchoArithmetic, tasks.ArithmeticConfig))
  cfg = tiny_config(tmp_path, tiny_init, steps=1)
  tok = default_tokenizer()
  stops = (tok.eos_id,) + tuple(range(5, 120))  # random weights: a turn ends every few tokens
  # The fewest devices and programs that run the whole job: one device per role (no SPMD
  # partitioning to compile), one evaluation problem.
  cfg = dataclasses.replace(
      cfg, task="echo_arithmetic", env=envs.EnvConfig(max_turns=2, tool_timeout_s=10.0),
      sampler=dataclasses.replace(cfg.sampler, eos_id=stops), sampler_mesh_axes=(("tp", 1),),
      learner=dataclasses.replace(cfg.learner, mesh_axes=(("fsdp", 1), ("tp", 1))),
      pipeline=dataclasses.replace(cfg.pipeline, eval_problems=1))
  hook = Inspect()
  summary = run_lib.run(cfg, hooks=[hook])
  assert summary["steps"] == 1 and [r["step"] for r in train_rows(cfg.run_dir)] == [1]
  runner = hook.engine
  assert isinstance(runner, envs.EpisodeEngine)
  assert runner.counts["episodes"] > 0 and runner.tools.counts["ok"] > 0
  assert runner.engine.stats().continued_tokens > 0
  trained = [r for res in hook.results for r in res.rollouts]
  multi = [r for r in trained if r.num_turns == 2]
  assert multi
  for r in multi:
    env_at = r.completion_mask == 0
    assert tok.decode(r.completion_tokens[env_at]) == "12\n"
    assert np.all(r.behavior_logprobs[env_at] == 0.0)


def test_calculator_preset_config():
  from experiments.configs import pipeline_rl  # pylint: disable=import-outside-toplevel
  cd = pipeline_rl.get_config("tiny,calculator")
  assert cd.task == "arithmetic_calculator" and cd.task_config.max_terms == 4
  assert cd.env.max_turns == envs.EnvConfig().max_turns
