"""Configs of the RL job family: pipeline_rl.py, bench_pipeline.py, sweep_staleness.py and the
base run of ablations.py.

  --config=experiments/configs/pipeline_rl.py           the default run (README command 1)
  --config=experiments/configs/pipeline_rl.py:tiny      a smoke run of seconds
  --config=experiments/configs/pipeline_rl.py:tiny_moe  the same with a tiny mixture of experts
  --config=experiments/configs/pipeline_rl.py:dataset_file --config.task_config.path=train.jsonl
  --config=experiments/configs/pipeline_rl.py:tiny,reasoning_gym   presets combine with commas
  --config=experiments/configs/pipeline_rl.py:tiny,calculator   multi-turn: a calculator tool
  --config=experiments/configs/pipeline_rl.py:tiny,python       multi-turn: a sandboxed Python tool
  --config=experiments/configs/pipeline_rl.py:dataset_file,python   (added to any task preset)
  --config.pipeline.num_steps=60 --config.learner.optimizer.learning_rate=1e-4   overrides

Presets: "default"; "tiny" (3 steps of 2 x 2 samples, 48-token sequences, 1 + 1 devices);
"tiny_moe" (tiny, starting from init="builtin_moe": the SFT warm start upcycled to 4 experts,
top-2, every layer MoE, router load-balance / z-loss coefficients 0.01 / 0.001; no HF export,
since no HF architecture expresses an MoE with Llama attention); one per task whose
config the command line fills in: "jsonl", "dataset_file" (`tasks.DatasetFileConfig`: path,
eval_path, prompt / answer fields, formats, grader), "reasoning_gym"
(`tasks.ReasoningGymConfig`: dataset, dataset_config, seed, ...); "calculator": the arithmetic
task as a multi-turn environment with a calculator tool (task "arithmetic_calculator",
`rlax_pipe.envs`; limits in --config.env.*; the virtual clock charges
--config.pipeline.cost_model.tool_wave_s per wave of tool calls); it starts from the shipped
tool warm start rlax_pipe/assets/sft_calculator (made by experiments/sft.py
--config=experiments/configs/sft.py:calculator; the single-turn one never calls the tool);
the tool preset "python" adds the sandboxed Python
tool to the run's task (--config.env.tool=python, tool results up to 256 tokens, 10 s per tool
wave; snippet limits in --config.env.python.*: 4 s wall, 2 s CPU, 512 MiB; see
`rlax_pipe.tasks.python_tool`), with a ```python block ending a turn as the call on raw prompts
and the chat template's tool calls on chat prompts. The defaults are those of
`rlax_pipe.pipeline.config.RunConfig` (the one source); a preset only names what it changes.
The family itself names one setting: the sampling temperature `RL_TEMPERATURE` (0.7) of every
preset, the measured choice of README command 1 (the library's default, `SamplingConfig`, is
1.0: the model's own distribution).
Every field with its unit: `python3 experiments/pipeline_rl.py --helpfull`.
"""

import dataclasses
import pathlib

from ml_collections import config_dict as config_dict_lib

from rlax_pipe import config_dict
from rlax_pipe import tasks
from rlax_pipe.pipeline.config import BUILTIN_MOE_INIT, PipelineConfig, RunConfig
from rlax_pipe.pipeline.staleness import StalenessConfig

SIZE_PRESETS = ("default", "tiny", "tiny_moe")
# Hand-set (like the rest of the default cost model, whose `source` says so): a warmed ToolPool
# wave of 8 calculator calls took 1-14 ms on dev-cpu (2 cores, load ~28; WORKSPACE_NOTES.md,
# "Issue 23: RL with and without a tool"). Calibrate for real runs.
CALCULATOR_TOOL_WAVE_S = 0.005
# The calculator preset's warm start: the shipped one fine-tuned with 30% calculator episodes
# (`experiments/sft.py --config=experiments/configs/sft.py:calculator`; its sft_result.json).
CALCULATOR_INIT = pathlib.Path(config_dict.__file__).resolve().parent / "assets" / "sft_calculator"
TASK_PRESETS = ("jsonl", "dataset_file", "reasoning_gym", "calculator")
_PRESET_TASK = {"calculator": "arithmetic_calculator"}  # a task preset named apart from its task
TOOL_PRESETS = ("python",)
PRESETS = SIZE_PRESETS + TASK_PRESETS + TOOL_PRESETS
# The RL family's sampling temperature (every preset; README command 1 and the experiments' runs
# were measured with it). It sets the behaviour policy mu = softmax(logits / T), which the
# learner scores and corrects for with the same SamplingConfig (the job passes one to both).
RL_TEMPERATURE = 0.7


