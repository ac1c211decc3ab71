"""Cross-field rules of RunConfig (issue #14 items 12 and 16): each broken rule fails when the
config is built, naming both fields and the fix; settings that learn nothing are refused."""

import dataclasses

import jax
import numpy as np
import pytest

from rlax_pipe import advantages
from rlax_pipe import logprobs
from rlax_pipe import tasks
from rlax_pipe.config import ModelConfig
from rlax_pipe.config_dict import ConfigError, from_config_dict, to_config_dict
from rlax_pipe.grading import GradingConfig
from rlax_pipe.learner import CheckpointConfig, Learner, LearnerConfig, OptimizerConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.objectives import ObjectiveConfig
from rlax_pipe.pipeline import hooks
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.pipeline import trainer as trainer_lib
from rlax_pipe.pipeline.config import PipelineConfig, RunConfig
from rlax_pipe.sampler import SamplerConfig
from rlax_pipe.tokenizer import default_tokenizer
from rlax_pipe.types import Rollout

FAST_COMPILE = (("xla_backend_optimization_level", 0),)  # LLVM -O0: a compile-bound tiny step


def _run(**changes):
  """RunConfig() with nested changes given as {"pipeline": {...}, "sampler": {...}, ...}."""
  base = RunConfig()
  kwargs = {}
  for name, value in changes.items():
    current = getattr(base, name)
    kwargs[name] = (dataclasses.replace(current, **value) if isinstance(value, dict)
                    and dataclasses.is_dataclass(current) else value)
  return dataclasses.replace(base, **kwargs)


def test_issue_input_seq_len_below_sampler_max_seq_len():
  with pytest.raises(ConfigError, match=r"RunConfig.pipeline.seq_len=64 < "
                                        r"RunConfig.sampler.max_seq_len=128.*seq_len >= 128"):
    _run(pipeline={"seq_len": 64},
         sampler={"max_seq_len": 128, "max_new_tokens": 64, "num_pages": 64})
  _run(pipeline={"seq_len": 128}, sampler={"max_seq_len": 128, "num_pages": 64})  # the fix


@pytest.mark.parametrize("changes, pattern", [
    ({"sampler": {"num_pages": 10}},  # 384 tokens / 16 per page = 24 pages per sequence
     r"RunConfig.sampler.num_pages=10 < 24 pages.*RunConfig.sampler.max_seq_len=384"),
    ({"pipeline": {"grading": GradingConfig(min_completion_tokens=384)}},
     r"RunConfig.sampler.max_seq_len=384 leaves no prompt token.*"
     r"RunConfig.pipeline.grading.min_completion_tokens=384"),
    ({"pipeline": {"grading": GradingConfig(overlong_policy="soft_penalty",
                                            overlong_buffer_tokens=64,
                                            overlong_max_tokens=500)}},
     r"overlong_max_tokens=500 minus overlong_buffer_tokens=64 is >= "
     r"RunConfig.sampler.max_new_tokens=384.*never applies"),
    ({"pipeline": {"grading": GradingConfig(max_prefill_len=369)}},  # 384 - 16 = 368
     r"RunConfig.pipeline.grading.max_prefill_len=369 > RunConfig.sampler.max_seq_len=384 - "
     r"RunConfig.pipeline.grading.min_completion_tokens=16.*<= 368"),
    ({"objective": {"aggregation": "constant", "max_completion_len": 128}},
     r"RunConfig.objective.max_completion_len=128 != RunConfig.sampler.max_new_tokens=384.*"
     r"set objective.max_completion_len=384"),
    ({"pipeline": {"reward_timeout_s": 700.0}},  # the wait limit scales, floor 60 s
     r"RunConfig.pipeline.reward_timeout_s=700.0 >= RunConfig.pipeline.wait_timeout_floor_s=60.0"),
    ({"pipeline": {"reward_timeout_s": 700.0, "wait_timeout_s": 600.0}},
     r"RunConfig.pipeline.reward_timeout_s=700.0 >= RunConfig.pipeline.wait_timeout_s=600.0"),
    ({"pipeline": {"advantage": "ppo_gae"}},
     r"RunConfig.pipeline.advantage='ppo_gae'; choose one of \('grpo', 'dr_grpo', 'rloo'\)"),
    ({"sampler_mesh_axes": (("fsdp", 2),)},
     r"RunConfig.sampler_mesh_axes=\(\('fsdp', 2\),\): axes must be distinct names among "
     r"\('data', 'expert', 'tp'\)"),
    ({"learner": {"mesh_axes": (("model", 2),)}},
     r"RunConfig.learner.mesh_axes=\(\('model', 2\),\): axes must be distinct names among "
     r"\('data', 'fsdp', 'expert', 'tp'\)"),
    ({"jsonl_path": "x.jsonl"}, r"RunConfig.jsonl_path='x.jsonl' is only read by task 'jsonl'"),
    ({"task": "dataset_file"}, r"task='dataset_file' needs its file: set "
                               r"RunConfig.task_config.path"),
    ({"task": "dataset_file", "task_config": {"paht": "x.csv"}},
     r"RunConfig.task_config has no field\(s\) \['paht'\] for task 'dataset_file'"),
    ({"task_config": tasks.JsonlConfig(path="x.jsonl")},
     r"RunConfig.task_config is a JsonlConfig, but task 'arithmetic' takes a ArithmeticConfig"),
])
def test_rules_that_cannot_work_together(changes, pattern):
  with pytest.raises(ConfigError, match=pattern):
    _run(**changes)


