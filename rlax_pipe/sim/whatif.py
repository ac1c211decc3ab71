"""Cluster-scale what-if: which sampler/learner split maximizes throughput at a given max lag,
and how idle `sync` leaves the hardware. First-principles costs, then `simulator.simulate`.

Cost assumptions (every number is a field of the dataclasses below; defaults: 64 H100-class
accelerators, a Llama-3-8B-class model, long reasoning-style completions):

Accelerator (`Accelerator`): HBM capacity 80 GB, HBM bandwidth 3.35 TB/s, dense bf16 peak
989 TFLOP/s, 50 GB/s per device for weight pushes (400 Gb/s NIC).

Model (`ModelSpec`): N = 8.0e9 parameters in bf16 (2 bytes each); 32 layers, 8 KV heads of
dimension 128, bf16 KV cache, so KV bytes per token = 2 (K and V) * 32 * 8 * 128 * 2 = 128 KiB.

Sampler engine (`SamplerAssumptions`), one engine per `tp` devices (tensor parallel):
  * KV-limited concurrency: slots = min(max_slots, floor((hbm_fraction * tp * HBM - weights) /
    (kv_bytes_per_token * (prompt + mean completion)))): the pages for an average-length
    sequence (a paged engine over-commits and preempts when the tail piles up; the simulator
    does not model preemption).
  * Decode step latency with b active slots (roofline, `simulator.DecodeCurve`):
      memory-bound  overhead + (weights + b * kv_bytes_per_token * ctx) / (tp * HBM bandwidth),
      compute-bound 2 N b / (tp * peak * decode_mfu),
    latency = max of the two, ctx = prompt + mean completion tokens (KV read per slot per step).
  * Prefill per sample: 2 N * prompt / (tp * peak * prefill_mfu) (no prefix sharing in a group).
Learner (`LearnerAssumptions`): trains on prompt + completion tokens at 6 N FLOPs per token
(forward + backward, Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Sec. 2.1) and
MFU `train_mfu` at every size (linear scaling in devices; any parallel inefficiency is folded into
the MFU, i.e. tokens/s = n * mfu * peak / (6 N)); a fixed `step_overhead_s` per step (optimizer
update, logging); prompt tokens cost a constant per step (B * prompt), folded into train_base_s.
It needs ceil(state_bytes_per_param * N / (hbm_fraction * HBM)) devices at least for weights,
gradients and Adam moments (FSDP).
Weight push: weights bytes / push bandwidth (sampler engines receive in parallel).
Workload (`Workload`): 64 groups x 16 samples = 1024 samples per step, 512 prompt tokens,
log-normal completion lengths with mean 2048 tokens and log-std 1.0, capped at 16384 tokens
(reasoning-RL-like: the cap is 8x the mean, so every step has truncated stragglers).
Defaults give 166 KV-limited slots per engine (tp = 1), a 6.8 ms + 0.10 ms/slot decode step
(memory-bound up to the full batch), 8.2k trained tokens/s per learner device, a 0.32 s push.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from rlax_pipe.pipeline.staleness import StalenessConfig
from rlax_pipe.sim import distributions, formulas
from rlax_pipe.sim import simulator as sim_lib


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """One device. Units: bytes, bytes/s, FLOP/s."""

  hbm_bytes: float = 80e9
  hbm_bandwidth: float = 3.35e12
  peak_flops: float = 989e12
  push_bandwidth: float = 50e9


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Decoder-only model sizes (Llama-3-8B-class by default)."""

  params: float = 8.0e9
  n_layers: int = 32
  n_kv_heads: int = 8
  head_dim: int = 128
  bytes_per_param: float = 2.0
  kv_bytes_per_value: float = 2.0

  @property
  def weight_bytes(self) -> float:
    """Bytes of one copy of the weights."""
    return self.params * self.bytes_per_param

  @property
  def kv_bytes_per_token(self) -> float:
    """K and V of one token over all layers: 2 * layers * kv_heads * head_dim * bytes."""
    return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.kv_bytes_per_value


@dataclasses.dataclass(frozen=True)
class Workload:
  """The RL batch and its lengths (tokens)."""

  groups_per_step: int = 64
  group_size: int = 16
  prompt_tokens: int = 512
  mean_completion_tokens: float = 2048.0
  completion_sigma: float = 1.0
  max_completion_tokens: int = 16384

  def lengths(self) -> distributions.LogNormal:
    """Completion lengths, log-normal with the stated mean and log-std, capped."""
    return distributions.LogNormal(self.mean_completion_tokens, self.completion_sigma,
                                   self.max_completion_tokens)


@dataclasses.dataclass(frozen=True)
class SamplerAssumptions:
  """Sampler engine model (see module docstring)."""

  tp: int = 1
  hbm_fraction: float = 0.9
  max_slots: int = 512
  step_overhead_s: float = 0.002
  decode_mfu: float = 0.5
  prefill_mfu: float = 0.5