def _tiny(cfg: RunConfig) -> RunConfig:
  """3 learner steps of 2 groups x 2 samples, 48-token sequences, one device per role (one
  shared device on a one-device host): seconds per run, most of it compilation."""
  seq = 48
  sampler = dataclasses.replace(cfg.sampler, num_slots=4, page_size=8, num_pages=32,
                                max_seq_len=seq, max_new_tokens=seq)
  pipeline = PipelineConfig(
      num_steps=3, group_size=2, seq_len=seq, eval_every=100, eval_problems=4,
      checkpoint_every=1,
      staleness=StalenessConfig(policy="learner-wait", max_lag=1, groups_per_step=2))
  task_config = (dataclasses.replace(cfg.task_config, max_terms=4)
                 if cfg.task in ("arithmetic", "arithmetic_calculator") else cfg.task_config)
  learner = dataclasses.replace(cfg.learner, mesh_axes=(("fsdp", 1), ("tp", 1)))
  return dataclasses.replace(cfg, run_dir="runs/pipeline_rl_tiny", sampler=sampler,
                             pipeline=pipeline, eval_slots=4, task_config=task_config,
                             sampler_mesh_axes=(("tp", 1),), learner=learner)


def _task_example(task: str):
  """The task's default config (a file task's path "" is replaced by a required placeholder)."""
  config_cls = tasks.TASKS[task][1]
  fields = {f.name for f in dataclasses.fields(config_cls)}
  return config_cls(path="") if "path" in fields else config_cls()


def get_config(preset: str = "default"):
  """The ConfigDict of `preset`: one of PRESETS, or a size, a task and a tool preset joined by
  commas (at most one of each).

  Raises:
    ValueError: on an unknown preset (the message lists them).
  """
  names = [p.strip() for p in (preset or "default").split(",") if p.strip()] or ["default"]
  unknown = [p for p in names if p not in PRESETS]
  if unknown or any(sum(p in group for p in names) > 1
                    for group in (SIZE_PRESETS, TASK_PRESETS, TOOL_PRESETS)):
    raise ValueError(f"unknown preset(s) {unknown or names} of configs/pipeline_rl.py; choose "
                     f"one of {SIZE_PRESETS}, optionally with one of {TASK_PRESETS} and one of "
                     f"{TOOL_PRESETS} (e.g. 'tiny,dataset_file' or 'tiny,python').")
  if "calculator" in names and "python" in names:
    raise ValueError("presets 'calculator' and 'python' both add a tool; the Python tool is "
                     "added to a task without tools (e.g. 'tiny,python').")
  cfg = RunConfig()
  sampling = dataclasses.replace(cfg.sampler.sampling, temperature=RL_TEMPERATURE)
  cfg = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, sampling=sampling))
  task = next((p for p in names if p in TASK_PRESETS), None)
  if task is not None:
    name = _PRESET_TASK.get(task, task)
    cfg = dataclasses.replace(cfg, task=name, task_config=_task_example(name),
                              run_dir=f"runs/pipeline_rl_{task}")
  else:  # the arithmetic task's fields, so --config.task_config.max_terms=... works
    cfg = dataclasses.replace(cfg, task_config=tasks.ArithmeticConfig())
  if "tiny" in names or "tiny_moe" in names:
    cfg = _tiny(cfg)
  if task == "calculator":  # the virtual clock charges tool waves (`CostModel.tool_wave_s`)
    cfg = dataclasses.replace(cfg, init=str(CALCULATOR_INIT), pipeline=dataclasses.replace(
        cfg.pipeline, cost_model=dataclasses.replace(cfg.pipeline.cost_model,
                                                     tool_wave_s=CALCULATOR_TOOL_WAVE_S)))
  if "tiny_moe" in names:
    cfg = dataclasses.replace(cfg, init=BUILTIN_MOE_INIT, export_hf=False,
                              run_dir="runs/pipeline_rl_tiny_moe")
  if "python" in names:  # tracebacks need more room than calculator results
    cfg = dataclasses.replace(cfg, env=dataclasses.replace(
        cfg.env, tool="python", max_tool_output_tokens=256, tool_timeout_s=10.0),
                              run_dir=f"{cfg.run_dir}_python")
  out = config_dict.to_config_dict(cfg)
  if task is not None and "path" in out.task_config:
    out.task_config.path = config_dict_lib.placeholder(str)  # the user's file: required
  return out
