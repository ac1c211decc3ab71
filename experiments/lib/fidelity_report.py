"""Claims (a)-(d) of issue 16 decided on gradient fidelity, and the instrument's figure.

A verdict compares two 95% intervals: "shown" when they separate in the claimed direction,
"contradicted" when they separate the other way, "not shown" when they overlap (then the
difference of the point values and the intervals are the measured bound on the effect).

  (a) TIS beats no correction at the largest lag: higher cosine with g*.
  (b1) untruncated IS's per-batch variance grows with lag: tr Cov at the largest lag > lag 0.
  (b2) TIS trades bias for variance: lower tr Cov than untruncated IS at the largest lag.
  (b3) ... and pays in bias: bias along g* more negative than untruncated IS's.
  (b4) CISPO (eps_max 5) likewise lowers untruncated IS's variance at the largest lag.
  (c) a bf16 sampler biases the lag-0 gradient: no-correction's cosine with g* (fp32 samples)
      lower with the bf16 sampler than with the fp32 one.
  (d) lag-aware truncation beats the fixed cap: higher cosine than TIS at the largest lag.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rlax_pipe.fidelity import Interval


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


def claims(table: dict) -> list[dict]:
  """One dict per claim: name, metric, the two intervals, their difference, verdict."""
  rows = table["rows"]
  lags = sorted({r["lag"] for r in rows if r["case"] == "lag"})
  top = lags[-1]
  specs = [  # (claim, metric, better (case, lag, obj), worse (case, lag, obj), sign)
      ("(a) TIS vs no correction, cosine", "cosine", ("lag", top, "tis"),
       ("lag", top, "no_correction"), 1),
      ("(b1) untruncated IS variance grows with lag", "trace_var",
       ("lag", top, "untruncated_is"), ("lag", lags[0], "untruncated_is"), 1),
      ("(b2) TIS variance below untruncated IS", "trace_var", ("lag", top, "untruncated_is"),
       ("lag", top, "tis"), 1),
      ("(b3) TIS bias along g* below untruncated IS's", "bias_parallel",
       ("lag", top, "untruncated_is"), ("lag", top, "tis"), 1),
      ("(b4) CISPO variance below untruncated IS", "trace_var", ("lag", top, "untruncated_is"),
       ("lag", top, "cispo"), 1),
      ("(c) bf16 sampler lowers lag-0 cosine", "cosine", ("lag", 0, "no_correction"),
       ("bf16", 0, "no_correction"), 1),
      ("(d) lag-aware TIS vs fixed TIS, cosine", "cosine", ("lag", top, "tis_lag_aware"),
       ("lag", top, "tis"), 1),
  ]
  out = []
  for name, metric, b, w, _ in specs:
    rb, rw = _find(rows, *b), _find(rows, *w)
    if rb is None or rw is None:
      continue
    ib, iw = Interval(*rb[metric]), Interval(*rw[metric])
    out.append(dict(claim=name, metric=metric, first=dict(zip(("case", "lag", "objective"), b)),
                    second=dict(zip(("case", "lag", "objective"), w)), first_interval=list(ib),
                    second_interval=list(iw), difference=ib.value - iw.value,
                    verdict=_verdict(ib, iw)))
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
  fig.suptitle("Gradient fidelity vs lag (95% intervals over batches and target versions)")
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
  lines += ["", "| claim | metric | first | second | verdict |", "| --- | --- | --- | --- | --- |"]
  for v in verdicts:
    lines.append(f"| {v['claim']} | {v['metric']} | {f(v['first_interval'])} | "
                 f"{f(v['second_interval'])} | {v['verdict']} |")
  return "\n".join(lines) + "\n"