@dataclasses.dataclass(frozen=True)
class LearnerAssumptions:
  """Learner model (see module docstring)."""

  train_mfu: float = 0.4
  step_overhead_s: float = 1.0
  state_bytes_per_param: float = 16.0
  hbm_fraction: float = 0.7


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Everything the what-if needs besides the split and the driver."""

  num_devices: int = 64
  accelerator: Accelerator = Accelerator()
  model: ModelSpec = ModelSpec()
  workload: Workload = Workload()
  sampler: SamplerAssumptions = SamplerAssumptions()
  learner: LearnerAssumptions = LearnerAssumptions()


def engine_slots(c: Cluster) -> int:
  """KV-limited decode slots of one sampler engine (>= 1).

  Raises:
    ValueError: if the weights do not fit in the engine's HBM share.
  """
  a, m, w, s = c.accelerator, c.model, c.workload, c.sampler
  free = s.hbm_fraction * s.tp * a.hbm_bytes - m.weight_bytes
  if free <= 0:
    raise ValueError(f"engine_slots: {m.weight_bytes:.3g} B of weights do not fit in "
                     f"{s.tp} x {a.hbm_bytes:.3g} B HBM; raise SamplerAssumptions.tp.")
  ctx = w.prompt_tokens + w.mean_completion_tokens
  return max(1, min(s.max_slots, int(free // (m.kv_bytes_per_token * ctx))))


def decode_curve(c: Cluster) -> sim_lib.DecodeCurve:
  """One engine's decode-step latency vs active slots (module docstring)."""
  a, m, w, s = c.accelerator, c.model, c.workload, c.sampler
  bw = s.tp * a.hbm_bandwidth
  ctx = w.prompt_tokens + w.mean_completion_tokens
  return sim_lib.DecodeCurve(
      base_s=s.step_overhead_s + m.weight_bytes / bw,
      per_slot_s=m.kv_bytes_per_token * ctx / bw,
      compute_s_per_slot=2 * m.params / (s.tp * a.peak_flops * s.decode_mfu))


def learner_tokens_per_s(c: Cluster, num_learner: int) -> float:
  """Trained tokens/s of `num_learner` devices: n * mfu * peak / (6 N)."""
  return num_learner * c.learner.train_mfu * c.accelerator.peak_flops / (6 * c.model.params)


def min_learner_devices(c: Cluster) -> int:
  """Fewest learner devices holding weights + gradients + Adam state (FSDP)."""
  return math.ceil(c.learner.state_bytes_per_param * c.model.params
                   / (c.learner.hbm_fraction * c.accelerator.hbm_bytes))


def costs(c: Cluster, num_learner: int) -> sim_lib.SimCosts:
  """`SimCosts` of one engine and a `num_learner`-device learner (module docstring)."""
  a, m, w, s = c.accelerator, c.model, c.workload, c.sampler
  rate = learner_tokens_per_s(c, num_learner)
  batch = w.groups_per_step * w.group_size
  return sim_lib.SimCosts(
      decode=decode_curve(c),
      prefill_per_sample_s=2 * m.params * w.prompt_tokens / (s.tp * a.peak_flops * s.prefill_mfu),
      train_base_s=c.learner.step_overhead_s + batch * w.prompt_tokens / rate,
      train_per_token_s=1.0 / rate,
      push_s=m.weight_bytes / a.push_bandwidth)


Setting = tuple[str, int | None, str]  # (driver, max_lag, staleness policy)


def sim_config(c: Cluster, num_learner: int, driver: str, max_lag: int | None,
               num_steps: int = 60, warmup_steps: int = 15, seed: int = 0,
               policy: str = "block") -> sim_lib.SimConfig:
  """The simulated run for a split (num_learner learner devices, the rest sampling).

  Raises:
    ValueError: if the split leaves the learner below `min_learner_devices` or no engine.
  """
  engines = (c.num_devices - num_learner) // c.sampler.tp
  if num_learner < min_learner_devices(c) or engines < 1:
    raise ValueError(f"sim_config: {num_learner} learner devices (min {min_learner_devices(c)}) "
                     f"leave {engines} sampler engines of tp={c.sampler.tp}.")
  w = c.workload
  return sim_lib.SimConfig(
      driver=driver, staleness=StalenessConfig(policy, max_lag, w.groups_per_step),
      group_size=w.group_size, num_steps=num_steps, slots_per_engine=engine_slots(c),
      num_engines=engines, lengths=w.lengths(), costs=costs(c, num_learner),
      warmup_steps=warmup_steps, seed=seed)


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
          "lag_mean": r.lag_mean, "lag_max": r.lag_max, "sample_lag_mean": r.sample_lag_mean,
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
  """Closed-form split at rho = 1 (`formulas.split_for_rho`): the learner/sampler devices whose
  unstalled rates match, with per-device rates c_T, c_R in samples/s from the cost model (the
  sampler at full slots, the learner at the batch's tokens per sample)."""
  w = c.workload
  batch = w.groups_per_step * w.group_size
  tokens = w.prompt_tokens + w.mean_completion_tokens
  c_train = learner_tokens_per_s(c, 1) / tokens
  k = costs(c, 1)
  slots = engine_slots(c)
  c_rollout = slots / (w.mean_completion_tokens * k.decode.latency(slots)
                       + k.prefill_per_sample_s) / c.sampler.tp
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
    learner_devices = sorted({lo, *range(8 * math.ceil(lo / 8), c.num_devices - c.sampler.tp + 1,
                                         8)})
  rows = sweep(c, settings, learner_devices, num_steps, warmup_steps)
  best = best_splits(rows)
  sync = [r for r in best if r["driver"] == "sync"]
  if png_path:
    plot(rows, png_path, title=f"{c.num_devices} devices, {c.model.params / 1e9:.0f}B params, "
                               f"B={c.workload.groups_per_step * c.workload.group_size}")
  return {"assumptions": dataclasses.asdict(c), "engine_slots": engine_slots(c),
          "decode_curve": dataclasses.asdict(decode_curve(c)),
          "min_learner_devices": lo, "rows": rows, "best": best,
          "sync_idle": ({k: sync[0][k] for k in ("learner_devices", "idle_learner",
                                                 "idle_sampler", "slot_idle", "device_idle",
                                                 "sync_t99_s", "sync_t100_s")}
                        if sync else None),
          "balanced_split": balanced_split(c)}
