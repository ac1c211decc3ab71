"""Cluster-scale what-if: which sampler/learner split maximizes throughput at a given max lag,
and how idle `sync` leaves the hardware. The analytic accelerator cost model
(`rlax_pipe.costs.accelerator`, from the model's shape and a named chip of `costs.chips`), then
`simulator.simulate`. Every number it reports is a prediction.

Defaults: 64 H100s, Llama-3-8B (bf16 weights and KV), 64 groups x 16 samples per step, 512
prompt tokens, log-normal completion lengths with mean 2048 tokens and log-std 1.0, capped at
16384 (reasoning-RL-like: the cap is 8x the mean, so every step has truncated stragglers); the
learner packs rows of prompt + cap tokens, and its attention FLOPs use the mean sample length
(a packed token attends within its own sample).

Sampler engines of `sampler_tp` chips hold `costs.kv_limited_slots` slots (the pages of an
average-length sequence; a paged engine over-commits and preempts when the tail piles up, which
the simulator does not model). The learner needs ceil(state_bytes_per_param * N /
(learner_hbm_fraction * HBM)) chips at least for weights, gradients and Adam moments (FSDP).
Weight pushes move the bf16 weights over the chip interconnect.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from rlax_pipe import costs as costs_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.pipeline.staleness import StalenessConfig
from rlax_pipe.sim import distributions, formulas
from rlax_pipe.sim import simulator as sim_lib


@dataclasses.dataclass(frozen=True)
class Workload:
  """The RL batch and its lengths (tokens).

  Attributes:
    groups_per_step, group_size: learner batch = groups_per_step * group_size samples.
    prompt_tokens: prompt length of every sample.
    mean_completion_tokens, completion_sigma, max_completion_tokens: log-normal completion
      lengths (mean, log-std, cap), unless `length_dist` is given.
    length_dist: any `LengthDist` to use instead (e.g. `distributions.BodyTail`).
  """

  groups_per_step: int = 64
  group_size: int = 16
  prompt_tokens: int = 512
  mean_completion_tokens: float = 2048.0
  completion_sigma: float = 1.0
  max_completion_tokens: int = 16384
  length_dist: Any = None

  def lengths(self) -> Any:
    """Completion lengths: `length_dist`, or the log-normal with the stated mean and log-std."""
    if self.length_dist is not None:
      return self.length_dist
    return distributions.LogNormal(self.mean_completion_tokens, self.completion_sigma,
                                   self.max_completion_tokens)

  @property
  def row_len(self) -> int:
    """Tokens per packed learner row: the longest sample (prompt + completion cap)."""
    return self.prompt_tokens + self.max_completion_tokens

  @property
  def attention_span(self) -> int:
    """Tokens a trained token attends over, for the learner's attention FLOPs: the mean sample
    length (packed samples attend within their own segment, not the whole row)."""
    return round(self.prompt_tokens + float(self.lengths().mean()))


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Everything the what-if needs besides the split and the driver.

  Attributes:
    num_devices: chips shared by sampler and learner.
    chip: a `costs.chips` name.
    model: the model: a `ModelConfig` (weights in its param dtype, KV in its compute dtype)
      or a `costs.ModelShape` (e.g. `costs.QWEN3_30B_A3B_SHAPE`, a mixture of experts).
    workload: batch and lengths.
    sampler_tp: chips per sampler engine.
    max_slots: cap of an engine's slots.
    hbm_fraction: share of an engine's HBM for weights + KV.
    learner_state_bytes_per_param: weights, gradients and Adam moments per parameter (FSDP).
    learner_hbm_fraction: share of a learner chip's HBM for that state.
    decode_steps_per_dispatch: K of the sampler engines (the engine's default 8).
    assumptions: efficiencies and overheads of the analytic cost model.
  """

  num_devices: int = 64
  chip: str = "H100"
  model: ModelConfig | costs_lib.ModelShape = costs_lib.LLAMA_3_8B
  workload: Workload = Workload()
  sampler_tp: int = 1
  max_slots: int = 512
  hbm_fraction: float = 0.9
  learner_state_bytes_per_param: float = 16.0
  learner_hbm_fraction: float = 0.7
  decode_steps_per_dispatch: int = 8
  assumptions: costs_lib.Assumptions = costs_lib.Assumptions()

  @property
  def shape(self) -> costs_lib.ModelShape:
    """The model's shape for the cost model."""
    if isinstance(self.model, costs_lib.ModelShape):
      return self.model
    return costs_lib.ModelShape.of(self.model, "model")


def _params_label(shape: costs_lib.ModelShape) -> str:
  total = shape.stored_matmul_params / 1e9
  if shape.n_experts:
    return f"{total:.1f}B params ({shape.matmul_params / 1e9:.1f}B active)"
  return f"{total:.1f}B params"


