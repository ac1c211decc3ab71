"""Config files + flags: presets, overrides, the removed flags, the generated help, round trips."""

import dataclasses
import json

from absl import flags
import jax
import pytest

from lib import config_cli
from rlax_pipe import config_dict
from rlax_pipe.config_dict import ConfigError
from rlax_pipe import objectives
from rlax_pipe import tasks
from rlax_pipe.learner import CheckpointConfig, LearnerConfig, OptimizerConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.pipeline import devices
from rlax_pipe.run_dir import RunDir
from rlax_pipe.pipeline.config import CostModel, PipelineConfig, RunConfig
from rlax_pipe.pipeline.staleness import StalenessConfig
from rlax_pipe.sampler import SamplerConfig
from rlax_pipe.sft import SFTConfig
from rlax_pipe.tokenizer import default_tokenizer

RL_FILE = config_cli.CONFIGS / "pipeline_rl.py"


def _parse(argv):
  fv = flags.FlagValues()
  holder = config_cli.define_rl_flags(fv, ["prog"] + argv)
  fv(["prog"] + argv)
  return config_cli.run_config(holder.value, ["prog"] + argv)


def test_default_preset_is_readme_command_1():
  """The run of `python3 experiments/pipeline_rl.py` before config files (rl_flags' defaults);
  meshes and the stop id are now resolved by the job: on 8 devices they are those of then."""
  want = RunConfig(
      run_dir="runs/pipeline_rl", init="builtin", task="arithmetic", sampler_mesh_axes=(),
      learner=LearnerConfig(mesh_axes=(),
                            optimizer=OptimizerConfig(learning_rate=3e-5, warmup_steps=2,
                                                      adam_eps=1e-8), seed=0),
      objective=objectives.ObjectiveConfig(name="tis_pg", truncation=2.0,
                                           aggregation="token_mean"),
      sampler=SamplerConfig(num_slots=64, page_size=16, num_pages=512, max_seq_len=384,
                            max_new_tokens=384, eos_id=None, kv_policy="keep",
                            sampling=SamplingConfig(temperature=0.7), seed=0),
      pipeline=PipelineConfig(
          driver="pipeline", mode="reproducible", num_steps=30, group_size=8, seq_len=384,
          advantage="grpo", staleness=StalenessConfig("learner-wait", 4, 8), eval_every=10,
          eval_problems=128, checkpoint_every=5, wait_timeout_s=None, debug_verify_push=False,
          cost_model=CostModel()),
      eval_slots=32, sampler_compute_dtype=None, resume=False,
      task_config=dataclasses.asdict(tasks.ArithmeticConfig()))  # the task's defaults
  assert _parse([]) == want
  plan = devices.plan_devices(want.sampler_mesh_axes, want.learner.mesh_axes, jax.devices())
  assert plan.sampler_mesh_axes == (("tp", 4),)
  assert plan.learner_mesh_axes == (("fsdp", 2), ("tp", 2))
  assert default_tokenizer().stop_ids == (default_tokenizer().eos_id,)


def test_preset_and_overrides():
  cfg = _parse([f"--config={RL_FILE}:tiny", "--config.learner.optimizer.learning_rate=1e-4",
                "--config.pipeline.staleness.max_lag=3",
                "--config.learner.mesh_axes=(('fsdp', 4),)"])
  assert cfg.pipeline.num_steps == 3 and cfg.sampler.max_seq_len == 48
  assert cfg.learner.optimizer.learning_rate == 1e-4 and cfg.pipeline.staleness.max_lag == 3
  assert cfg.learner.mesh_axes == (("fsdp", 4),) and cfg.learner.num_devices == 4
  assert cfg.task_config == dataclasses.asdict(tasks.ArithmeticConfig(max_terms=4))
  hash(cfg.learner)  # tuples stay tuples: the configs remain hashable (jit static arguments)
  with pytest.raises(Exception, match="learning_rat"):  # no new fields: typos fail
    _parse(["--config.learner.optimizer.learning_rat=1e-4"])
  with pytest.raises(ValueError, match="--config.learner.optimizer.learning_rate=-1.0"):
    _parse(["--config.learner.optimizer.learning_rate=-1.0"])  # validation names the flag


def test_removed_flags_name_their_new_spelling():
  with pytest.raises(flags.IllegalFlagValueError, match="use --config.pipeline.num_steps"):
    _parse(["--steps=3"])
  with pytest.raises(flags.IllegalFlagValueError, match="use --config.resume"):
    _parse(["--resume"])


def test_help_documents_every_field():
  fv = flags.FlagValues()
  config_cli.define_rl_flags(fv)
  text = fv["config"].help
  leaves = [line.split(":")[0] for line in config_dict.describe_fields(RunConfig(), "config.")]
  for path in leaves:
    assert f"\n    {path}:" in text, path
  assert "(no description)" not in text
  assert "config.learner.optimizer.learning_rate: peak learning rate (per optimizer step" in text


