"""The learning claims of issue 16, as ablations A11-A14 with seeds, intervals and verdicts.

Each claim is a list of cells (label, RunConfig transform of the base run) plus the comparisons
that decide it. Every cell runs once per seed (`seeds.run_seeds`), each metric is reported as a
mean with a 95% t-interval over seeds, and each comparison gets a verdict against its source:
"shown" (intervals separate in the claimed direction), "contradicted" (they separate the other
way) or "not shown" (they overlap). Run them in the stress regime
(`--config=experiments/configs/stress.py`), where the policy moves enough per step that
staleness matters.

  A11 (a) no correction vs TIS across max_lag {0, 4, 16, 64} (AReaL Table 2; PipelineRL Fig. 10)
  A12 (b) untruncated IS vs TIS vs CISPO vs decoupled PPO at the largest lag, with 1 and with 2
      minibatch updates per batch (Yao et al. 2025; ScaleRL Fig. 5a; AReaL Sec. 5.2)
  A13 (c) bf16 sampler vs fp32 learner, with and without TIS, at lag 0 on the regime's full
      completion budget (Yao et al. 2025)
  A14 (d) lag-aware truncation c * 0.7^lag vs the fixed cap c at the largest lag, with 1 and with
      2 minibatch updates per batch (IMPALA rho-bar; M2PO: bounding stale ratios' second moment
      keeps training stable)
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Callable, Sequence

import numpy as np

from lib import seeds as seeds_lib
from lib import sweep

# (claim, better label, worse label, source's statement)
Comparison = tuple[str, str, str, str]


def _obj(name: str, **kw) -> Callable:
  return lambda c: dataclasses.replace(c, objective=dataclasses.replace(c.objective, name=name,
                                                                        **kw))


def _lag(lag):
  return lambda c: dataclasses.replace(c, pipeline=dataclasses.replace(
      c.pipeline, staleness=dataclasses.replace(c.pipeline.staleness, max_lag=lag)))


def _chain(*fs) -> Callable:
  def apply(c):
    for f in fs:
      c = f(c)
    return c
  return apply


def _minibatches(m: int) -> Callable:
  return lambda c: dataclasses.replace(c, learner=dataclasses.replace(c.learner,
                                                                      num_minibatches=m))


def _precision(dtype: str) -> Callable:
  return lambda c: dataclasses.replace(
      c, sampler_compute_dtype=dtype, sampler=dataclasses.replace(c.sampler, cache_dtype=dtype),
      pipeline=dataclasses.replace(c.pipeline, driver="sync"))


def largest_lag(base) -> int:
  """The base run's max_lag (64 if unbounded, the issue's largest lag)."""
  lag = base.pipeline.staleness.max_lag
  return 64 if lag is None else lag


def claim_cells(name: str, base, tiny: bool) -> tuple[list, list[Comparison]]:
  """(cells [(label, max_lag, transform)], comparisons) of claim `name` (A11..A14); `tiny`
  keeps two cells per claim (seconds each; A14's fixed cap is A11's TIS cell, run once).

  Raises:
    ValueError: an unknown name (the message lists the claims).
  """
  if name not in CLAIMS:
    raise ValueError(f"unknown claim ablation {name!r}; choose one of {CLAIMS}.")
  top = largest_lag(base)
  if name == "A11":
    lags = (top,) if tiny else (0, 4, 16, top)
    cells = [(f"{o}_lag{l}", l, _chain(_lag(l), _obj(o)))
             for l in lags for o in ("no_correction", "tis_pg")]
    comps = [("a", f"tis_pg_lag{l}", f"no_correction_lag{l}",
              "AReaL Table 2 / PipelineRL: without correction training degrades as lag grows "
              "while truncated IS holds") for l in lags if l > 0]
    if not tiny:
      comps.append(("a", "tis_pg_lag0", f"tis_pg_lag{top}",
                    "too large a max lag eventually hurts even with correction (AReaL eta=inf)"))
    return cells, comps
  if name == "A12":
    objs = [("untruncated_is", {}), ("tis_pg", {})] if tiny else [
        ("untruncated_is", {}), ("tis_pg", {}), ("cispo", {"truncation": 5.0}),
        ("decoupled_ppo", {})]
    cells, comps = [], []
    # One update per batch (the claim as stated; its TIS cell is A11's at the largest lag), and
    # 2 minibatch updates per batch (later minibatches are off-policy w.r.t. the learner too).
    for mb in ((2,) if tiny else (1, 2)):
      tag = "" if mb == 1 else f"_mb{mb}"
      cells += [(f"{o}{tag}_lag{top}", top, _chain(_lag(top), _obj(o, **kw), _minibatches(mb)))
                for o, kw in objs]
      worse = f"untruncated_is{tag}_lag{top}"
      comps.append(("b", f"tis_pg{tag}_lag{top}", worse,
                    "Yao et al. 2025: untruncated importance weights destabilise training; TIS "
                    "holds"))
      if not tiny:
        comps += [("b", f"cispo{tag}_lag{top}", worse,
                   "ScaleRL Fig. 5a: CISPO (eps_max 5) trains stably"),
                  ("b", f"decoupled_ppo{tag}_lag{top}", worse,
                   "AReaL Sec. 5.2: the decoupled objective holds at large staleness")]
    return cells, comps
  if name == "A13":
    cells = [("fp32_nocorr", 0, _chain(_lag(0), _obj("no_correction"), _precision("float32"))),
             ("bf16_nocorr", 0, _chain(_lag(0), _obj("no_correction"), _precision("bfloat16"))),
             ("bf16_tis", 0, _chain(_lag(0), _obj("tis_pg"), _precision("bfloat16")))]
    comps = [("c", "bf16_tis", "bf16_nocorr",
              "Yao et al. 2025: a bf16 sampler feeding an fp32 learner needs correction (TIS)"),
             ("c", "fp32_nocorr", "bf16_nocorr",
              "Yao et al. 2025: the precision mismatch alone degrades uncorrected training")]
    return (cells[1:], comps[:1]) if tiny else (cells, comps)
  if name == "A14":
    src = ("IMPALA / M2PO: tighter control of stale tokens' ratios stabilises training at "
           "large staleness")
    cells, comps = [], []
    # With one update per batch fixed-cap TIS is already stable (A11); with 2 minibatch updates
    # it is not (A12), which is where a tighter control of stale ratios has something to fix.
    for mb in ((1,) if tiny else (1, 2)):
      tag = "" if mb == 1 else f"_mb{mb}"
      fixed, aware = f"tis_fixed{tag}_lag{top}", f"tis_lagaware{tag}_lag{top}"
      cells += [(fixed, top, _chain(_lag(top), _obj("tis_pg"), _minibatches(mb))),
                (aware, top, _chain(_lag(top), _obj("tis_pg", lag_truncation=0.7),
                                    _minibatches(mb)))]
      comps.append(("d", aware, fixed, src))
    return cells, comps
  raise AssertionError(name)


def run_claim(name: str, out_dir: str, tiny: bool = False, base=None,
              seeds: Sequence[int] = (0,), only: Sequence[str] = ()) -> list[dict]:
  """Runs claim `name`'s cells over `seeds`; writes <out_dir>/<name>.png; returns the reduced
  rows (mean and `_ci` per metric) followed by one verdict row per comparison.

  `only`: labels of the cells to run (default all), e.g. more seeds for one comparison; the
  comparisons whose two cells are both run get verdicts, the figure is named
  <name>_<n>cells_<k>seeds.png.

  Raises:
    ValueError: no base config, or a label of `only` that the claim does not have.
  """
  if base is None:
    raise ValueError(f"{name} is a learning ablation: it needs the base run config (base=).")
  cells, comps = claim_cells(name, base, tiny)
  if only:
    unknown = sorted(set(only) - {label for label, _, _ in cells})
    if unknown:
      raise ValueError(f"{name} has no cell(s) {unknown}; its cells: "
                       f"{[label for label, _, _ in cells]}.")
    cells = [c for c in cells if c[0] in only]
    comps = [c for c in comps if c[1] in only and c[2] in only]
  cells_dir = str(pathlib.Path(out_dir) / "cells")
  runs = []
  for label, lag, transform in cells:
    cfg = transform(sweep.cell_config(base, lag, base.objective.name, cells_dir))
    summarize = (lambda d, lag=lag, obj=cfg.objective.name: sweep.summarize_cell(d, lag, obj))
    runs.append((label, cfg, summarize))
  rows = seeds_lib.run_seeds(runs, seeds, cells_dir)
  for r in rows:
    r["ablation"] = name
  by_label = {r["label"]: r for r in rows}
  verdicts = []
  for claim, better, worse, source in comps:
    v, reason = seeds_lib.verdict(by_label[better], by_label[worse])
    verdicts.append({"ablation": name, "claim": claim, "verdict": v, "comparison":
                     f"{better} > {worse}", "source": source, "reason": reason,
                     "paired_verdict": seeds_lib.paired_verdict(by_label[better],
                                                                by_label[worse])})
  fig_name = f"{name}_{len(cells)}cells_{len(seeds)}seeds" if only else name
  interval_bars(rows, out_dir, fig_name, ("heldout_end", "ess_mean", "ratio_var_mean",
                                          "kl_k3_mean"))
  if name == "A11" and not only:  # the lag x objective grid: its throughput / accuracy trade-off
    sweep.plot_pareto(rows, out_dir, f"{name}_pareto.png",
                      f"{name}: throughput vs final accuracy per max_lag x objective")
  return rows + verdicts


def interval_bars(rows: Sequence[dict], out_dir: str, name: str, metrics: Sequence[str]) -> str:
  """One panel per metric: the mean over seeds of each cell as a bar with its 95% t-interval
  as an error bar (none drawn for one seed) and each seed's value as a dot; returns the
  figure's path."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(4.5 * len(metrics), 4))
  FigureCanvasAgg(fig)
  nseeds = max(r.get("seeds", 1) for r in rows)
  for i, m in enumerate(metrics):
    ax = fig.add_subplot(1, len(metrics), i + 1)
    ys = [_num(r.get(m)) for r in rows]
    err = [_num(r.get(m + "_ci"), 0.0) for r in rows]
    ax.bar(range(len(rows)), ys, yerr=err, capsize=3, color="tab:blue", alpha=0.8)
    for j, r in enumerate(rows):  # each seed's value
      seed_values = [_num(s.get(m)) for s in r.get("per_seed", [])]
      ax.plot([j] * len(seed_values), seed_values, "k.", ms=4)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["label"] for r in rows], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel(m, fontsize=8)
    ax.set_title(f"{name}: {m} (mean, 95% CI, {nseeds} seeds)", fontsize=9)
  fig.tight_layout()
  path = pathlib.Path(out_dir) / f"{name}.png"
  fig.savefig(path, dpi=90)
  return str(path)


