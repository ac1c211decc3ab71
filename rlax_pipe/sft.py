"""Supervised warm start: teach the tiny model the reference traces of a task.

SFT is the learner's objective with advantage 1 on every completion token and no importance
correction (`no_correction`, token-mean aggregation): loss = -mean log pi(reference token), the
usual negative log-likelihood. So the warm start runs through the same sharded `Learner`, packing
and checkpointing code as RL. The warm-started policy should be competent but imperfect
(20-60% held-out accuracy) so RL has headroom; `SFTConfig.steps` and
`SFTConfig.direct_answer_fraction` are the knobs. With the default mixture of demonstrations
(half worked traces, half bare answers) the warm start answers directly on most prompts although
its worked traces are far more accurate on multi-term problems, so RL has a large, fast gain to
find; see `SFTConfig` and WORKSPACE_NOTES.md for why (RL that only refines the traces of a 0.4M
parameter model moves held-out accuracy by a few points in ten minutes).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from rlax_pipe import envs
from rlax_pipe import evaluation
from rlax_pipe import model_dir
from rlax_pipe import objectives
from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.config_dict import ConfigError
from rlax_pipe.learner import CheckpointConfig, Learner, LearnerConfig, OptimizerConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import ModelLike, Transformer, as_model
from rlax_pipe.pipeline import batching
from rlax_pipe.pipeline import rules
from rlax_pipe.sampler import SamplerConfig, SamplerEngine
from rlax_pipe.tasks import base as task_base
from rlax_pipe.types import Rollout


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Supervised warm start.

  Attributes:
    steps: optimizer steps (>= 1).
    rows: packed rows per step (>= 1).
    seq_len: tokens per packed row (>= longest prompt + reference completion + 1).
    learning_rate: peak AdamW learning rate (> 0).
    warmup_steps: linear warmup, in steps (>= 0; capped at steps - 1 for short runs).
    weight_decay: AdamW decoupled weight decay (>= 0).
    learner_devices: devices of the learner mesh, laid out as ("fsdp", n).
    eval_problems: held-out problems for the final accuracy (>= 1).
    eval_slots: decode slots of the evaluation sampler (>= 1).
    log_every: steps between progress lines (>= 1).
    seed: seed of the model init and of the T=1 evaluation sampler.
    direct_answer_fraction: share f in [0, 1) of training problems whose demonstration is the
      bare final answer ("A: 17", no worked trace) instead of the task's reference solution.
      The warm start then imitates a mixture of two demonstrators, one that shows its work
      and one that answers directly, and samples the direct strategy with probability ~f,
      although it is far less accurate on multi-term problems. RL learns to prefer the worked
      trace (the "RL amplifies one of the behaviours learned in pre-training" effect of Zhao et
      al. 2025, "Echo Chamber: RL Post-training Amplifies Behaviors Learned in Pretraining"):
      a large, fast accuracy gain that a tiny model shows within minutes. Which problems get
      the direct demonstration is a fixed pseudo-random function of (problem index, seed), so
      it cannot be read off the prompt. 0 = reference solutions only. The shipped warm start
      uses 0.5 (WORKSPACE_NOTES.md, "SFT warm start").
    tool_fraction: share g in [0, 1) of training problems demonstrated as a tool episode
      (`tool_rollout`: the task's `tool_solution`, e.g. "3+5+2=</s>" + calculator result
      "10\\n" (loss mask 0) + "A: 10</s>"), drawn per (index, seed) independently of the direct
      answers; the rest follow `direct_answer_fraction`. Needs a task with a tool
      (`envs.is_environment` and `tool_solution`, e.g. "arithmetic_calculator"). 0 = no tool
      episodes (the single-turn warm start).
  """

  steps: int = 400
  rows: int = 8
  seq_len: int = 384
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  weight_decay: float = 0.01
  learner_devices: int = 1
  eval_problems: int = 128
  eval_slots: int = 32
  log_every: int = 10
  seed: int = 0
  direct_answer_fraction: float = 0.5
  tool_fraction: float = 0.0

  def __post_init__(self):
    for name in ("steps", "rows", "seq_len", "learner_devices", "eval_problems", "eval_slots",
                 "log_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"SFTConfig.{name}={getattr(self, name)} must be >= 1.")
    if not 0.0 <= self.direct_answer_fraction < 1.0:
      raise ValueError(f"SFTConfig.direct_answer_fraction={self.direct_answer_fraction} must be "
                       "in [0, 1).")
    if not 0.0 <= self.tool_fraction < 1.0:
      raise ValueError(f"SFTConfig.tool_fraction={self.tool_fraction} must be in [0, 1).")
    if not self.learning_rate > 0 or self.warmup_steps < 0 or self.weight_decay < 0:
      raise ValueError("SFTConfig: learning_rate must be > 0, warmup_steps and weight_decay >= 0.")


def default_model_config(vocab_size: int, max_seq_len: int = 384) -> ModelConfig:
  """The default tiny Llama-style policy (2 layers, width 128, GQA 4/2 heads)."""
  return ModelConfig(vocab_size=vocab_size, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=32, d_ff=384, max_seq_len=max_seq_len)


def answers_directly(index: int, fraction: float, seed: int = 0) -> bool:
  """Whether training problem `index` gets the bare-answer demonstration (see SFTConfig).

  A fixed pseudo-random draw per (index, seed): u = U[0, 1) from numpy's PCG64 seeded with
  (seed, index); True iff u < fraction.
  """
  if fraction <= 0.0:
    return False
  return bool(np.random.default_rng((seed, index)).random() < fraction)


def uses_tool(index: int, fraction: float, seed: int = 0) -> bool:
  """Whether training problem `index` gets the tool-episode demonstration (SFTConfig.
  tool_fraction): u = U[0, 1) from PCG64 seeded with (seed, index, 1), a stream apart from
  `answers_directly`'s; True iff u < fraction."""
  if fraction <= 0.0:
    return False
  return bool(np.random.default_rng((seed, index, 1)).random() < fraction)


def demonstration(problem: task_base.Problem, direct: bool) -> str:
  """The SFT target text: the reference solution, or "A: <answer>" when `direct`."""
  return f"{task_base.ANSWER_MARKER} {problem.answer}" if direct else problem.solution


def completion_end_id(tok: tokenizer_lib.Tokenizer) -> int:
  """The id that ends a demonstrated completion: with chat prompts, the chat template's
  end-of-turn token (e.g. "<|im_end|>", what the model writes after an assistant message),
  else EOS. Either is in `tok.stop_ids`, so the RL sampler stops where the demonstration did."""
  template = tok.chat_template
  if tok.prompt_format.kind == "chat" and template is not None:
    text = (template.end_of_turn_text() or "").strip()
    ids = tok.encode_chat_text(text) if text else []
    if len(ids) == 1 and ids[0] in tok.stop_ids:
      return ids[0]
  return tok.eos_id


def reference_rollout(problem: task_base.Problem, tok: tokenizer_lib.Tokenizer,
                      sample_id: int, direct: bool = False) -> Rollout:
  """The demonstration of `problem` (+ its end id, `completion_end_id`) as a Rollout
  (log-probs 0, version 0). The prompt is `tok.encode_prompt` (raw or chat, as RL samples it).

  `direct=True` demonstrates the bare answer instead of the reference solution.
  """
  prompt = np.asarray(tok.encode_prompt(problem.prompt), np.int32)  # as the RL sampler sees it
  completion = np.asarray(tok.encode(demonstration(problem, direct)) + [completion_end_id(tok)],
                          np.int32)
  n = completion.shape[0]
  return Rollout(sample_id=sample_id, group_id=sample_id, prompt_tokens=prompt,
                 completion_tokens=completion, behavior_logprobs=np.zeros(n, np.float32),
                 policy_versions=np.zeros(n, np.int32), finish_reason="eos", reward=1.0,
                 prompt_index=problem.index)


def tool_rollout(problem: task_base.Problem, task, tok: tokenizer_lib.Tokenizer,
                 sample_id: int) -> Rollout:
  """The tool-episode demonstration of `problem` as a two-turn Rollout, token for token what
  `envs.EpisodeEngine` samples and appends: turn 1 (`tool_solution`'s call text + end id, loss
  mask 1), the tool's result rendered by the environment's protocol (`envs.protocol_for`;
  loss mask 0, the environment's tokens), turn 2 (the final answer + end id, loss mask 1).

  Raises:
    ValueError: when the task has no tool (`envs.is_environment`) or `tool_solution`, or its
      protocol does not parse the demonstrated call.
  """
  from rlax_pipe import envs  # pylint: disable=import-outside-toplevel
  if not (envs.is_environment(task) and callable(getattr(task, "tool_solution", None))):
    raise ValueError(f"SFTConfig.tool_fraction > 0 needs a task with a tool and tool_solution "
                     f"(e.g. --config.task=arithmetic_calculator); {type(task).__name__} has "
                     "none.")
  call_text, _, final = task.tool_solution(problem)
  protocol = envs.protocol_for(task, chat=tok.prompt_format.kind == "chat")
  calls = protocol.parse(call_text)
  if not calls:
    raise ValueError(f"the protocol of {type(task).__name__} does not parse its own "
                     f"tool_solution call {call_text!r}.")
  results = [envs.ToolResult(c, task.call_tool(problem, c), "ok") for c in calls]
  end = completion_end_id(tok)
  turn1 = tok.encode(call_text) + [end]
  env = protocol.render(tok, results)
  turn2 = tok.encode(final) + [end]
  completion = np.asarray(turn1 + env + turn2, np.int32)
  mask = np.concatenate([np.ones(len(turn1)), np.zeros(len(env)), np.ones(len(turn2))])
  n = completion.shape[0]
  return Rollout(sample_id=sample_id, group_id=sample_id,
                 prompt_tokens=np.asarray(tok.encode_prompt(problem.prompt), np.int32),
                 completion_tokens=completion, behavior_logprobs=np.zeros(n, np.float32),
                 policy_versions=np.zeros(n, np.int32), finish_reason="eos", reward=1.0,
                 prompt_index=problem.index, loss_mask=mask.astype(np.float32), num_turns=2)


def next_batch(task: task_base.Task, tok: tokenizer_lib.Tokenizer, start: int, rows: int,
               seq_len: int, direct_answer_fraction: float = 0.0, seed: int = 0,
               tool_fraction: float = 0.0):
  """Packs consecutive training problems from index `start` into exactly `rows` rows.

  Problems whose prompt + demonstration exceed `seq_len` tokens are skipped. A share
  `tool_fraction` of problems is demonstrated by a tool episode (`uses_tool`, `tool_rollout`;
  its environment tokens are context, loss mask 0), and of the rest a share
  `direct_answer_fraction` by the bare answer (`answers_directly`).

  Returns:
    (TrainBatch [rows, seq_len], next_index).

  Raises:
    ValueError: if no problem in a long stretch fits in `seq_len` tokens.
  """
  items, lengths, index = [], [], start
  while True:
    if uses_tool(index, tool_fraction, seed):
      candidate = tool_rollout(task.problem(index), task, tok, index)
    else:
      candidate = reference_rollout(task.problem(index), tok, index,
                                    answers_directly(index, direct_answer_fraction, seed))
    n = candidate.prompt_tokens.shape[0] + candidate.num_completion_tokens
    if n > seq_len:  # cannot be imitated in rows of this length: skipped
      index += 1
      if index - start > 100 * rows and not items:
        raise ValueError(f"no problem from index {start} on fits in seq_len={seq_len} tokens.")
      continue
    if len(rules.packing_plan(lengths + [n], seq_len)) > rows:
      break
    items.append(candidate)
    lengths.append(n)
    index += 1
  advantages = np.ones(len(items), np.float32)
  return batching.pack_rollouts(items, advantages, seq_len, num_rows=rows), index


def eval_engine(model: ModelLike, params: Any, tok: tokenizer_lib.Tokenizer, *,
                slots: int, max_seq_len: int, sampling: SamplingConfig, mesh=None,
                seed: int = 0) -> SamplerEngine:
  """A paged sampler engine for held-out evaluation (prompts + completions <= max_seq_len)."""
  page_size = 16
  cfg = SamplerConfig(num_slots=slots, page_size=page_size,
                      num_pages=slots * (-(-max_seq_len // page_size)), max_seq_len=max_seq_len,
                      max_new_tokens=max_seq_len, eos_id=model_dir.stop_set(tok),
                      sampling=sampling, seed=seed)
  return SamplerEngine(model, cfg, params, mesh=mesh)


def run_sft(task: task_base.Task, tok: tokenizer_lib.Tokenizer, cfg: SFTConfig,
            out_dir: str | pathlib.Path, model: ModelLike | None = None,
            params: Any = None) -> dict:
  """Trains the warm start, evaluates greedy and T=1 accuracy, writes the checkpoints.

  An environment task (`envs.is_environment`, e.g. "arithmetic_calculator" with
  `cfg.tool_fraction` > 0) is evaluated as episodes with its tools (`envs.evaluation_engine`),
  and its chat prompts declare the tools (`envs.declare_tools`), as the RL job does.

  Two checkpoints of the final weights: `out_dir` as an HF model directory (config.json +
  model.safetensors + the tokenizer's files + generation_config.json, `model_dir.
  export_model_dir`; loadable with transformers, and what the RL job's `RunConfig.init` takes,
  tokenizer included; built-in model only) and `out_dir/orbax/` (the learner's full orbax state:
  params, AdamW state, version, RNG; restore with a `Learner` whose checkpoint directory is
  there). `out_dir/sft_result.json` holds the returned summary.

  Args:
    task: task whose reference solutions are imitated.
    tok: tokenizer (its prompt format, raw or chat, is how prompts are rendered).
    cfg: SFT configuration.
    out_dir: output directory (created; must not already hold a checkpoint).
    model: model to train (`rlax_pipe.model.Model` or a `ModelConfig`); default the built-in
      `default_model_config(tok.vocab_size, cfg.seq_len)`.
    params: initial params of `model` (e.g. an HF model directory's, `hf_io.load_hf_checkpoint`);
      None = a random init from `cfg.seed`.

  Returns:
    Summary dict: steps, seconds, final loss, greedy and T=1 held-out accuracy, etc.

  Raises:
    FileExistsError: when out_dir already holds a model (checked before training).
    OSError: when out_dir cannot be created (checked before training).
    ConfigError: when cfg.learner_devices exceeds the devices present.
    ConfigError: when cfg.seq_len exceeds the model's context, or the tokenizer's ids do not
      fit its embedding.
  """
  out_dir = pathlib.Path(out_dir)
  if envs.is_environment(task):  # chat prompts declare the tools, as the RL job's do
    envs.declare_tools(tok, task)
  model = as_model(model or default_model_config(tok.vocab_size, cfg.seq_len))
  if cfg.learner_devices > len(jax.devices()):
    raise ConfigError(
        f"SFTConfig.learner_devices={cfg.learner_devices} (--config.sft.learner_devices) but "
        f"{len(jax.devices())} device(s) found; lower it (on a CPU-only machine, XLA_FLAGS="
        f"--xla_force_host_platform_device_count={cfg.learner_devices} gives more).")
  if (out_dir / "config.json").exists() or list(out_dir.glob("model*.safetensors")):
    raise FileExistsError(f"{out_dir} already holds a model; choose another output directory.")
  out_dir.mkdir(parents=True, exist_ok=True)  # before training: an unwritable one fails now
  if cfg.seq_len > model.max_seq_len:
    raise ConfigError(f"SFTConfig.seq_len={cfg.seq_len} (--config.sft.seq_len) exceeds the "
                      f"model's context ({model.max_seq_len} positions); lower it.")
  if tok.vocab_size > model.vocab_size:
    raise ConfigError(f"the tokenizer ({tok.source}) has {tok.vocab_size} ids, the model "
                      f"{model.vocab_size} embeddings: use the model's own tokenizer.")
  learner_cfg = LearnerConfig(
      mesh_axes=(("fsdp", cfg.learner_devices),), seed=cfg.seed,
      optimizer=OptimizerConfig(learning_rate=cfg.learning_rate,
                                warmup_steps=min(cfg.warmup_steps, cfg.steps - 1),
                                schedule="cosine", decay_steps=cfg.steps + 1, min_lr_ratio=0.1,
                                weight_decay=cfg.weight_decay),
      checkpoint=CheckpointConfig(directory=str(out_dir / "orbax"), keep=1, async_save=False))
  objective_cfg = objectives.ObjectiveConfig(name="no_correction", aggregation="token_mean")
  learner = Learner(model, learner_cfg, objective_cfg, SamplingConfig(),
                    devices=jax.devices()[:cfg.learner_devices], params=params)
  t0, index, losses = time.perf_counter(), 0, []
  for step in range(cfg.steps):
    batch, index = next_batch(task, tok, index, cfg.rows, cfg.seq_len, cfg.direct_answer_fraction,
                              cfg.seed, cfg.tool_fraction)
    metrics = learner.train_step(batch)
    if metrics is not None:
      losses.append(float(metrics["loss"]))
    if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
      elapsed = time.perf_counter() - t0
      eta = elapsed / (step + 1) * (cfg.steps - step - 1)
      logging.info("sft step %d/%d  loss %.4f  problems %d  %.1fs elapsed  ETA %.0fs",
                   step + 1, cfg.steps, losses[-1] if losses else float("nan"), index, elapsed,
                   eta)
  last = learner.flush()
  if last is not None:
    losses.append(float(last["loss"]))
  train_s = time.perf_counter() - t0
  learner.save({"sft_steps": cfg.steps, "problems_seen": index})
  params = jax.device_get(learner.params)
  learner.close()

  if isinstance(model, Transformer):  # HF format exists for the built-in family only
    model_dir.export_model_dir(out_dir, params, model.cfg, tok)
  problems = evaluation.eval_problems(task, cfg.eval_problems)
  params_dev = jax.device_put(params, jax.devices()[0])  # the eval engine's one-device mesh
  results = {}
  for name, sampling in (("greedy", SamplingConfig(greedy=True)),
                         ("t1", SamplingConfig(temperature=1.0))):
    engine = eval_engine(model, params_dev, tok, slots=cfg.eval_slots,
                         max_seq_len=cfg.seq_len, sampling=sampling, seed=cfg.seed)
    if envs.is_environment(task):  # episodes with the task's tools, as RL samples them
      engine = envs.evaluation_engine(engine, task, tok)
    results[name] = evaluation.evaluate(engine, task, tok, problems)
    if envs.is_environment(task):
      engine.close()
  summary = {
      "steps": cfg.steps, "train_seconds": round(train_s, 1),
      "total_seconds": round(time.perf_counter() - t0, 1), "problems_seen": index,
      "final_loss": losses[-1] if losses else None,
      "greedy_accuracy": results["greedy"].accuracy, "t1_accuracy": results["t1"].accuracy,
      "eval_problems": cfg.eval_problems,
      "greedy_accuracy_by_difficulty": results["greedy"].accuracy_by_difficulty,
      "greedy_count_by_difficulty": results["greedy"].count_by_difficulty,
      **({"greedy_tool_use_by_difficulty": results["greedy"].tool_use_by_difficulty,
          "greedy_tool_calls": results["greedy"].tool_calls,
          "t1_tool_calls": results["t1"].tool_calls} if envs.is_environment(task) else {}),
      "config": dataclasses.asdict(cfg),
  }
  (out_dir / "sft_result.json").write_text(json.dumps(summary, indent=2))
  return summary
