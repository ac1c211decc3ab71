"""Fits the cost model to operations timed on the machine, with confidence intervals.

A calibration run (threaded mode, sampler and learner on their own device sets, warmed) records
one `CostRecord` per operation: a sampler-loop iteration with its engine counters (`EngineStep`
features), a learner train step with its processed tokens and micro-batches, a weight push with
its bytes, and the learner's host work per step. `fit_cost_model` fits each operation by
ordinary least squares (one regression per operation, features as in `costs.model`) and returns
the `CostModel` with, per coefficient, its standard error and a 95% confidence interval:

  beta = (X^T X)^-1 X^T y,  s^2 = RSS / (n - p),  se_j = sqrt(s^2 [(X^T X)^-1]_jj),
  CI_j = beta_j +- t_{0.975, n-p} se_j        (e.g. Seber & Lee, "Linear Regression Analysis",
                                               2003, Sec. 5.1).

Records flagged with a positive `compiles` count (XLA compiled something while the operation
ran, on any thread) are left out and counted (`OpFit.excluded`): compile time is reported apart,
never fitted into an operation's cost. Identifiability is reported, not hidden: a feature never
seen (all zero) or equal to a combination of earlier ones (e.g. dispatches == decode steps when
every dispatch runs one step) gets coefficient 0 with status "not observed" / "aliased with ..."
(its time is carried by the earlier ones, which is exact for predictions at the same K); a
coefficient estimated below 0 is removed (status "dropped: negative") and the regression
refitted, so durations stay >= 0.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import pathlib
import threading
from typing import Any, Iterable, Sequence

import numpy as np
from scipy import stats

from rlax_pipe.costs.model import CostModel

# Regressions: op -> (intercept coefficient, ((feature, coefficient), ...)). Column order is the
# priority order for aliasing (an earlier column keeps the time).
REGRESSIONS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "engine_step": ("engine_step_s", (
        ("dispatches", "dispatch_s"), ("decode_steps", "decode_step_s"),
        ("slot_steps", "slot_step_s"), ("live_token_steps", "token_step_s"),
        ("prefill_calls", "prefill_call_s"), ("prefill_tokens", "prefill_token_s"),
        ("installs", "install_s"))),
    "train_step": ("train_step_s", (("tokens", "train_token_s"),
                                    ("micro_batches", "micro_batch_s"))),
    "push": ("push_s", (("bytes", "push_byte_s"),)),
    "learner_host": ("learner_host_s", ()),
}
CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class CostRecord:
  """One timed operation.

  Attributes:
    op: a key of `REGRESSIONS`.
    duration_s: measured wall-clock seconds.
    features: the operation's counts (names as in `REGRESSIONS`; missing ones are 0;
      "compiles" > 0 marks an operation that overlapped an XLA compile).
    start_s: start on the recorder's clock (seconds), or None.
  """

  op: str
  duration_s: float
  features: dict[str, int] = dataclasses.field(default_factory=dict)
  start_s: float | None = None

  def __post_init__(self):
    if self.op not in REGRESSIONS:
      raise ValueError(f"CostRecord.op={self.op!r}; choose one of {sorted(REGRESSIONS)}.")
    if not (math.isfinite(self.duration_s) and self.duration_s >= 0):
      raise ValueError(f"CostRecord.duration_s={self.duration_s} must be finite and >= 0.")

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready flat dict (features at the top level)."""
    return {"op": self.op, "duration_s": self.duration_s, "start_s": self.start_s,
            **self.features}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> CostRecord:
    """Inverse of `to_dict`."""
    d = dict(d)
    op, duration, start = d.pop("op"), float(d.pop("duration_s")), d.pop("start_s", None)
    return cls(op, duration, {k: int(v) for k, v in d.items()}, start)