def engine_slots(c: Cluster) -> int:
  """KV-limited decode slots of one sampler engine (`costs.kv_limited_slots`)."""
  w = c.workload
  return costs_lib.kv_limited_slots(c.shape, c.chip, c.sampler_tp,
                                    w.prompt_tokens + float(w.lengths().mean()),
                                    c.hbm_fraction, c.max_slots)


def min_learner_devices(c: Cluster) -> int:
  """Fewest learner chips holding weights + gradients + Adam state (FSDP)."""
  return math.ceil(c.learner_state_bytes_per_param * c.shape.stored_matmul_params
                   / (c.learner_hbm_fraction * costs_lib.chip(c.chip).hbm_bytes))


def costs(c: Cluster, num_learner: int) -> costs_lib.CostModel:
  """The analytic `CostModel` of one engine and a `num_learner`-chip learner."""
  return costs_lib.analytic_cost_model(c.shape, c.chip, sampler_tp=c.sampler_tp,
                                       learner_devices=num_learner,
                                       train_row_len=c.workload.attention_span,
                                       assumptions=c.assumptions)


Setting = tuple[str, int | None, str]  # (driver, max_lag, staleness policy)


def sim_config(c: Cluster, num_learner: int, driver: str, max_lag: int | None,
               num_steps: int = 60, warmup_steps: int = 15, seed: int = 0,
               policy: str = "block") -> sim_lib.SimConfig:
  """The simulated run for a split (num_learner learner chips, the rest sampling).

  Raises:
    ValueError: if the split leaves the learner below `min_learner_devices` or no engine.
  """
  engines = (c.num_devices - num_learner) // c.sampler_tp
  if num_learner < min_learner_devices(c) or engines < 1:
    raise ValueError(f"sim_config: {num_learner} learner devices (min {min_learner_devices(c)}) "
                     f"leave {engines} sampler engines of tp={c.sampler_tp}.")
  w = c.workload
  return sim_lib.SimConfig(
      driver=driver, staleness=StalenessConfig(policy, max_lag, w.groups_per_step),
      group_size=w.group_size, num_steps=num_steps, slots_per_engine=engine_slots(c),
      num_engines=engines, lengths=w.lengths(), costs=costs(c, num_learner),
      warmup_steps=warmup_steps, seed=seed,
      prompt_lengths=distributions.Constant(w.prompt_tokens), prefill_rows=8,
      seq_len=w.row_len, push_bytes=int(c.shape.weight_bytes),
      decode_steps_per_dispatch=c.decode_steps_per_dispatch, share_prompt_pages=True)


def sweep(c: Cluster, settings: Sequence[Setting],
          learner_devices: Sequence[int], num_steps: int = 60, warmup_steps: int = 15
          ) -> list[dict[str, Any]]:
  """Simulates every (driver, max_lag, policy) setting at every split.

  Args:
    c: the cluster.
    settings: e.g. ("sync", 0, "block"), ("pipeline", 4, "block"), ("pipeline", 4, "drop").
    learner_devices: learner sizes to try (the rest of the devices sample).
    num_steps, warmup_steps: simulated steps and steps excluded from the numbers.

  Returns:
    One JSON-ready row per (setting, split): throughput, idle fractions, staleness.
  """
  rows = []
  w = c.workload
  for driver, max_lag, policy in settings:
    for n_l in learner_devices:
      cfg = sim_config(c, n_l, driver, max_lag, num_steps, warmup_steps, policy=policy)
      r = sim_lib.simulate(cfg)
      n_s = c.num_devices - n_l
      rows.append({
          "driver": driver, "max_lag": max_lag, "policy": policy, "learner_devices": n_l,
          "sampler_devices": n_s, "engines": cfg.num_engines, "slots": cfg.concurrency,
          "samples_per_s": r.samples_per_s, "tokens_per_s": r.tokens_per_s,
          "step_period_s": r.step_period_s, "idle_learner": r.idle_learner,
          "idle_sampler": r.idle_sampler, "slot_idle": r.slot_idle,
          "device_idle": (n_l * r.idle_learner + n_s * r.slot_idle) / c.num_devices,
          "token_lag_mean": r.token_lag_mean, "token_lag_max": r.token_lag_max,
          "sample_lag_mean": r.sample_lag_mean, "sample_lag_max": r.sample_lag_max,
          "sync_t99_s": r.sync_t99_s, "sync_t100_s": r.sync_t100_s,
          "wasted_token_fraction": r.wasted_token_fraction,
          "batch_samples": w.groups_per_step * w.group_size})
  return rows