TABLE_METRICS = ("heldout_end", "reward_last5", "ess_mean", "ratio_var_mean", "kl_k3_mean",
                 "frac_truncated_mean", "token_lag_mean", "sample_lag_mean", "token_lag_max",
                 "samples_per_device_s")


def markdown(rows: Sequence[dict], metrics: Sequence[str] = TABLE_METRICS) -> str:
  """The rows of an ablation as a Markdown table (each metric "mean +- 95% half-width" over the
  seeds) followed by its verdict rows, for the lab notebook."""
  cells = [r for r in rows if "verdict" not in r]
  lines = ["| cell | seeds | " + " | ".join(metrics) + " |",
           "| --- | --- | " + " | ".join("---" for _ in metrics) + " |"]
  for r in cells:
    vals = []
    for m in metrics:
      v, h = r.get(m), r.get(m + "_ci")
      vals.append("-" if v is None else f"{v:.4g}" + (
          "" if h is None or math.isnan(h) else f" +- {h:.2g}"))
    lines.append(f"| {r['label']} | {r['seeds']} | " + " | ".join(vals) + " |")
  for v in (r for r in rows if "verdict" in r):
    lines.append(f"\n- claim ({v['claim']}) {v['comparison']}: **{v['verdict']}** (paired "
                 f"design: {v.get('paired_verdict', '-')}). {v['reason']}. Source: {v['source']}.")
  return "\n".join(lines) + "\n"


def _num(v, default=np.nan) -> float:
  return default if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


CLAIMS = ("A11", "A12", "A13", "A14")
