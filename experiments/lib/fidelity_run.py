"""Issue 26's gradient-fidelity instrument: stale-batch gradients against the on-policy one.

One run of `run_instrument`:
  1. checkpoints theta_0 .. theta_T: its own short synchronous on-policy run of the given regime
     (the stress regime's optimizer, sampling, batch and model; objective TIS), kept in host
     memory and optionally saved to / loaded from an .npz (`checkpoints_path`);
  2. for each target version v (the last `num_targets` checkpoints, `target_stride` apart):
     the on-policy gradient g* at v from `true_batches` fresh batches of theta_v (its own
     standard error reported), then for each lag k, `batches` batches sampled by theta_{v-k} and
     every objective's gradient at theta_v on each (`rlax_pipe.fidelity.objective_gradients`);
  3. the in-flight mix case: each batch starts at theta_{v-K} and moves one version forward every
     `tokens_per_version` generated tokens until it reaches v (PipelineRL's lag profile: early
     tokens of a sample are the stalest), the continuation re-prefills the prefix with the new
     weights (no stale KV cache: PipelineRL Sec. 5.1 measured that stale KV adds little KL);
  4. the precision case: lag 0 batches sampled by a bfloat16-compute copy of theta_v, trained in
     float32 (claim (c));
  5. per objective and case: `rlax_pipe.fidelity.fidelity` per target, pooled over targets, plus
     ESS / truncated fraction / ratio variance / k3 KL per batch with t intervals.

Sampling uses `static_generate` (dense cache, same `logprobs.sample` as the engine); rewards come
from the task's own `reward`, advantages from GRPO group normalisation (the learner's default).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from rlax_pipe import advantages as adv_lib
from rlax_pipe import fidelity
from rlax_pipe import grading
from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe import model_dir
from rlax_pipe import tasks
from rlax_pipe.learner import optimizer as optimizer_lib
from rlax_pipe.model import Transformer
from rlax_pipe.objectives import ObjectiveConfig
from rlax_pipe.pipeline import batching
from rlax_pipe.pipeline import rules
from rlax_pipe.pipeline import config_checks
from rlax_pipe.pipeline import job as job_lib
from rlax_pipe.pipeline.config import RunConfig
from rlax_pipe.sampler.config import Request
from rlax_pipe.sampler.static_generate import static_generate
from rlax_pipe.types import Rollout

# label -> objective (claims (a), (b), (d)); c = 2 is the stress regime's TIS level.
OBJECTIVES: dict[str, ObjectiveConfig] = {
    "no_correction": ObjectiveConfig(name="no_correction"),
    "untruncated_is": ObjectiveConfig(name="untruncated_is"),
    "tis": ObjectiveConfig(name="tis_pg", truncation=2.0),
    "cispo": ObjectiveConfig(name="cispo", truncation=5.0),
    "decoupled_ppo": ObjectiveConfig(name="decoupled_ppo"),
    "tis_lag_aware": ObjectiveConfig(name="tis_pg", truncation=2.0, lag_truncation=0.7),
}


@dataclasses.dataclass(frozen=True)
class InstrumentConfig:
  """What the instrument measures (the regime itself is a `RunConfig`).

  Attributes:
    lags: lags k >= 0 of the fixed-lag cases (steps).
    mixed_lags: max lags K >= 1 of the in-flight mix cases (empty = none).
    tokens_per_version: generated tokens per version step in the in-flight mix (>= 1).
    num_targets: target versions v compared (>= 1), the last checkpoints `target_stride` apart.
    target_stride: steps between target versions (>= 1).
    batches: stale batches N per (target, case) (>= 2).
    true_batches: on-policy batches M for g* per target (>= 2).
    bf16_case: also measure lag 0 with a bfloat16-compute sampler (claim (c)).
    seed: seed of the run, the prompts and the sampling.
  """

  lags: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 64)
  mixed_lags: tuple[int, ...] = (4, 16)
  tokens_per_version: int = 8
  num_targets: int = 2
  target_stride: int = 4
  batches: int = 12
  true_batches: int = 24
  bf16_case: bool = True
  seed: int = 0

  def __post_init__(self):
    if not self.lags or any(k < 0 for k in self.lags):
      raise ValueError(f"InstrumentConfig.lags={self.lags} must be non-empty lags >= 0.")
    if any(k < 1 for k in self.mixed_lags):
      raise ValueError(f"InstrumentConfig.mixed_lags={self.mixed_lags} must be >= 1.")
    for f in ("tokens_per_version", "num_targets", "target_stride"):
      if getattr(self, f) < 1:
        raise ValueError(f"InstrumentConfig.{f}={getattr(self, f)} must be >= 1.")
    if self.batches < 2 or self.true_batches < 2:
      raise ValueError(f"InstrumentConfig.batches={self.batches} and true_batches="
                       f"{self.true_batches} must be >= 2 (an interval needs two batches).")

  @property
  def train_steps(self) -> int:
    """Checkpoints needed: the oldest target must have max lag checkpoints before it."""
    return max(self.lags + self.mixed_lags) + (self.num_targets - 1) * self.target_stride

  def targets(self) -> list[int]:
    t = self.train_steps
    return [t - j * self.target_stride for j in range(self.num_targets)]


@dataclasses.dataclass
class Setup:
  """The regime's pieces: model (learner, bf16 sampler), tokenizer, task, stop ids, sizes."""

  run: RunConfig
  model: Any
  bf16_model: Any
  tok: Any
  task: Any
  stop_ids: Any
  params0: Any
  group_size: int
  groups: int
  seq_len: int
  max_new_tokens: int
  sampling: logprobs_lib.SamplingConfig
  grad_fns: dict = dataclasses.field(default_factory=dict)