def test_one_declaration_each_and_derived_values_are_not_fields():
  with pytest.raises(ValueError, match="pipeline.staleness.max_lag"):
    RunConfig(objective=objectives.ObjectiveConfig(max_lag=2))
  with pytest.raises(ValueError, match="run_dir/checkpoints"):
    RunConfig(learner=LearnerConfig(checkpoint=CheckpointConfig(directory="/tmp/x")))
  assert PipelineConfig().groups_per_step == PipelineConfig().staleness.groups_per_step
  assert "groups_per_step" not in {f.name for f in dataclasses.fields(PipelineConfig)}


def test_round_trip_and_unknown_keys():
  for cfg in (RunConfig(), SFTConfig(), LearnerConfig(), SamplerConfig()):
    assert config_dict.from_config_dict(type(cfg), config_dict.to_config_dict(cfg)) == cfg
  with pytest.raises(ValueError, match=r"no field\(s\) \['slotz'\]"):
    config_dict.from_config_dict(SamplerConfig, {"slotz": 3})


def test_sft_config_file():
  fv = flags.FlagValues()
  holder = config_cli.define_config("sft", "SFT.", ["x"], fv, ["prog", "--config.sft.steps=7"])
  config_cli.define_removed_flags(config_cli.SFT_RENAMED, fv)
  fv(["prog", "--config.sft.steps=7"])
  assert config_dict.from_config_dict(SFTConfig, holder.value.sft) == SFTConfig(steps=7)
  with pytest.raises(flags.IllegalFlagValueError, match="use --config.sft.steps"):
    fv2 = flags.FlagValues()
    config_cli.define_removed_flags(config_cli.SFT_RENAMED, fv2)
    fv2(["prog", "--steps=3"])


def test_command_line_resume_restores_the_saved_configuration(tmp_path):
  """`--config.resume --config.run_dir=D` with the defaults otherwise runs D's configuration;
  fields the command line names are taken from it (the job then checks them)."""
  run_dir = tmp_path / "run"
  first = _parse([f"--config.run_dir={run_dir}", "--config.learner.optimizer.learning_rate=1e-4",
                  "--config.pipeline.num_steps=7"])
  RunDir(run_dir).write_config(first)
  resumed = _parse([f"--config.run_dir={run_dir}", "--config.resume"])
  assert resumed == dataclasses.replace(first, resume=True)
  changed = _parse([f"--config.run_dir={run_dir}", "--config.resume",
                    "--config.pipeline.num_steps=9",
                    "--config.change_on_resume=pipeline.num_steps,learner.seed"])
  assert changed.pipeline.num_steps == 9 and changed.learner.optimizer.learning_rate == 1e-4
  assert changed.change_on_resume == ("pipeline.num_steps", "learner.seed")
  with pytest.raises(ConfigError, match=r"--config.run_dir=.*nowhere holds no run"):
    _parse([f"--config.run_dir={tmp_path / 'nowhere'}", "--config.resume"])


def test_mistyped_override_is_one_error_naming_the_field():
  """A typo in --config.<path> used to end in an AttributeError traceback from the flag parser."""
  with pytest.raises(ConfigError, match=r"--config.pipeline has no field 'num_stepz' \(did you "
                                        r"mean --config.pipeline.num_steps\?\)"):
    _parse(["--config.pipeline.num_stepz=3"])
  with pytest.raises(ConfigError, match=r"--config.task_config has no field 'pth' \(did you "
                                        r"mean --config.task_config.path\?\)"):
    _parse([f"--config={RL_FILE}:tiny,dataset_file", "--config.task_config.pth=x"])
  cfg = _parse(["--config.task_config.max_terms=6"])  # the default task's fields are there
  assert cfg.task_config["max_terms"] == 6


def test_rl_baselines_are_selected_by_config_flags():
  """Issue 24: KL reference, GSPO and pass@k evaluation from the command line, in the help."""
  cfg = _parse(["--config.objective.name=gspo", "--config.objective.kl=loss",
                "--config.objective.kl_estimator=k1", "--config.objective.kl_coef=0.01",
                "--config.objective.kl_reference=/ckpt/ref", "--config.objective.clip_eps=3e-4",
                "--config.objective.clip_eps_high=4e-4", "--config.pipeline.eval_samples=8",
                "--config.pipeline.eval_pass_k=(1, 4)"])
  assert (cfg.objective.name, cfg.objective.kl, cfg.objective.kl_estimator) == ("gspo", "loss",
                                                                                "k1")
  assert cfg.objective.kl_reference == "/ckpt/ref" and cfg.objective.kl_coef == 0.01
  assert cfg.pipeline.eval_samples == 8 and cfg.pipeline.pass_ks == (1, 4)
  hash(cfg.objective)
  default = _parse([])
  assert default.objective.kl == "off" and default.pipeline.eval_samples == 0
  with pytest.raises(ValueError, match="--config.pipeline.eval_pass_k"):
    _parse(["--config.pipeline.eval_samples=2", "--config.pipeline.eval_pass_k=(4,)"])
  fv = flags.FlagValues()
  config_cli.define_rl_flags(fv)
  for path in ("config.objective.kl:", "config.objective.kl_estimator:",
               "config.objective.kl_reference:", "config.pipeline.eval_samples:",
               "config.pipeline.eval_pass_k:"):
    assert path in fv["config"].help
  assert "gspo" in fv["config"].help
