"""absl flags of the RL experiments (shared by pipeline_rl.py, bench_pipeline.py, sweeps).

Every flag states its unit. `run_config_from_flags()` turns them into a `RunConfig`.
"""

from absl import flags

from rlax_pipe import objectives
from rlax_pipe.learner import LearnerConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.pipeline import config as pipeline_config
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.pipeline import staleness
from rlax_pipe.sampler import SamplerConfig
from rlax_pipe import tokenizer

_D = run_lib.RunConfig()
_P = pipeline_config.PipelineConfig()
_C = pipeline_config.CostModel()

RUN_DIR = flags.DEFINE_string("run_dir", _D.run_dir, "Output directory of the run.")
INIT = flags.DEFINE_string("init", _D.init, "Initial policy: 'builtin' (shipped SFT warm start) "
                           "or an HF-format checkpoint directory.")
TASK = flags.DEFINE_enum("task", _D.task, ["arithmetic", "jsonl"],
                         "Task: arithmetic (built-in) or jsonl (--jsonl_path, one "
                         '{"prompt": ..., "answer": ...} object per line).')
JSONL = flags.DEFINE_string("jsonl_path", None, "Problems file (JSONL) for --task=jsonl.")
RESUME = flags.DEFINE_bool("resume", False, "Continue from the newest checkpoint in --run_dir.")
SAMPLER_DEVICES = flags.DEFINE_integer("sampler_devices", 4, "Devices of the sampler mesh.")
LEARNER_DEVICES = flags.DEFINE_integer("learner_devices", 4, "Devices of the learner mesh.")
SAMPLER_TP = flags.DEFINE_integer("sampler_tp", 4, "Tensor-parallel size of the sampler mesh "
                                  "(the rest of --sampler_devices is the 'data' axis).")
LEARNER_FSDP = flags.DEFINE_integer("learner_fsdp", 2, "FSDP size of the learner mesh (the rest "
                                    "of --learner_devices is the 'tp' axis).")
DRIVER = flags.DEFINE_enum("driver", _P.driver, list(pipeline_config.DRIVERS),
                           "sync | async-batch | pipeline (in-flight weight updates).")
MODE = flags.DEFINE_enum("mode", _P.mode, list(pipeline_config.MODES),
                         "reproducible (virtual clock, deterministic) | threaded (real clock).")
STEPS = flags.DEFINE_integer("steps", 30, "Learner optimizer steps.")
GROUPS = flags.DEFINE_integer("groups_per_step", _P.groups_per_step,
                              "Prompt groups per learner batch.")
GROUP_SIZE = flags.DEFINE_integer("group_size", _P.group_size, "Samples per prompt (GRPO group).")
MAX_LAG = flags.DEFINE_integer("max_lag", 4, "Max per-token lag in optimizer steps; -1 = "
                               "unbounded.")
POLICY = flags.DEFINE_enum("staleness_policy", "learner-wait", list(staleness.POLICIES),
                           "How max_lag is enforced: block (sampler admission) | learner-wait "
                           "(AReaL admission + the learner waits for due stragglers) | drop | "
                           "queue-drop.")
QUEUE_CAP = flags.DEFINE_integer("queue_capacity_groups", 0, "Queue-drop capacity in groups "
                                 "(0 = groups_per_step).")
OBJECTIVE = flags.DEFINE_enum("objective", "tis_pg", sorted(objectives.OBJECTIVES),
                              "Policy-gradient objective.")
AGGREGATION = flags.DEFINE_enum("aggregation", "token_mean", list(objectives.AGGREGATIONS),
                                "Loss aggregation: token_mean | sequence_mean | constant.")
TRUNC = flags.DEFINE_float("truncation", 2.0, "Importance-weight truncation c (ratio units).")
ADVANTAGE = flags.DEFINE_enum("advantage", _P.advantage, ["grpo", "rloo", "dr_grpo"],
                              "Advantage estimator.")
LR = flags.DEFINE_float("learning_rate", 3e-5, "Peak AdamW learning rate (per step).")
ADAM_EPS = flags.DEFINE_float(
    "adam_eps", LearnerConfig.adam_eps, "AdamW epsilon (gradient units). Larger values damp the "
    "per-parameter normalisation of small, noisy gradient components.")
WARMUP = flags.DEFINE_integer("warmup_steps", 2, "Linear warmup length (optimizer steps).")
SLOTS = flags.DEFINE_integer("slots", 64, "Sampler decode slots (sequences decoded at once).")
PAGES = flags.DEFINE_integer("pages", 512, "KV pages in the sampler's pool.")
PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
MAX_SEQ = flags.DEFINE_integer("max_seq_len", 384, "Longest sequence, prompt + completion "
                               "(tokens).")
TEMPERATURE = flags.DEFINE_float("temperature", 0.7, "Sampling temperature (the learner scores "
                                 "with the same processing).")
KV_POLICY = flags.DEFINE_enum("kv_policy", "keep", ["keep", "recompute"],
                              "KV after an in-flight update: keep (PipelineRL) | recompute (AReaL).")
SAMPLER_DTYPE = flags.DEFINE_enum(
    "sampler_dtype", "model", ["model", "float32", "bfloat16"],
    "Compute and KV-cache dtype of the rollout sampler: model (same as the learner) | float32 | "
    "bfloat16 (precision mismatch of a bf16 inference engine, ablation A9).")
