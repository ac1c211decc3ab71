"""Claims (a)-(d) of issue 16 decided on gradient fidelity, and the instrument's figure.

A verdict is "shown" when a 95% interval separates in the claimed direction, "contradicted"
when it separates the other way, "not shown" when it does not (then the interval is the
measured bound on the effect). Objectives compared at the same lag are evaluated on the very
same batches, so their comparison is *paired*: the t interval of the per-batch difference (the
batch noise common to both cancels). Comparisons across lags or sampler precisions use different
batches and compare the two rows' intervals. Paired claims also get a sign test (the fraction
of batches in the claimed direction, exact binomial interval; "shown" when it excludes 1/2),
because importance-weighted gradients are heavy-tailed and one batch can dominate a t interval. The claims (`_specs`): (a) TIS vs no correction,
(b) untruncated IS's variance with lag and TIS / CISPO's bias-variance trade, (c) the bf16
sampler at lag 0, (d) lag-aware vs fixed truncation; at the largest fixed lag, and for (a) and
(d) also in the in-flight mix.

Reference-free claims (`_free_specs`, marked "[rf]"; `rlax_pipe.fidelity.paired_stats`): no
on-policy g* enters, so the reference's own error (relative s.e. 2.2 at 512 samples in the
stress regime) does not bound them. Modes: "jackknife" (paired difference of two objectives'
jackknife pseudo-values of MSE / bias^2 against untruncated IS, same batches), "positive" (one
row's bias^2 interval above 0), "logratio" (paired per-batch log energy ratio of two objectives,
with the sign test), "logratio_lags" (that log ratio's interval at the largest lag against lag 1:
unpaired, different batches).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import stats as scipy_stats

from rlax_pipe.fidelity import Interval
from rlax_pipe.fidelity import log_energy_ratio
from rlax_pipe.fidelity import mean_interval


def _find(rows, case, lag, objective) -> dict | None:
  for r in rows:
    if r["case"] == case and r["lag"] == lag and r["objective"] == objective:
      return r
  return None


def _verdict(better: Interval, worse: Interval) -> str:
  if better.low > worse.high:
    return "shown"
  if better.high < worse.low:
    return "contradicted"
  return "not shown"


def _paired(first: dict, second: dict, metric: str) -> Interval | None:
  """t interval of the per-batch difference first - second (same batches, same order)."""
  a = np.asarray(first.get("per_batch", {}).get(metric, []), np.float64)
  b = np.asarray(second.get("per_batch", {}).get(metric, []), np.float64)
  if a.size < 2 or a.size != b.size:
    return None
  return mean_interval(a - b)


def _sign_test(first: dict, second: dict, metric: str, sign: int) -> Interval:
  """Fraction of batches where first's metric is beyond second's in the claimed direction, with
  its exact (Clopper-Pearson) 95% interval: a paired test robust to the heavy tails of
  importance-weighted gradients (one batch can dominate a mean; it counts once here)."""
  a = np.asarray(first["per_batch"][metric], np.float64)
  b = np.asarray(second["per_batch"][metric], np.float64)
  k = int(np.sum(sign * (a - b) > 0))
  ci = scipy_stats.binomtest(k, a.size).proportion_ci(0.95, method="exact")
  return Interval(k / a.size, float(ci.low), float(ci.high))


# (claim, metric, mode, first (case, lag, objective), second, direction): the claim is that
# first's metric exceeds second's (direction +1) or falls below it (-1). "paired": per-batch
# differences on the same batches (objectives compared on identical samples); "unpaired": the
# two rows' intervals (different batches: lags, sampler precision).
def _specs(top: int, mixed: Sequence[int], low: int | None = None) -> list[tuple]:
  s = [] if low is None or low == top else [
      ("(b1) importance-weight ESS falls with lag (largest lag vs lag 1)", "ess", "unpaired",
       ("lag", top, "untruncated_is"), ("lag", low, "untruncated_is"), -1),
      ("(b1) importance-ratio variance grows with lag (largest lag vs lag 1)", "ratio_var",
       "unpaired", ("lag", top, "untruncated_is"), ("lag", low, "untruncated_is"), 1)]
  s += [("(a) TIS closer to g* than no correction (cosine)", "cosine", "paired",
        ("lag", top, "tis"), ("lag", top, "no_correction"), 1),
       ("(a) TIS lower error than no correction (|g-g*|^2)", "sq_error", "paired",
        ("lag", top, "tis"), ("lag", top, "no_correction"), -1),
       ("(b1) untruncated IS variance grows with lag", "trace_var", "unpaired",
        ("lag", top, "untruncated_is"), ("lag", 0, "untruncated_is"), 1),
       ("(b2) TIS lower error than untruncated IS", "sq_error", "paired", ("lag", top, "tis"),
        ("lag", top, "untruncated_is"), -1),
       ("(b2) TIS lower variance than untruncated IS", "trace_var", "unpaired",
        ("lag", top, "tis"), ("lag", top, "untruncated_is"), -1),
       ("(b3) TIS shrinks the gradient along g* (bias)", "parallel", "paired",
        ("lag", top, "tis"), ("lag", top, "untruncated_is"), -1),
       ("(b4) CISPO lower error than untruncated IS", "sq_error", "paired",
        ("lag", top, "cispo"), ("lag", top, "untruncated_is"), -1),
       ("(c) bf16 sampler lowers the lag-0 cosine", "cosine", "unpaired",
        ("bf16", 0, "no_correction"), ("lag", 0, "no_correction"), -1),
       ("(c) bf16 sampler raises the lag-0 error", "sq_error", "unpaired",
        ("bf16", 0, "no_correction"), ("lag", 0, "no_correction"), 1),
       ("(d) lag-aware TIS closer to g* than fixed TIS (cosine)", "cosine", "paired",
        ("lag", top, "tis_lag_aware"), ("lag", top, "tis"), 1),
       ("(d) lag-aware TIS lower error than fixed TIS", "sq_error", "paired",
        ("lag", top, "tis_lag_aware"), ("lag", top, "tis"), -1)]
  for k in mixed:
    s += [(f"(a) in-flight mix K={k}: TIS lower error than no correction", "sq_error",
           "paired", ("mixed", k, "tis"), ("mixed", k, "no_correction"), -1),
          (f"(d) in-flight mix K={k}: lag-aware lower error than fixed TIS", "sq_error",
           "paired", ("mixed", k, "tis_lag_aware"), ("mixed", k, "tis"), -1)]
  return s


def _free_specs(top: int, low: int, mixed: Sequence[int]) -> list[tuple]:
  """Reference-free claims (module docstring); same tuple layout as `_specs`."""
  nc, tis, isw = ("lag", top, "no_correction"), ("lag", top, "tis"), ("lag", top, "untruncated_is")
  s = [("(a) [rf] TIS lower MSE than no correction", "mse", "jackknife", tis, nc, -1),
       ("(a) [rf] TIS lower per-batch energy than no correction", "energy", "logratio", tis,
        nc, -1),
       ("(a) [rf] no correction is biased against IS", "bias2", "positive", nc, None, 1),
       ("(b1) [rf] untruncated IS inflates the per-batch energy over no correction", "energy",
        "logratio", isw, nc, 1),
       ("(b1) [rf] that inflation grows with lag (largest lag vs lag 1)", "energy",
        "logratio_lags", (top, "untruncated_is", "no_correction"),
        (low, "untruncated_is", "no_correction"), 1),
       ("(b2) [rf] TIS lower MSE than untruncated IS", "mse", "jackknife", tis, isw, -1),
       ("(b2) [rf] TIS lower per-batch energy than untruncated IS", "energy", "logratio", tis,
        isw, -1),
       ("(b3) [rf] TIS is biased against untruncated IS (the price)", "bias2", "positive", tis,
        None, 1),
       ("(b4) [rf] CISPO lower MSE than untruncated IS", "mse", "jackknife",
        ("lag", top, "cispo"), isw, -1),
       ("(c) [rf] bf16 sampler at lag 0: no correction biased against IS", "bias2", "positive",
        ("bf16", 0, "no_correction"), None, 1),
       ("(d) [rf] lag-aware TIS lower MSE than fixed TIS", "mse", "jackknife",
        ("lag", top, "tis_lag_aware"), tis, -1)]
  for k in mixed:
    s += [(f"(a) [rf] in-flight mix K={k}: TIS lower MSE than no correction", "mse",
           "jackknife", ("mixed", k, "tis"), ("mixed", k, "no_correction"), -1),
          (f"(d) [rf] in-flight mix K={k}: lag-aware lower MSE than fixed TIS", "mse",
           "jackknife", ("mixed", k, "tis_lag_aware"), ("mixed", k, "tis"), -1)]
  return s


def _log_ratio(ra: dict, rb: dict) -> np.ndarray:
  return log_energy_ratio(ra["per_batch"]["energy"], rb["per_batch"]["energy"])


def _free_claim(rows, name, metric, mode, a, b, sign) -> dict | None:
  """One reference-free claim (`_free_specs`), or None when its rows were not measured."""
  item = dict(claim=name, metric=metric, mode=mode, direction=sign)
  zero = Interval(0.0, 0.0, 0.0)
  signed = lambda d: Interval(sign * d.value, *sorted((sign * d.low, sign * d.high)))
  if mode == "logratio_lags":
    ra = [_find(rows, "lag", a[0], o) for o in a[1:]]
    rb = [_find(rows, "lag", b[0], o) for o in b[1:]]
    if None in ra + rb or "energy" not in ra[0].get("per_batch", {}):
      return None
    la, lb = _log_ratio(*ra), _log_ratio(*rb)
    if la.size < 2 or lb.size < 2:
      return None
    ia, ib = mean_interval(la), mean_interval(lb)
    item.update(first=dict(lag=a[0], ratio=f"{a[1]}/{a[2]}"), second=dict(
        lag=b[0], ratio=f"{b[1]}/{b[2]}"), first_interval=list(ia), second_interval=list(ib),
        difference=ia.value - ib.value,
        verdict=_verdict(ia, ib) if sign > 0 else _verdict(ib, ia))
    return item
  ra = _find(rows, *a)
  rb = None if b is None else _find(rows, *b)
  if ra is None or (b is not None and rb is None) or metric not in ra.get("per_batch", {}):
    return None
  item.update(first=dict(zip(("case", "lag", "objective"), a)),
              second=None if b is None else dict(zip(("case", "lag", "objective"), b)))
  if mode == "positive":
    d = mean_interval(np.asarray(ra["per_batch"][metric], np.float64))
    item.update(difference=list(d), verdict=_verdict(signed(d), zero))
  elif mode == "jackknife":
    d = _paired(ra, rb, metric)
    if d is None:
      return None
    item.update(difference=list(d), verdict=_verdict(signed(d), zero))
  else:  # logratio: per batch, with the sign test
    x = _log_ratio(ra, rb)
    if x.size < 2:
      return None
    d = mean_interval(x)
    k = int(np.sum(sign * x > 0))
    ci = scipy_stats.binomtest(k, x.size).proportion_ci(0.95, method="exact")
    wins = Interval(k / x.size, float(ci.low), float(ci.high))
    item.update(difference=list(d), verdict=_verdict(signed(d), zero), wins=list(wins),
                sign_verdict=_verdict(wins, Interval(0.5, 0.5, 0.5)))
  return item


def merge(tables: Sequence[dict]) -> dict:
  """One table from several instrument runs (e.g. lags measured in parallel processes): the
  first table's fields, every table's rows and truths; `sources` keeps each one's config.

  Raises:
    ValueError: when two tables hold the same (case, lag, objective) row.
  """
  if len(tables) == 1:
    return tables[0]
  out = dict(tables[0])
  out["rows"], out["truth"], seen = [], [], set()
  for t in tables:
    for r in t["rows"]:
      key = (r["case"], r["lag"], r["objective"])
      if key in seen:
        raise ValueError(f"merge: the row {key} is in two tables; measure each case once.")
      seen.add(key)
      out["rows"].append(r)
    out["truth"] += t.get("truth", [])
  out["sources"] = [dict(config=t.get("config"), truth=t.get("truth")) for t in tables]
  return out


def claims(table: dict) -> list[dict]:
  """One dict per claim: name, metric, mode, the intervals, the difference, the verdict."""
  rows = table["rows"]
  lags = sorted({r["lag"] for r in rows if r["case"] == "lag"})
  mixed = sorted({r["lag"] for r in rows if r["case"] == "mixed"})
  out = []
  low = min([k for k in lags if k > 0], default=lags[-1])
  for spec in _free_specs(lags[-1], low, mixed):
    item = _free_claim(rows, *spec)
    if item is not None:
      out.append(item)
  for name, metric, mode, a, b, sign in _specs(lags[-1], mixed, low):
    ra, rb = _find(rows, *a), _find(rows, *b)
    if ra is None or rb is None:
      continue
    item = dict(claim=name, metric=metric, mode=mode,
                first=dict(zip(("case", "lag", "objective"), a)),
                second=dict(zip(("case", "lag", "objective"), b)), direction=sign)
    if mode == "paired":
      d = _paired(ra, rb, metric)
      if d is None:
        continue
      item.update(difference=list(d), verdict=_verdict(
          Interval(sign * d.value, *sorted((sign * d.low, sign * d.high))),
          Interval(0.0, 0.0, 0.0)))
      wins = _sign_test(ra, rb, metric, sign)
      item.update(wins=list(wins), sign_verdict=_verdict(wins, Interval(0.5, 0.5, 0.5)))
    else:
      if metric not in ra or metric not in rb:
        continue
      ia, ib = Interval(*ra[metric]), Interval(*rb[metric])
      item.update(first_interval=list(ia), second_interval=list(ib),
                  difference=ia.value - ib.value,
                  verdict=_verdict(ia, ib) if sign > 0 else _verdict(ib, ia))
    out.append(item)
  return out


def plot(table: dict, path: str) -> None:
  """cosine, bias along g* and tr Cov / |g*|^2 against lag, one line per objective (PNG)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = table["rows"]
  objectives = list(dict.fromkeys(r["objective"] for r in rows))
  metrics = (("cosine", "cos(g_i, g*)", False), ("bias_parallel", "bias along g* / |g*|", False),
             ("trace_var", "tr Cov(g_i) / |g*|^2", True), ("frac_truncated", "truncated", False))
  if all("mse" in r for r in rows):  # reference-free panels (unit: on-policy batch energy)
    metrics += (("energy", "|g_i|^2 / E|g_on|^2", True),
                ("mse", "MSE vs IS anchor / E|g_on|^2 [rf]", True))
  fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4))
  for ax, (m, label, log) in zip(axes, metrics):
    for o, name in enumerate(objectives):
      for case, style in (("lag", "-o"), ("mixed", "--s")):
        pts = sorted((r["lag"], r[m]) for r in rows if r["case"] == case
                     and r["objective"] == name)
        if not pts:
          continue
        x = np.array([max(p[0], 0.5) for p in pts])  # lag 0 drawn at 0.5 on the log axis
        y = np.array([p[1] for p in pts], np.float64)
        if log:  # an interval reaching <= 0 is drawn down to value / 10 on a log axis
          y[:, 1] = np.where(y[:, 1] > 0, y[:, 1], np.where(y[:, 0] > 0, y[:, 0] / 10, y[:, 0]))
        ax.errorbar(x * (1 + 0.03 * o), y[:, 0], yerr=[y[:, 0] - y[:, 1], y[:, 2] - y[:, 0]],
                    fmt=style, color=f"C{o}", capsize=2, ms=3,
                    label=name if case == "lag" else f"{name} (in-flight mix)")
    bf = [r for r in rows if r["case"] == "bf16"]
    for r in bf:
      o = objectives.index(r["objective"])
      ax.plot([0.4], [r[m][0]], marker="x", color=f"C{o}")
    ax.set_xscale("log")
    if log:
      ax.set_yscale("log")
    ax.set_xlabel("lag (steps; lag 0 at 0.5, x = bf16 sampler at lag 0)")
    ax.set_ylabel(label)
  axes[0].legend(fontsize=6)
  fig.suptitle("Gradient fidelity vs lag (95% intervals over batches and target versions; on log "
               "axes an interval reaching <= 0 is drawn down to value / 10)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def markdown(table: dict, verdicts: Sequence[dict]) -> str:
  """The table and verdicts as markdown (for the notebook)."""
  f = lambda iv: f"{iv[0]:.3g} [{iv[1]:.3g}, {iv[2]:.3g}]"
  lines = ["| case | lag | objective | cosine | bias along g* | tr Cov/|g*|^2 | ESS | truncated |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in table["rows"]:
    lines.append(f"| {r['case']} | {r['lag']} | {r['objective']} | {f(r['cosine'])} | "
                 f"{f(r['bias_parallel'])} | {f(r['trace_var'])} | {f(r['ess'])} | "
                 f"{f(r['frac_truncated'])} |")
  free = [r for r in table["rows"] if "mse" in r]
  if free:
    lines += ["", "Reference-free (unit: the on-policy per-batch energy E|g_on|^2 at the target; "
              "bias^2 against untruncated IS; jackknife 95% intervals):", "",
              "| case | lag | objective | energy |g_i|^2 | bias^2 | variance tr Cov | MSE |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in free:
      lines.append(f"| {r['case']} | {r['lag']} | {r['objective']} | {f(r['energy'])} | "
                   f"{f(r['bias2'])} | {f(r['var'])} | {f(r['mse'])} |")
  lines += ["", "| claim | metric | mode | first | second | first - second | verdict | "
            "batches in the claimed direction (sign test) | sign verdict |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for v in verdicts:
    if v["mode"] in ("paired", "jackknife", "logratio", "positive"):
      a = b = "same batches" if v["mode"] != "positive" else "-"
      diff = f(v["difference"])
      wins, sv = (f(v["wins"]), v["sign_verdict"]) if "wins" in v else ("", "")
    else:
      a, b, diff = f(v["first_interval"]), f(v["second_interval"]), f"{v['difference']:.3g}"
      wins, sv = "", ""
    lines.append(f"| {v['claim']} | {v['metric']} | {v['mode']} | {a} | {b} | {diff} | "
                 f"{v['verdict']} | {wins} | {sv} |")
  return "\n".join(lines) + "\n"
