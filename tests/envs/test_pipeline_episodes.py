"""Episodes in the pipeline: an environment task runs through the real job (reproducible
pipeline driver): episodes of several turns are trained (environment tokens masked), the
sampler checkpoint holds the episodes' state, and the calculator preset's config builds."""

import dataclasses
import json
import pathlib

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
      pipeline=dataclasses.replace(
          cfg.pipeline, eval_problems=1,
          cost_model=dataclasses.replace(cfg.pipeline.cost_model, tool_wave_s=0.25)))
  hook = Inspect()
  summary = run_lib.run(cfg, hooks=[hook])
  rows = train_rows(cfg.run_dir)
  assert summary["steps"] == 1 and [r["step"] for r in rows] == [1]
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
  # metrics: model tokens apart from environment tokens; episode and tool counters (run totals)
  row, res = rows[0], hook.results[0]
  kept = [r for r in res.rollouts if np.isfinite(r.reward)]
  assert row["completion_tokens"] == sum(int(r.completion_mask.sum()) for r in kept)
  assert row["env_tokens"] == sum(int((r.completion_mask == 0).sum()) for r in kept) > 0
  assert row["env_tool_calls"] >= row["tool_ok"] > 0 and row["env_episodes"] > 0
  assert row["env_turns"] > row["env_episodes"] and row["tool_error"] == 0
  # the virtual clock charges each tool wave (CostModel.tool_wave_s) as an "env"/"tool" span
  spans = [json.loads(l) for l in open(f"{cfg.run_dir}/timeline.jsonl")]
  tool = [s for s in spans if (s["component"], s["kind"]) == ("env", "tool")]
  assert tool and all(abs(s["end"] - s["start"] - 0.25) < 1e-9 for s in tool)
  assert len(tool) <= runner.counts["tool_waves"]
  decode = [s for s in spans if s["kind"] == "decode"]
  assert not any(t["start"] < d["end"] and d["start"] < t["end"] for t in tool for d in decode)
  evals = [json.loads(l) for l in open(f"{cfg.run_dir}/metrics.jsonl")]
  evals = [e for e in evals if e["kind"] == "eval"]
  assert evals and all("eval_tool_calls" in e and "heldout_count_by_difficulty" in e
                       for e in evals)  # held-out evaluation runs episodes too


def test_calculator_preset_config():
  from experiments.configs import pipeline_rl  # pylint: disable=import-outside-toplevel
  cd = pipeline_rl.get_config("tiny,calculator")
  assert cd.task == "arithmetic_calculator" and cd.task_config.max_terms == 4
  assert cd.env.max_turns == envs.EnvConfig().max_turns
  assert cd.pipeline.cost_model.tool_wave_s > 0  # the virtual clock charges tool waves
  # the shipped tool warm start (configs/sft.py:calculator) is the preset's init
  assert (pathlib.Path(cd.init) / "model.safetensors").exists()
  sft_cd = __import__("experiments.configs.sft", fromlist=["get_config"]).get_config("calculator")
  assert sft_cd.task == "arithmetic_calculator" and sft_cd.sft.tool_fraction > 0