class CostRecorder:
  """Thread-safe list of `CostRecord`s (the sampler and learner threads both record) and of the
  compile intervals seen meanwhile; `records()` flags every record that overlaps one.

  Example:
    rec = CostRecorder()
    rec.record("push", 0.004, start_s=t0, bytes=1_000_000)
    rec.add_compile(t_end - 2.5, t_end)          # e.g. from a jax.monitoring listener
    fit = fit_cost_model(rec.records(), source="measured: my run")
  """

  def __init__(self):
    self._records: list[CostRecord] = []
    self._compiles: list[tuple[float, float]] = []
    self._lock = threading.Lock()

  def record(self, op: str, duration_s: float, start_s: float | None = None,
             **features: int) -> None:
    """Adds one timed operation (started at `start_s` on the clock of `add_compile`)."""
    r = CostRecord(op, float(duration_s), {k: int(v) for k, v in features.items()}, start_s)
    with self._lock:
      self._records.append(r)

  def add_compile(self, start_s: float, end_s: float) -> None:
    """Notes that XLA compiled from `start_s` to `end_s` (seconds, the records' clock)."""
    with self._lock:
      self._compiles.append((float(start_s), float(end_s)))

  def unflagged(self) -> tuple[list[CostRecord], list[tuple[float, float]]]:
    """(the records as recorded, the compile intervals): what another process's recorder needs
    to flag them against every compile of a job (`extend`)."""
    with self._lock:
      return list(self._records), list(self._compiles)

  def extend(self, records: Iterable[CostRecord],
             compiles: Iterable[tuple[float, float]] = ()) -> None:
    """Adds records and compile intervals timed elsewhere (on this recorder's clock)."""
    records = list(records)
    compiles = [(float(a), float(b)) for a, b in compiles]
    with self._lock:
      self._records += records
      self._compiles += compiles

  def records(self) -> list[CostRecord]:
    """The records so far; "compiles" counts the compile intervals each one overlaps."""
    with self._lock:
      records, compiles = list(self._records), sorted(self._compiles)
    if not compiles:
      return records
    starts = [a for a, _ in compiles]
    longest = max(b - a for a, b in compiles)
    out = []
    for r in records:
      if r.start_s is None:
        out.append(r)
        continue
      lo, hi = r.start_s, r.start_s + r.duration_s
      # intervals starting before hi and after lo - longest may overlap [lo, hi]
      i = bisect.bisect_left(starts, lo - longest)
      j = bisect.bisect_right(starts, hi)
      n = sum(1 for a, b in compiles[i:j] if b > lo and a < hi)
      if n:
        r = dataclasses.replace(r, features={**r.features,
                                             "compiles": r.features.get("compiles", 0) + n})
      out.append(r)
    return out

  def to_jsonl(self, path: str | pathlib.Path) -> None:
    """Writes one JSON object per record."""
    with open(path, "w") as f:
      for r in self.records():
        f.write(json.dumps(r.to_dict()) + "\n")


def read_records(path: str | pathlib.Path) -> list[CostRecord]:
  """Records written by `CostRecorder.to_jsonl`."""
  with open(path) as f:
    return [CostRecord.from_dict(json.loads(line)) for line in f if line.strip()]


@dataclasses.dataclass(frozen=True)
class Coefficient:
  """One fitted coefficient (seconds per unit of its feature).

  Attributes:
    estimate: least-squares value (0 unless status is "fitted").
    std_err: standard error (None unless fitted with n > p).
    ci95: (low, high) 95% confidence interval (None like std_err).
    status: "fitted", "not observed", "aliased with <names>", "dropped: negative (t=...)".
  """

  estimate: float
  std_err: float | None
  ci95: tuple[float, float] | None
  status: str


@dataclasses.dataclass(frozen=True)
class OpFit:
  """Goodness of one operation's regression.

  Attributes:
    n: records used.
    mean_s: mean duration.
    rel_rmse: root-mean-square residual / mean duration.
    r2: coefficient of determination (None when the durations do not vary).
    excluded: records left out because something compiled during them.
  """

  n: int
  mean_s: float
  rel_rmse: float
  r2: float | None
  excluded: int = 0