def make_setup(run: RunConfig) -> Setup:
  """Loads the warm start, tokenizer and task of `run` (as the pipeline job does)."""
  model_cfg, params = job_lib.load_initial_params(run.init)
  model = Transformer(model_cfg)
  tok = model_dir.tokenizer_for(None if run.init == job_lib.BUILTIN_INIT else run.init,
                                run.tokenizer_path, run.prompt_format)[0]
  task = tasks.make_task(run.task, config_checks.task_config_of(run))
  stops = job_lib.stop_ids_for(run, tok, model)
  return Setup(run=run, model=model, bf16_model=model.with_compute_dtype("bfloat16"), tok=tok,
               task=task, stop_ids=stops, params0=jax.device_get(params),
               group_size=run.pipeline.group_size,
               groups=run.pipeline.staleness.groups_per_step, seq_len=run.pipeline.seq_len,
               max_new_tokens=min(run.sampler.max_new_tokens, run.sampler.max_seq_len),
               sampling=run.sampler.sampling)


def _requests(s: Setup, rng: np.random.Generator) -> tuple[list, list[Request]]:
  problems = s.task.sample_prompts(rng, s.groups)
  reqs, probs = [], []
  for g, p in enumerate(problems):
    ids = grading.prepare_prompt(s.tok, p.prompt, s.seq_len, s.run.pipeline.grading).ids
    if ids is None:
      raise ValueError(f"prompt {p.index} does not fit seq_len={s.seq_len}; raise "
                       "--config.pipeline.seq_len.")
    for j in range(s.group_size):
      reqs.append(Request(prompt_tokens=np.asarray(ids, np.int32), sample_id=len(reqs),
                          group_id=g, prompt_index=p.index))
      probs.append(p)
  return probs, reqs


def _generate(s: Setup, model, params, reqs: list[Request], version: int, budget: int,
              seed: int):
  # One static batch of the full batch size (padded), so the program compiles once per width.
  return static_generate(params, model, reqs, batch_size=s.groups * s.group_size,
                         max_seq_len=s.seq_len, max_new_tokens=budget, sampling=s.sampling,
                         eos_id=s.stop_ids, seed=seed, version=version)[0]


