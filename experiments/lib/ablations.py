"""Paper-ablation reproductions (PipelineRL, AReaL, Applied Compute, Yao et al.), one function each.

Every ablation takes `tiny` (seconds, for tests) or full size, runs, writes `<out_dir>/<name>.png`
and returns a list of result rows (dicts). The systems ablations (A1, A6, A7, A8) run the
discrete-event simulator of `rlax_pipe.sim`, which executes the pipeline's own admission and
staleness code; the learning ablations (A2, A3, A4, A5, A9, A10 and the claims A11-A14 of
`lib.claims`) run real reproducible RL jobs (`rlax_pipe.pipeline.run`) from a base `RunConfig`
(keyword `base`), each cell once per seed (keyword `seeds`), every metric reported as the mean
over seeds with its 95% t half-width in `<metric>_ci` (`lib.seeds`).

Registry: `ABLATIONS` (name -> function), the single list of valid `--ablation` names.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Callable

import numpy as np

from lib import claims
from rlax_pipe import costs as costs_lib
from rlax_pipe import sim
from rlax_pipe.pipeline import staleness as staleness_lib

# The systems ablations' costs are illustrative, hand-set (labelled so): the qualitative
# questions they answer (idle vs tail, split balance, formula shape, queue policy bias) do not
# need this machine's numbers. Prompts of 16 tokens: 15 prefilled tokens x 2e-5 s = 0.3 ms each.
_COSTS = costs_lib.CostModel(decode_step_s=0.010, slot_step_s=0.0002, prefill_token_s=2e-5,
                             train_step_s=0.05, train_token_s=0.0001, push_s=0.005,
                             source="hand-set, illustrative (ablations A1/A6/A7/A8)")


def _figure(ncols=1):
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(6 * ncols, 4))
  FigureCanvasAgg(fig)
  return fig


def _sim(driver, *, max_lag=4, policy="block", groups=8, group_size=8, slots=64, steps=60,
         lengths=None, costs=_COSTS, capacity=None, engines=1, seed=0):
  stale = staleness_lib.StalenessConfig(
      policy=policy, max_lag=max_lag, groups_per_step=groups,
      queue_capacity_groups=capacity if policy == "queue-drop" else None)
  cfg = sim.SimConfig(driver=driver, staleness=stale, group_size=group_size, num_steps=steps,
                      slots_per_engine=slots, num_engines=engines,
                      lengths=lengths or sim.LogNormal(40.0, 1.0, max_len=360), costs=costs,
                      warmup_steps=max(1, steps // 6), seed=seed)
  return cfg, sim.simulate(cfg)


def a1_long_tail(out_dir: str, tiny: bool = False) -> list[dict]:
  """A1 (Applied Compute talk): synchronous idle time vs tail heaviness and batch size."""
  sigmas = (0.25, 1.0) if tiny else (0.1, 0.25, 0.5, 0.75, 1.0, 1.25)
  batches = (4,) if tiny else (2, 8, 32)
  rows = []
  for groups in batches:
    for s in sigmas:
      _, r = _sim("sync", max_lag=0, groups=groups, slots=groups * 8, steps=8 if tiny else 40,
                  lengths=sim.LogNormal(40.0, s, max_len=2000))
      rows.append({"ablation": "A1", "groups": groups, "sigma": s,
                   "idle_sampler_slots": r.slot_idle, "idle_learner": r.idle_learner,
                   "t99_s": r.sync_t99_s, "t100_s": r.sync_t100_s,
                   "tail_share": 1 - r.sync_t99_s / r.sync_t100_s if r.sync_t100_s else None})
  fig = _figure(2)
  ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
  for g in batches:
    sel = [r for r in rows if r["groups"] == g]
    ax1.plot([r["sigma"] for r in sel], [r["idle_sampler_slots"] for r in sel], "o-",
             label=f"{g} groups x 8")
    ax2.plot([r["sigma"] for r in sel], [r["tail_share"] for r in sel], "o-", label=f"{g} groups")
  ax1.set(xlabel="log-normal sigma of lengths", ylabel="sync: unused sampler slot-time",
          title="A1: idle sampler slots (sync, simulated)")
  ax2.set(xlabel="log-normal sigma of lengths", ylabel="share of round after 99% finished",
          title="A1: the tail's share of a round (simulated)")
  ax1.legend()
  fig.savefig(pathlib.Path(out_dir) / "A1.png", dpi=90)
  return rows


def a6_device_split(out_dir: str, tiny: bool = False) -> list[dict]:
  """A6: sampler/learner split of N devices; throughput peaks when the two sides balance."""
  total = 8
  rows = []
  for learners in ((2, 6) if tiny else range(1, total)):
    samplers = total - learners
    costs = dataclasses.replace(_COSTS, train_token_s=_COSTS.train_token_s * 4 / learners,
                                train_step_s=_COSTS.train_step_s * 4 / learners)
    _, r = _sim("pipeline", max_lag=4, engines=samplers, slots=16, costs=costs,
                steps=10 if tiny else 60)
    rows.append({"ablation": "A6", "learner_devices": learners, "sampler_devices": samplers,
                 "samples_per_s": r.samples_per_s, "idle_sampler": r.idle_sampler,
                 "idle_learner": r.idle_learner, "token_lag_mean": r.token_lag_mean,
                 "sample_lag_mean": r.sample_lag_mean})
  fig = _figure()
  ax = fig.add_subplot(1, 1, 1)
  ax.plot([r["learner_devices"] for r in rows], [r["samples_per_s"] for r in rows], "o-")
  ax.set(xlabel=f"learner devices (of {total})", ylabel="samples/s (simulated)",
         title="A6: throughput vs device split (simulated)")
  fig.savefig(pathlib.Path(out_dir) / "A6.png", dpi=90)
  return rows


def a7_staleness_formula(out_dir: str, tiny: bool = False) -> list[dict]:
  """A7 (Applied Compute): simulated mean staleness vs C*M_tail/B + rho (rollout-bound)."""
  rows = []
  lengths = sim.LogNormal(40.0, 0.6, max_len=400)
  sample = lengths.sample(np.random.default_rng(0), 20000)
  for slots in ((32,) if tiny else (16, 32, 64, 128)):
    for groups in ((4,) if tiny else (4, 8, 16)):
      cfg, r = _sim("pipeline", max_lag=None, policy="block", groups=groups, slots=slots,
                    lengths=lengths, steps=10 if tiny else 80)
      v_roll, v_train, rho = sim.rates(cfg)
      m_tail = sim.tailness(sample, cfg.group_size)
      pred = sim.applied_compute_staleness(slots, groups * cfg.group_size, rho, m_tail, 1.0)
      rows.append({"ablation": "A7", "C": slots, "B": groups * cfg.group_size, "rho": rho,
                   "m_tail": m_tail, "measured_sample_lag": r.sample_lag_mean,
                   "predicted": pred})
  fig = _figure()
  ax = fig.add_subplot(1, 1, 1)
  ax.plot([r["predicted"] for r in rows], [r["measured_sample_lag"] for r in rows], "o")
  hi = max([r["predicted"] for r in rows] + [r["measured_sample_lag"] for r in rows] + [1])
  ax.plot([0, hi], [0, hi], "k--", lw=1)
  ax.set(xlabel="predicted mean staleness (formula)", ylabel="simulated mean staleness",
         title="A7: staleness formula vs simulator")
  fig.savefig(pathlib.Path(out_dir) / "A7.png", dpi=90)
  return rows


def a8_queue_policy(out_dir: str, tiny: bool = False) -> list[dict]:
  """A8: queue capacity and drop policy; dropping by staleness shortens the trained lengths."""
  rows = []
  lengths = sim.Pareto(8.0, 1.3, max_len=400)
  for policy, cap in (("block", None), ("drop", None), ("queue-drop", 8), ("queue-drop", 16)):
    # queue-drop bounds staleness only through its capacity (no per-token lag filter)
    _, r = _sim("pipeline", max_lag=None if policy == "queue-drop" else 1, policy=policy,
                capacity=cap, lengths=lengths, steps=10 if tiny else 60)
    rows.append({"ablation": "A8", "policy": policy, "capacity_groups": cap,
                 "tokens_per_s": r.tokens_per_s, "samples_per_s": r.samples_per_s,
                 "trained_mean_length": r.tokens_per_s / max(r.samples_per_s, 1e-12),
                 "wasted_token_fraction": r.wasted_token_fraction,
                 "token_lag_mean": r.token_lag_mean, "sample_lag_mean": r.sample_lag_mean})
  fig = _figure()
  ax = fig.add_subplot(1, 1, 1)
  ax.bar(range(len(rows)), [r["trained_mean_length"] for r in rows])
  ax.set_xticks(range(len(rows)))
  ax.set_xticklabels([f"{r['policy']}\n{r['capacity_groups'] or ''}" for r in rows])
  ax.set(ylabel="mean trained completion length (tokens)", xlabel="queue policy, capacity",
         title="A8: trained lengths per queue policy (simulated)")
  fig.savefig(pathlib.Path(out_dir) / "A8.png", dpi=90)
  return rows


# ---- learning ablations: real reproducible runs --------------------------------------------


def _cells(base, out_dir: str, name: str, cells, seeds=(0,)) -> list[dict]:
  """Runs each (label, max_lag, RunConfig transform) cell once per seed; one row per cell with
  every metric the mean over seeds and `<metric>_ci` its 95% t half-width (`lib.seeds`)."""
  from lib import seeds as seeds_lib  # pylint: disable=g-import-not-at-top
  from lib import sweep  # pylint: disable=g-import-not-at-top
  cells_dir = str(pathlib.Path(out_dir) / "cells")
  runs = []
  for label, lag, transform in cells:
    cfg = transform(sweep.cell_config(base, lag, base.objective.name, cells_dir))
    runs.append((label, cfg, lambda d, lag=lag, obj=cfg.objective.name: sweep.summarize_cell(
        d, lag, obj)))
  rows = seeds_lib.run_seeds(runs, seeds, cells_dir)
  for row in rows:
    row["ablation"] = name
  return rows


def _objective(name: str, **kw):
  return lambda c: dataclasses.replace(c, objective=dataclasses.replace(c.objective, name=name,
                                                                        **kw))


def _bar_plot(rows, out_dir, name, metrics):
  from lib import claims  # pylint: disable=g-import-not-at-top
  claims.interval_bars(rows, out_dir, name, metrics)


def a2_max_lag(out_dir: str, tiny: bool = False, base=None,
               seeds=(0,)) -> list[dict]:
  """A2 (PipelineRL; AReaL Table 2 / Fig. 5c): throughput, ESS, ratio variance, reward vs lag."""
  lags = (0, None) if tiny else (0, 1, 2, 4, 8, 16, None)
  rows = _cells(base, out_dir, "A2", [(f"lag{'inf' if l is None else l}", l, lambda c: c)
                                      for l in lags], seeds)
  _bar_plot(rows, out_dir, "A2", ("samples_per_s", "ess_mean", "ratio_var_mean", "reward_last5"))
  return rows


def a3_correction_x_lag(out_dir: str, tiny: bool = False, base=None,
                        seeds=(0,)) -> list[dict]:
  """A3 (AReaL Table 2; Yao et al.): objective x lag, incl. lag-aware truncation."""
  objs = [("no_correction", {}), ("tis_pg", {})] if tiny else [
      ("no_correction", {}), ("untruncated_is", {}), ("tis_pg", {}), ("cispo", {}),
      ("decoupled_ppo", {}), ("tis_pg", {"lag_truncation": 0.7})]
  lags = (1,) if tiny else (1, 8)  # 12 cells: fits the 30-minute budget on 2 CPU cores
  cells = []
  for lag in lags:
    for name, kw in objs:
      tag = name + ("_lagtrunc" if kw else "")
      cells.append((f"{tag}_lag{lag}", lag, _objective(name, **kw)))
  rows = _cells(base, out_dir, "A3", cells, seeds)
  _bar_plot(rows, out_dir, "A3", ("heldout_end", "reward_last5", "ess_mean"))
  return rows


def a4_inflight_vs_async(out_dir: str, tiny: bool = False, base=None,
                         seeds=(0,)) -> list[dict]:
  """A4 (PipelineRL Fig. 5-6): in-flight updates vs conventional async at equal max lag."""
  lag = base.pipeline.staleness.max_lag
  driver = lambda d: (lambda c: dataclasses.replace(
      c, pipeline=dataclasses.replace(c.pipeline, driver=d)))
  rows = _cells(base, out_dir, "A4", [("async-batch", lag, driver("async-batch")),
                                      ("pipeline", lag, driver("pipeline"))], seeds)
  _bar_plot(rows, out_dir, "A4", ("samples_per_s", "ess_mean", "sample_lag_mean"))
  return rows


def a5_kv_keep_vs_recompute(out_dir: str, tiny: bool = False, base=None,
                            seeds=(0,)) -> list[dict]:
  """A5 (PipelineRL Fig. 7): stale KV kept vs recomputed after an in-flight update."""
  kv = lambda p: (lambda c: dataclasses.replace(
      c, sampler=dataclasses.replace(c.sampler, kv_policy=p)))
  lag = base.pipeline.staleness.max_lag
  rows = _cells(base, out_dir, "A5", [("keep", lag, kv("keep")), ("recompute", lag,
                                                                   kv("recompute"))], seeds)
  _bar_plot(rows, out_dir, "A5", ("kl_k3_mean", "ess_mean", "samples_per_s"))
  return rows


def a10_truncation_cap(out_dir: str, tiny: bool = False, base=None,
                       seeds=(0,)) -> list[dict]:
  """A10 (IMPALA rho-bar; Yao et al.): truncation cap c in {1, 2, 5, 10, inf} at a high lag."""
  caps = (1.0, None) if tiny else (1.0, 2.0, 5.0, 10.0, None)
  lag = 1 if tiny else 8
  cells = [(f"c{'inf' if c is None else int(c)}", lag,
            _objective("untruncated_is") if c is None else _objective("tis_pg", truncation=c))
           for c in caps]
  rows = _cells(base, out_dir, "A10", cells, seeds)
  _bar_plot(rows, out_dir, "A10", ("heldout_end", "reward_last5", "ess_mean"))
  return rows


def a9_precision_mismatch(out_dir: str, tiny: bool = False, base=None,
                          seeds=(0,)) -> list[dict]:
  """A9 (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"): bf16 sampler vs fp32 learner at zero staleness, with and without truncation.

  Every cell runs the `sync` driver with max_lag 0, so every token has lag 0 and the only
  difference between the behavior policy mu and the learner's pi is numeric: the sampler
  computes (and caches KV) in bfloat16, the learner in float32. Cells: fp32 sampler + TIS
  (reference), bf16 sampler + no correction, + untruncated IS, + TIS (truncated at the base
  run's cap). Reported: lag-0 |log pi - log mu| (`logp_mismatch_mean`), ESS, ratio variance,
  fraction truncated, reward and held-out accuracy.
  """
  def cell(dtype, objective):
    def transform(c):
      c = _objective(objective)(c)
      return dataclasses.replace(
          c, sampler_compute_dtype=dtype,
          sampler=dataclasses.replace(c.sampler, cache_dtype=dtype),
          pipeline=dataclasses.replace(c.pipeline, driver="sync"))
    return transform
  cells = [("fp32_tis", 0, cell("float32", "tis_pg")), ("bf16_tis", 0, cell("bfloat16", "tis_pg"))]
  if not tiny:
    cells[1:1] = [("bf16_nocorr", 0, cell("bfloat16", "no_correction")),
                  ("bf16_is", 0, cell("bfloat16", "untruncated_is"))]
  rows = _cells(base, out_dir, "A9", cells, seeds)
  _bar_plot(rows, out_dir, "A9", ("logp_mismatch_mean", "ess_mean", "frac_truncated_mean",
                                  "reward_last5", "heldout_end"))
  return rows


ABLATIONS: dict[str, Callable[..., list[dict]]] = {
    "A1": a1_long_tail, "A2": a2_max_lag, "A3": a3_correction_x_lag,
    "A4": a4_inflight_vs_async, "A5": a5_kv_keep_vs_recompute, "A6": a6_device_split,
    "A7": a7_staleness_formula, "A8": a8_queue_policy, "A9": a9_precision_mismatch,
    "A10": a10_truncation_cap,
    # issue 16's learning claims (a)-(d), meant for the stress regime (configs/stress.py)
    **{name: functools.partial(claims.run_claim, name) for name in claims.CLAIMS},
}
SIMULATED = ("A1", "A6", "A7", "A8")  # no RunConfig needed


def get_ablation(name: str) -> Callable[..., list[dict]]:
  """Looks up an ablation; raises ValueError listing the valid names."""
  if name not in ABLATIONS:
    raise ValueError(f"unknown ablation {name!r}; choose one of {sorted(ABLATIONS)}.")
  return ABLATIONS[name]