@dataclasses.dataclass(frozen=True)
class CostFit:
  """A fitted cost model and how well each part is determined."""

  cost_model: CostModel
  coefficients: dict[str, Coefficient]
  ops: dict[str, OpFit]

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready dict; `load_cost_model` reads its "cost_model" entry."""
    return {"cost_model": self.cost_model.to_dict(),
            "coefficients": {k: dataclasses.asdict(c) for k, c in self.coefficients.items()},
            "ops": {k: dataclasses.asdict(o) for k, o in self.ops.items()},
            "confidence": CONFIDENCE}

  def save(self, path: str | pathlib.Path) -> None:
    """Writes `to_dict` as JSON (stored with the calibration run)."""
    pathlib.Path(path).write_text(json.dumps(self.to_dict(), indent=2))


def _independent(columns: list[np.ndarray], candidate: np.ndarray) -> bool:
  """Whether `candidate` is not (numerically) in the span of `columns`."""
  if not columns:
    return bool(np.any(candidate))
  a = np.stack(columns, 1)
  coef, *_ = np.linalg.lstsq(a, candidate, rcond=None)
  resid = candidate - a @ coef
  return float(np.linalg.norm(resid)) > 1e-9 * max(float(np.linalg.norm(candidate)), 1.0)


def fit_ols(x_cols: dict[str, np.ndarray], y: np.ndarray
            ) -> tuple[dict[str, Coefficient], OpFit]:
  """OLS with standard errors, aliasing and non-negativity (module docstring).

  Args:
    x_cols: coefficient name -> float[n] column, in priority order (the intercept is a column
      of ones given like any other).
    y: float[n] durations, seconds.

  Returns:
    (coefficient name -> Coefficient, OpFit).

  Raises:
    ValueError: with no record, or columns of another length than y.
  """
  y = np.asarray(y, np.float64)
  n = y.shape[0]
  if n == 0 or any(c.shape != (n,) for c in x_cols.values()):
    raise ValueError(f"fit_ols: need n >= 1 records and columns of length n; got n={n}.")
  out: dict[str, Coefficient] = {}
  kept: dict[str, np.ndarray] = {}
  for name, col in x_cols.items():
    col = np.asarray(col, np.float64)
    if not np.any(col):
      out[name] = Coefficient(0.0, None, None, "not observed")
    elif _independent(list(kept.values()), col):
      kept[name] = col
    else:
      out[name] = Coefficient(0.0, None, None, f"aliased with {'+'.join(kept)}")
  while True:
    names = list(kept)
    if not names:
      beta, cov = np.zeros(0), np.zeros((0, 0))
      resid = y
      break
    x = np.stack([kept[k] for k in names], 1)
    scale = np.abs(x).max(0)
    xs = x / scale
    xtx_inv = np.linalg.pinv(xs.T @ xs)
    beta = (xtx_inv @ xs.T @ y) / scale
    resid = y - x @ beta
    df = n - len(names)
    s2 = float(resid @ resid) / df if df > 0 else float("nan")
    cov = s2 * xtx_inv / np.outer(scale, scale)
    neg = [i for i, b in enumerate(beta) if b < 0]
    if not neg:
      break
    se = np.sqrt(np.maximum(np.diag(cov), 0))
    worst = min(neg, key=lambda i: beta[i] / se[i] if se[i] > 0 else -math.inf)
    t_val = beta[worst] / se[worst] if se[worst] > 0 else float("-inf")
    out[names[worst]] = Coefficient(0.0, None, None, f"dropped: negative (t={t_val:.2f})")
    del kept[names[worst]]
  df = n - len(kept)
  tq = float(stats.t.ppf(0.5 + CONFIDENCE / 2, df)) if df > 0 else None
  for i, name in enumerate(kept):
    se = math.sqrt(max(float(cov[i, i]), 0.0)) if df > 0 else None
    ci = (float(beta[i] - tq * se), float(beta[i] + tq * se)) if se is not None else None
    out[name] = Coefficient(float(beta[i]), se, ci, "fitted")
  mean = float(y.mean())
  tss = float(((y - mean) ** 2).sum())
  rss = float((resid ** 2).sum())
  fit = OpFit(n=n, mean_s=mean, rel_rmse=math.sqrt(rss / n) / mean if mean > 0 else 0.0,
              r2=1.0 - rss / tss if tss > 0 else None)
  return {k: out[k] for k in x_cols}, fit


def fit_cost_model(records: Iterable[CostRecord], source: str,
                   ops: Sequence[str] = tuple(REGRESSIONS)) -> CostFit:
  """Fits every operation in `ops` from `records` (module docstring).

  Args:
    records: timed operations.
    source: what the records are (stored as `CostModel.source`, e.g. "measured: bench_pipeline
      calibration, 2 CPU cores, loaded").
    ops: operations to fit; their coefficients stay 0 (status "not observed") without records.

  Returns:
    The `CostFit`; its `cost_model` holds the estimates (quantized) and `source`.
  """
  by_op: dict[str, list[CostRecord]] = {op: [] for op in REGRESSIONS}
  excluded = dict.fromkeys(REGRESSIONS, 0)
  for r in records:
    if r.features.get("compiles", 0) > 0:
      excluded[r.op] += 1
    else:
      by_op[r.op].append(r)
  coefs: dict[str, Coefficient] = {}
  op_fits: dict[str, OpFit] = {}
  for op in ops:
    intercept, feats = REGRESSIONS[op]
    recs = by_op[op]
    if not recs:
      for name in (intercept, *(c for _, c in feats)):
        coefs[name] = Coefficient(0.0, None, None, "not observed")
      continue
    cols = {intercept: np.ones(len(recs))}
    for feat, name in feats:
      cols[name] = np.asarray([r.features.get(feat, 0) for r in recs], np.float64)
    c, f = fit_ols(cols, np.asarray([r.duration_s for r in recs]))
    op_fits[op] = dataclasses.replace(f, excluded=excluded[op])
    coefs.update(c)
  return CostFit(_model(coefs, source), coefs, op_fits)


def _coefficient_names() -> list[str]:
  return [n for i, f in REGRESSIONS.values() for n in (i, *(c for _, c in f))]


def _model(coefs: dict[str, Coefficient], source: str) -> CostModel:
  values = dict.fromkeys(_coefficient_names(), 0.0)
  values.update({k: c.estimate for k, c in coefs.items()})
  return CostModel(**values, flop_slot_step_s=0.0, source=source)