def sample_batch(s: Setup, ckpts: Sequence[Any], versions: Sequence[int], rng: np.random.Generator,
                 tokens_per_version: int, bf16: bool = False) -> dict[str, np.ndarray]:
  """One graded, packed batch [B, seq_len] whose tokens come from `versions` in order.

  With one version every token is sampled by it; with several, generation moves to the next
  version every `tokens_per_version` tokens (the last version finishes the sample).
  """
  probs, reqs = _requests(s, rng)
  model = s.bf16_model if bf16 else s.model
  prompt_lens = [len(r.prompt_tokens) for r in reqs]
  comp = [np.zeros(0, np.int32) for _ in reqs]
  logp = [np.zeros(0, np.float32) for _ in reqs]
  vers = [np.zeros(0, np.int32) for _ in reqs]
  done = [False] * len(reqs)
  for i, v in enumerate(versions):
    last = i == len(versions) - 1
    live = [j for j in range(len(reqs)) if not done[j]]
    if not live:
      break
    left = [s.max_new_tokens - len(comp[j]) for j in live]
    budget = max(left) if last else tokens_per_version
    sub = [Request(prompt_tokens=np.concatenate([reqs[j].prompt_tokens, comp[j]]),
                   sample_id=j, group_id=reqs[j].group_id,
                   max_new_tokens=min(left[n], budget)) for n, j in enumerate(live)]
    outs = _generate(s, model, ckpts[v], sub, v, budget, int(rng.integers(2**31)))
    for j, r in zip(live, outs):
      comp[j] = np.concatenate([comp[j], r.completion_tokens])
      logp[j] = np.concatenate([logp[j], r.behavior_logprobs])
      vers[j] = np.concatenate([vers[j], r.policy_versions])
      done[j] = done[j] or r.finish_reason != "length" or len(comp[j]) >= s.max_new_tokens \
          or prompt_lens[j] + len(comp[j]) >= s.seq_len - 1
  rollouts, rewards = [], []
  for j, r in enumerate(reqs):
    text = grading.completion_for_grading(s.tok, r.prompt_tokens, comp[j], None)
    rewards.append(float(s.task.reward(probs[j], text)))
    rollouts.append(Rollout(sample_id=r.sample_id, group_id=r.group_id,
                            prompt_tokens=r.prompt_tokens, completion_tokens=comp[j],
                            behavior_logprobs=logp[j], policy_versions=vers[j],
                            finish_reason="eos", reward=rewards[-1],
                            prompt_index=r.prompt_index))
  group_ids = np.array([r.group_id for r in reqs])
  adv = adv_lib.grpo(np.asarray(rewards, np.float32), group_ids)
  # Packed as the learner packs them (rows bucketed to a power of two: few compiles).
  rows = rules.batch_rows([len(r.prompt_tokens) + len(r.completion_tokens) for r in rollouts],
                             s.seq_len)
  batch = batching.pack_rollouts(rollouts, adv, s.seq_len, num_rows=rows)
  out = {f.name: np.asarray(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
  out["reward_mean"] = np.float32(np.mean(rewards))
  return out


def make_grad_fn(s: Setup, cfgs: Sequence[ObjectiveConfig]):
  """jitted (params, batch, version) -> (float32[O, P], BatchDiagnostics); one per cfgs."""
  key = tuple(cfgs)
  if key not in s.grad_fns:
    s.grad_fns[key] = _grad_fn(s.model, s.sampling, key)
  return s.grad_fns[key]


def _grad_fn(model, sampling, cfgs):
  def logp_fn(params, batch):
    logits, _ = model.forward(params, batch["tokens"], batch["positions"],
                              segment_ids_BT=batch["segment_ids"])
    return logprobs_lib.next_token_logprobs_from_logits(logits, batch["tokens"], sampling)[0]

  @jax.jit
  def fn(params, batch, version):
    return fidelity.objective_gradients(functools.partial(logp_fn, batch=batch), params, batch,
                                        version, cfgs)
  keys = ("tokens", "positions", "segment_ids", "loss_mask", "behavior_logprobs",
          "policy_versions", "advantages")
  return lambda params, batch, version: fn(params, {k: batch[k] for k in keys},
                                           jnp.int32(version))


def _reference(s: Setup) -> list[ObjectiveConfig]:
  """The on-policy gradient's program: no correction (and the run's objective, for training)."""
  return _with([ObjectiveConfig(name="no_correction")], s.run.objective)[0]


def _with(cfgs: Sequence[ObjectiveConfig], extra: ObjectiveConfig) -> tuple[list, int]:
  """cfgs with `extra` appended unless present, and extra's index (one compiled program)."""
  cfgs = list(cfgs)
  if extra not in cfgs:
    cfgs.append(extra)
  return cfgs, cfgs.index(extra)


def train_checkpoints(s: Setup, steps: int, seed: int, log=print,
                      objectives: Sequence[ObjectiveConfig] = ()) -> list[Any]:
  """theta_0 .. theta_steps of a synchronous on-policy run (the regime's optimizer and objective).

  `objectives`: the program's objective set (the run's objective is added); default: the run's
  objective and no correction (the program `measure` computes the on-policy gradient with).
  """
  tx = optimizer_lib.make_optimizer(s.run.learner.optimizer)
  cfgs, idx = _with(objectives or _reference(s), s.run.objective)
  grad = make_grad_fn(s, cfgs)
  params = jax.tree.map(jnp.asarray, s.params0)
  unravel = ravel_pytree(params)[1]
  opt = tx.init(params)
  rng = np.random.default_rng(seed)
  ckpts = [jax.device_get(params)]
  for t in range(steps):
    t0 = time.perf_counter()
    batch = sample_batch(s, ckpts, [t], rng, 1)
    g, _ = grad(params, batch, t)
    updates, opt = tx.update(unravel(g[idx]), opt, params)
    params = optax.apply_updates(params, updates)
    ckpts.append(jax.device_get(params))
    log(f"train step {t + 1}/{steps}: reward {float(batch['reward_mean']):.3f} "
        f"({time.perf_counter() - t0:.1f} s)")
  return ckpts


def save_checkpoints(path: str, ckpts: Sequence[Any]) -> None:
  """Writes the checkpoints to one .npz (flattened float32 vectors, one per version)."""
  np.savez(path, *[np.asarray(ravel_pytree(c)[0]) for c in ckpts])


def load_checkpoints(path: str, like: Any) -> list[Any]:
  """Reads `save_checkpoints`'s file back into pytrees shaped like `like`."""
  unravel = ravel_pytree(jax.tree.map(jnp.asarray, like))[1]
  with np.load(path) as f:
    return [jax.device_get(unravel(jnp.asarray(f[f"arr_{i}"]))) for i in range(len(f.files))]


def _cases(cfg: InstrumentConfig) -> list[tuple[str, int]]:
  """Cases in the order the claims need them (an interrupted run keeps the decisive ones):
  the smallest and largest lag, bf16, the in-flight mixes, then the lags between."""
  lags = sorted(set(cfg.lags))
  first = [("lag", lags[0])] + ([("lag", lags[-1])] if len(lags) > 1 else [])
  return (first + ([("bf16", 0)] if cfg.bf16_case else [])
          + [("mixed", k) for k in cfg.mixed_lags] + [("lag", k) for k in lags[1:-1]])


def _versions(case: str, k: int, v: int) -> list[int]:
  return list(range(v - k, v + 1)) if case == "mixed" else [v - k]


def measure(s: Setup, ckpts: Sequence[Any], cfg: InstrumentConfig,
            objectives: dict[str, ObjectiveConfig] = OBJECTIVES, log=print,
            partial=None) -> dict:
  """Runs steps 2-5 of the module docstring; returns the JSON-ready table.

  `partial`: None, or a callable given the table so far after every (target, case).
  """
  labels = list(objectives)
  grad = make_grad_fn(s, [objectives[n] for n in labels])
  true_grad = make_grad_fn(s, _reference(s))  # [no correction, run objective]: training's
  rng = np.random.default_rng(cfg.seed + 1)
  per_target, truths = {}, []
  for v in cfg.targets():
    params = jax.tree.map(jnp.asarray, ckpts[v])
    t0 = time.perf_counter()
    g_true = np.stack([np.asarray(true_grad(params, sample_batch(
        s, ckpts, [v], rng, 1), v)[0][0]) for _ in range(cfg.true_batches)])
    truth = fidelity.true_gradient(g_true)
    scale2 = float(np.mean(np.sum(np.asarray(g_true, np.float64) ** 2, axis=1)))
    del g_true
    truths.append(dict(version=v, norm=truth.norm, rel_se=truth.rel_se,
                       batches=truth.num_batches, energy=scale2))
    log(f"target v={v}: |g*|={truth.norm:.4g}, relative s.e. {truth.rel_se:.3f} "
        f"({time.perf_counter() - t0:.1f} s)")
    for case, k in _cases(cfg):
      t0 = time.perf_counter()
      gs, diags = [], []
      for _ in range(cfg.batches):
        batch = sample_batch(s, ckpts, _versions(case, k, v), rng, cfg.tokens_per_version,
                             bf16=case == "bf16")
        g, d = grad(params, batch, v)
        gs.append(np.asarray(g))
        diags.append({f: np.asarray(x) for f, x in d._asdict().items()})
      g_ONP = np.stack(gs, axis=1)
      del gs
      free = _reference_free(g_ONP, labels, scale2)
      for o, name in enumerate(labels):
        fid = fidelity.fidelity(g_ONP[o], truth)
        d = {f: np.array([x[f][o] for x in diags]) for f in diags[0]}
        d.update(fidelity.per_batch(g_ONP[o], truth))
        d.update(free[o])
        per_target.setdefault((case, k, name), []).append((fid, d))
      log(f"  {case} {k}: {time.perf_counter() - t0:.1f} s")
      if partial is not None:  # what is measured so far survives an interrupted run
        partial(_table(per_target, truths, objectives, cfg))
  return _table(per_target, truths, objectives, cfg)


ANCHOR = "untruncated_is"  # the objective the reference-free biases are measured against
FREE_METRICS = ("energy", "bias2", "var", "mse")  # per batch: energy; jackknife pseudo-values


def _reference_free(g_ONP: np.ndarray, labels: Sequence[str], scale2: float) -> list[dict]:
  """`fidelity.paired_stats` of one (target, case): every objective on the same batches, biases
  against untruncated IS (when measured and N >= 3; else nothing)."""
  o, n, p = g_ONP.shape
  if ANCHOR not in labels or n < 3 or not scale2 > 0:
    return [{} for _ in labels]
  g = fidelity.gram(g_ONP.reshape(o * n, p))
  return fidelity.paired_stats(g, o, list(labels).index(ANCHOR), scale2)


def _table(per_target: dict, truths: list, objectives: dict, cfg: InstrumentConfig) -> dict:
  """Rows pooled over the targets measured so far (see `measure`)."""
  rows = []
  for (case, k, name), items in per_target.items():
    fids = [f for f, _ in items]
    row = dict(case=case, lag=k, objective=name, targets=len(items),
               batches=sum(f.num_batches for f in fids))
    for m in ("cosine", "bias_parallel", "trace_var", "proj_var"):
      row[m] = list(fidelity.pooled([getattr(f, m) for f in fids]))
    for m in ("cosine_of_mean", "bias_norm", "bias_noise_floor"):
      row[m] = float(np.mean([getattr(f, m) for f in fids]))
    for m in [m for m in items[0][1] if m not in row]:
      vals = np.concatenate([d[m] for _, d in items])
      vals = vals[np.isfinite(vals)]
      row[m] = list(fidelity.mean_interval(vals)) if vals.size else [float("nan")] * 3
    # Per-batch values in batch order (same order for every objective of a case): paired
    # comparisons of objectives on the same batches (fidelity_report.claims).
    row["per_batch"] = {m: np.concatenate([d[m] for _, d in items]).tolist()
                        for m in ("cosine", "parallel", "sq_error", "ess", "frac_truncated")
                        + FREE_METRICS if m in items[0][1]}
    rows.append(row)
  return dict(rows=rows, truth=truths, objectives={n: dataclasses.asdict(c) for n, c in
                                                   objectives.items()},
              config=dataclasses.asdict(cfg))


def run_instrument(run: RunConfig, cfg: InstrumentConfig, checkpoints_path: str | None = None,
                   save_path: str | None = None, log=print, partial=None) -> dict:
  """Checkpoints (own run, or loaded), then `measure`; returns the table."""
  s = make_setup(run)
  t0 = time.perf_counter()
  if checkpoints_path:
    ckpts = load_checkpoints(checkpoints_path, s.params0)
    if len(ckpts) <= cfg.train_steps:
      raise ValueError(f"{checkpoints_path} holds {len(ckpts)} checkpoints; lags {cfg.lags} and "
                       f"{cfg.num_targets} targets need {cfg.train_steps + 1}.")
  else:
    ckpts = train_checkpoints(s, cfg.train_steps, cfg.seed, log)
    if save_path:
      save_checkpoints(save_path, ckpts)
  train_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  table = measure(s, ckpts, cfg, log=log, partial=partial)
  table.update(train_s=train_s, measure_s=time.perf_counter() - t0,
               regime=dict(lr=run.learner.optimizer.learning_rate,
                           temperature=s.sampling.temperature, groups=s.groups,
                           group_size=s.group_size, seq_len=s.seq_len,
                           max_new_tokens=s.max_new_tokens))
  return table