EVAL_EVERY = flags.DEFINE_integer("eval_every", 10, "Learner steps between held-out evaluations.")
EVAL_PROBLEMS = flags.DEFINE_integer("eval_problems", _P.eval_problems, "Held-out problems.")
CKPT_EVERY = flags.DEFINE_integer("checkpoint_every", 5, "Learner steps between checkpoints.")
TIMEOUT = flags.DEFINE_float("wait_timeout_s", _P.wait_timeout_s, "Limit of every wait "
                             "(seconds).")
DEBUG_PUSH = flags.DEFINE_bool("debug_verify_push", False, "Check each weight push on a probe "
                               "sequence (slow).")
SEED = flags.DEFINE_integer("seed", 0, "Seed of prompt order, sampling and learner.")
DECODE_BASE = flags.DEFINE_float("cost_decode_base_s", _C.decode_base_s,
                                 "Virtual clock: decode step, fixed part (seconds).")
DECODE_SLOT = flags.DEFINE_float("cost_decode_per_slot_s", _C.decode_per_slot_s,
                                 "Virtual clock: decode step, per active slot (seconds).")
PREFILL_TOK = flags.DEFINE_float("cost_prefill_per_token_s", _C.prefill_per_token_s,
                                 "Virtual clock: prefill per token (seconds).")
TRAIN_BASE = flags.DEFINE_float("cost_train_base_s", _C.train_base_s,
                                "Virtual clock: learner step, fixed part (seconds).")
TRAIN_TOK = flags.DEFINE_float("cost_train_per_token_s", _C.train_per_token_s,
                               "Virtual clock: learner step per trained token (seconds).")
PUSH = flags.DEFINE_float("cost_push_s", _C.push_s, "Virtual clock: one weight push (seconds).")


flags.register_validator("max_lag", lambda v: v >= -1,
                         message="--max_lag must be >= 0 (steps), or -1 for unbounded.")


def run_config_from_flags(**overrides) -> run_lib.RunConfig:
  """Builds the RunConfig from the flags (keyword overrides win over flags)."""
  tok = tokenizer.default_tokenizer()
  max_lag = None if MAX_LAG.value < 0 else MAX_LAG.value
  groups = GROUPS.value
  stale = staleness.StalenessConfig(
      policy=POLICY.value, max_lag=max_lag, groups_per_step=groups,
      queue_capacity_groups=(QUEUE_CAP.value or groups) if POLICY.value == "queue-drop" else None)
  cost = pipeline_config.CostModel(
      decode_base_s=DECODE_BASE.value, decode_per_slot_s=DECODE_SLOT.value,
      prefill_per_token_s=PREFILL_TOK.value, train_base_s=TRAIN_BASE.value,
      train_per_token_s=TRAIN_TOK.value, push_s=PUSH.value)
  pipe = pipeline_config.PipelineConfig(
      driver=DRIVER.value, mode=MODE.value, num_steps=STEPS.value, groups_per_step=groups,
      group_size=GROUP_SIZE.value, seq_len=MAX_SEQ.value, advantage=ADVANTAGE.value,
      staleness=stale, eval_every=EVAL_EVERY.value, eval_problems=EVAL_PROBLEMS.value,
      checkpoint_every=CKPT_EVERY.value, wait_timeout_s=TIMEOUT.value,
      debug_verify_push=DEBUG_PUSH.value, cost_model=cost, seed=SEED.value)
  sampler_dtype = None if SAMPLER_DTYPE.value == "model" else SAMPLER_DTYPE.value
  sampler = SamplerConfig(
      num_slots=SLOTS.value, page_size=PAGE_SIZE.value, num_pages=PAGES.value,
      max_seq_len=MAX_SEQ.value, max_new_tokens=MAX_SEQ.value, eos_id=tok.eos_id,
      kv_policy=KV_POLICY.value, sampling=SamplingConfig(temperature=TEMPERATURE.value),
      seed=SEED.value, **({} if sampler_dtype is None else {"cache_dtype": sampler_dtype}))
  tp = LEARNER_DEVICES.value // LEARNER_FSDP.value
  learner = LearnerConfig(mesh_axes=(("fsdp", LEARNER_FSDP.value), ("tp", tp)),
                          learning_rate=LR.value, warmup_steps=WARMUP.value, seed=SEED.value,
                          adam_eps=ADAM_EPS.value)
  data = SAMPLER_DEVICES.value // SAMPLER_TP.value
  sampler_axes = (("tp", SAMPLER_TP.value),) if data == 1 else (("data", data),
                                                                ("tp", SAMPLER_TP.value))
  kw = dict(run_dir=RUN_DIR.value, init=INIT.value, task=TASK.value, jsonl_path=JSONL.value,
            num_sampler_devices=SAMPLER_DEVICES.value, num_learner_devices=LEARNER_DEVICES.value,
            sampler_mesh_axes=sampler_axes, learner=learner,
            objective=objectives.ObjectiveConfig(
                name=OBJECTIVE.value, truncation=TRUNC.value, aggregation=AGGREGATION.value,
                # Dr. GRPO constant: the sampler's completion budget (max_new_tokens above).
                max_completion_len=(MAX_SEQ.value if AGGREGATION.value == "constant"
                                    else None)),
            sampler=sampler, pipeline=pipe, resume=RESUME.value,
            sampler_compute_dtype=sampler_dtype)
  kw.update(overrides)
  return run_lib.RunConfig(**kw)