def best_splits(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """The highest-throughput row of each (driver, max_lag, policy), in first-seen order."""
  best: dict[tuple[str, Any], dict[str, Any]] = {}
  for r in rows:
    key = (r["driver"], r["max_lag"], r["policy"])
    if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
      best[key] = r
  return list(best.values())


def balanced_split(c: Cluster) -> dict[str, float]:
  """Closed-form split at rho = 1 (`formulas.split_for_rho`): the learner/sampler chips whose
  unstalled rates match, with per-chip rates c_T, c_R in samples/s from the cost model
  (`simulator.rates` of a one-engine, one-learner-chip configuration)."""
  w = c.workload
  batch = w.groups_per_step * w.group_size
  lo = min_learner_devices(c)
  cfg = sim_config(dataclasses.replace(c, num_devices=lo + c.sampler_tp), lo, "pipeline", None)
  v_rollout, v_train, _ = sim_lib.rates(cfg)
  c_rollout, c_train = v_rollout / c.sampler_tp, v_train / lo
  n_t, n_r = formulas.split_for_rho(c.num_devices, 1.0, c_train, c_rollout)
  return {"learner_devices": n_t, "sampler_devices": n_r, "c_train_samples_per_s": c_train,
          "c_rollout_samples_per_s": c_rollout,
          "period_s": formulas.step_period(batch, c.num_devices, 1.0, c_train, c_rollout)}


def plot(rows: Sequence[dict[str, Any]], path: str, title: str | None = None) -> None:
  """PNG: trained tokens/s vs learner devices, one line per (driver, max_lag, policy)."""
  # Imported here: matplotlib is only needed for plots.
  # pylint: disable=import-outside-toplevel
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(8, 5))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  keys = list(dict.fromkeys((r["driver"], r["max_lag"], r["policy"]) for r in rows))
  for key in keys:
    sel = sorted((r for r in rows if (r["driver"], r["max_lag"], r["policy"]) == key),
                 key=lambda r: r["learner_devices"])
    driver, lag, policy = key
    label = driver if driver == "sync" else f"{driver}, max_lag={lag} ({policy})"
    ax.plot([r["learner_devices"] for r in sel], [r["tokens_per_s"] for r in sel], "o-",
            label=label)
  ax.set_xlabel("learner devices (the rest sample)")
  ax.set_ylabel("trained completion tokens / s")
  ax.grid(alpha=0.3)
  ax.legend(fontsize="small")
  ax.set_title(title or "Throughput vs device split (predicted)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


DEFAULT_SETTINGS: tuple[Setting, ...] = (
    ("sync", 0, "block"), ("pipeline", 1, "block"), ("pipeline", 2, "block"),
    ("pipeline", 4, "block"), ("pipeline", 8, "block"))


def report(c: Cluster = Cluster(), settings: Sequence[Setting] = DEFAULT_SETTINGS,
           learner_devices: Sequence[int] | None = None, num_steps: int = 30,
           warmup_steps: int = 10, png_path: str | None = None) -> dict[str, Any]:
  """The what-if: sweep, best split per setting, sync's idleness, the closed-form split.

  Args:
    c: the cluster and its cost assumptions.
    settings: (driver, max_lag, policy) triples; "sync" is lag 0 by construction.
    learner_devices: learner sizes to try; default the FSDP minimum, then every 8 devices up
      to num_devices - tp.
    num_steps, warmup_steps: simulated steps, and steps excluded from the numbers.
    png_path: where to write the throughput-vs-split plot (None: no plot).

  Returns:
    JSON-ready dict: "assumptions", "rows" (every simulation), "best" (per setting),
    "sync_idle" (sync's idle fractions at its best split), "balanced_split" (rho = 1).
  """
  lo = min_learner_devices(c)
  if learner_devices is None:
    learner_devices = sorted({lo, *range(8 * math.ceil(lo / 8), c.num_devices - c.sampler_tp + 1,
                                         8)})
  rows = sweep(c, settings, learner_devices, num_steps, warmup_steps)
  best = best_splits(rows)
  sync = [r for r in best if r["driver"] == "sync"]
  if png_path:
    plot(rows, png_path, title=f"{c.num_devices} x {c.chip}, "
                               f"{_params_label(c.shape)}, "
                               f"B={c.workload.groups_per_step * c.workload.group_size}")
  return {"assumptions": _jsonable(dataclasses.asdict(c)), "engine_slots": engine_slots(c),
          "cost_model": costs(c, lo).to_dict(),
          "min_learner_devices": lo, "rows": rows, "best": best,
          "sync_idle": ({k: sync[0][k] for k in ("learner_devices", "idle_learner",
                                                 "idle_sampler", "slot_idle", "device_idle",
                                                 "sync_t99_s", "sync_t100_s")}
                        if sync else None),
          "balanced_split": balanced_split(c)}


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (int, float, str, bool)) or x is None:
    return x
  return repr(x)