def test_dr_grpo_constant_is_the_sampler_budget():
  """#14 item 6's normaliser G x L_max: L_max is the sampler's completion budget, so a
  differing max_completion_len is refused (above) and the equal one builds, on the command line
  too (where a missing one names the field)."""
  cfg = _run(objective={"aggregation": "constant", "max_completion_len": 384})
  assert cfg.objective.max_completion_len == cfg.sampler.max_new_tokens == 384
  config = to_config_dict(RunConfig())
  config.objective.aggregation = "constant"
  with pytest.raises(ConfigError, match=r"^--config.objective.max_completion_len=None must be "
                                        r"an int >= 1 \(the sampler's max_new_tokens\)"):
    from_config_dict(RunConfig, config, prefix="--config.")
  config.objective.max_completion_len = 100
  with pytest.raises(ConfigError, match=r"^--config.objective.max_completion_len=100 != "
                                        r"--config.sampler.max_new_tokens=384"):
    from_config_dict(RunConfig, config, prefix="--config.")
  config.sampler.max_new_tokens = 100
  assert from_config_dict(RunConfig, config, prefix="--config.").objective.max_completion_len == 100


def test_issue_input_group_size_one_learns_nothing():
  """#14 item 16: group_size=1 is refused, naming the estimators that need G >= 2."""
  with pytest.raises(ConfigError, match=r"RunConfig.pipeline.group_size=1 with "
                     r"RunConfig.pipeline.advantage='grpo' learns nothing.*"
                     r"\['dr_grpo', 'grpo', 'rloo'\] need group_size >= 2"):
    _run(pipeline={"group_size": 1})


@pytest.mark.parametrize("name", sorted(advantages.ADVANTAGES))
def test_min_group_size_table_is_what_the_estimators_do(name):
  """The table the rule reads: with G below it every advantage is 0; at G it is not."""
  fn = advantages.get_advantage_fn(name)
  need = advantages.MIN_GROUP_SIZE[name]
  below = fn(np.asarray([[1.0] * (need - 1), [0.0] * (need - 1)], np.float32))
  assert np.all(below == 0.0)
  at = fn(np.asarray([[1.0] + [0.0] * (need - 1)], np.float32))
  assert np.any(at != 0.0)


@pytest.mark.parametrize("sampling, knob", [(SamplingConfig(greedy=True), "greedy=True"),
                                            (SamplingConfig(top_k=1), "top_k=1")])
def test_identical_samples_per_group_learn_nothing(sampling, knob):
  with pytest.raises(ConfigError, match=rf"RunConfig.sampler.sampling.{knob} with "
                     r"RunConfig.pipeline.group_size=8 learns nothing"):
    _run(sampler={"sampling": sampling})
  _run(sampler={"sampling": SamplingConfig(top_k=2)})  # two candidates per step can differ


def test_top_p_at_most_one_over_vocab_keeps_only_the_argmax():
  """The premise of the job's top-p rule, on random logits: top_p <= 1 / V keeps one token."""
  def kept(logits, top_p):
    logp = logprobs.processed_logprobs(logits, SamplingConfig(top_p=top_p))
    return np.asarray((logp > logprobs.OUT_OF_SUPPORT).sum(-1))

  normal = jax.random.normal(jax.random.key(0), (64, 50))
  for scale in (3.0, 0.01):  # peaked and near-uniform rows
    assert np.all(kept(normal * scale, 1 / 50) == 1)
    assert np.all(kept(normal * scale, 0.5 / 50) == 1)
  assert np.all(kept(normal * 0.01, 2 / 50) >= 2)  # above 1 / V a flat row keeps more


def test_top_p_that_keeps_only_the_argmax_is_refused(tmp_path, tiny_config, tiny_init):
  cfg = tiny_config(tmp_path, tiny_init)
  vocab = default_tokenizer().vocab_size  # the tiny model's vocabulary
  top_p = 1.0 / vocab
  cfg = dataclasses.replace(cfg, sampler=dataclasses.replace(
      cfg.sampler, sampling=SamplingConfig(top_p=top_p)))
  with pytest.raises(ConfigError, match=rf"RunConfig.sampler.sampling.top_p={top_p:g} <= 1 / "
                     rf"{vocab} .*group_size=2 learns nothing"):
    run_lib.run(cfg)


def test_command_line_spelling_of_cross_field_errors():
  """From a ConfigDict (the command line's path), errors name --config.<field>."""
  config = to_config_dict(RunConfig())
  config.pipeline.num_steps = -5
  with pytest.raises(ConfigError, match=r"^--config.pipeline.num_steps=-5 must be >= 1.$"):
    from_config_dict(RunConfig, config, prefix="--config.")
  config.pipeline.num_steps = 30
  config.pipeline.seq_len = 64
  with pytest.raises(ConfigError, match=r"--config.pipeline.seq_len=64 < "
                                        r"--config.sampler.max_seq_len=384"):
    from_config_dict(RunConfig, config, prefix="--config.")


def _rollout(i, n_tokens=20):
  return Rollout(sample_id=i, group_id=i // 2, prompt_tokens=np.full(4, 5, np.int32),
                 completion_tokens=np.full(n_tokens, 6, np.int32),
                 behavior_logprobs=np.full(n_tokens, -1.0, np.float32),
                 policy_versions=np.zeros(n_tokens, np.int32), finish_reason="eos",
                 reward=float(i % 2))


def test_issue_input_micro_batches_3_trains():
  """#14 item 12: micro_batches=3 used to fail at the first train step (the batch's power-of-two
  rows did not divide into 3). The learner now cuts any batch into micro-batches of
  `micro_batch_rows` rows (the last padded), so 3-row micro-batches train a 4-row batch; the one
  rule left (rows a multiple of data x fsdp) is checked when the config is built."""
  cfg = PipelineConfig(seq_len=32, group_size=2)
  groups = [(_rollout(0), _rollout(1)), (_rollout(2), _rollout(3))]
  batch, _ = trainer_lib.build_batch(groups, cfg)
  assert batch.tokens.shape == (4, 32)  # 4 samples of 24 tokens, one per 32-token row
  model = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                      head_dim=8, d_ff=32, max_seq_len=32)
  learner = Learner(model, LearnerConfig(micro_batch_rows=3, checkpoint=CheckpointConfig(),
                                         optimizer=OptimizerConfig(warmup_steps=0),
                                         compiler_options=FAST_COMPILE),
                    ObjectiveConfig(), SamplingConfig(), devices=jax.devices()[:1])
  learner.train_step(batch)
  metrics = learner.flush()
  assert learner.version == 1 and np.isfinite(float(metrics["loss"]))
  with pytest.raises(ValueError, match=r"micro_batch_rows=3 must be a multiple of the "
                                       r"batch-splitting mesh axes \(data x fsdp = 2"):
    _run(learner={"mesh_axes": (("fsdp", 2), ("tp", 2)), "micro_batch_rows": 3})


def test_steps_without_learning_signal_are_measured_and_warned(caplog):
  """The run-time side of #14 item 16: the share of groups with differing rewards is logged per
  step, and NO_SIGNAL_WARN_STEPS steps in a row without one raise a warning."""
  mixed = [_rollout(i) for i in range(4)]                      # groups 0, 1: rewards 0 and 1
  flat = [dataclasses.replace(r, reward=1.0) for r in mixed]   # every reward equal
  half = flat[:2] + mixed[2:] + [dataclasses.replace(mixed[0], sample_id=9, group_id=7,
                                                     reward=float("nan"))]
  def result(rollouts):
    return trainer_lib.StepResult(trained_at=0, produced=1, metrics={}, rollouts=tuple(rollouts),
                                  completion_tokens=0, reward_mean=0.0)
  assert hooks.signal_group_fraction(result(mixed)) == 1.0
  assert hooks.signal_group_fraction(result(flat)) == 0.0
  # group 0 equal, group 1 mixed; an unscored (all-NaN) group is not trained and not counted
  assert hooks.signal_group_fraction(result(half)) == 0.5
  log = hooks.TrainLog()
  with caplog.at_level("WARNING"):
    for step in range(1, hooks.NO_SIGNAL_WARN_STEPS):
      log._check_signal(step, 0.0)
    assert "learned nothing" not in caplog.text
    log._check_signal(hooks.NO_SIGNAL_WARN_STEPS, 0.0)
  assert f"steps 1-{hooks.NO_SIGNAL_WARN_STEPS} learned nothing" in caplog.text
  log._check_signal(9, 0.5)
  assert log.no_signal_steps == 0


def test_removed_pipeline_seed_is_refused_with_the_fields_to_set():
  """#25 step 5: `pipeline.seed` was read by nothing; an old config that sets it names the fix."""
  config = to_config_dict(RunConfig())
  config.pipeline.seed = 3
  with pytest.raises(ConfigError, match=r"^--config.pipeline.seed was removed: .*"
                                        r"--config.sampler.seed .*--config.learner.seed"):
    from_config_dict(RunConfig, config, prefix="--config.")
  with pytest.raises(ConfigError, match=r"^PipelineConfig.seed was removed"):
    from_config_dict(PipelineConfig, {"seed": 0})
