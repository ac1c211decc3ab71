"""Spans of work and waiting per component, and the numbers derived from them.

Every component records `Span`s (component, kind, start, end, slot counts) into a `Timeline`,
timed by a clock: `time.perf_counter` for real runs or a `VirtualClock` for reproducible runs.
From the spans: busy / idle fraction per component over a window, sampler slot occupancy, the
time the sampler stalled on weight pushes, the time the learner waited for batches; JSONL
export / import; a Gantt chart PNG.

Control-plane costs do not grow with the run: a `Timeline` keeps a running summary updated in
O(1) per span (`Timeline.summary()`, equal to `summarize` over the whole run when each
component's spans are recorded in start order, as every driver does), and a file-backed
timeline appends new spans to its JSONL file (`flush`) instead of rewriting it; its
`state_dict` is the number of spans written, so a checkpoint never copies the timeline.

Kind conventions (any string works; these names are what the summaries look for):
  sampler: "prefill", "decode" (slots_active / slots_total set), "wait_weights", "wait_admission"
  learner: "train_step", "wait_batch"
  channel: "push"
A kind starting with "wait" is idle time; every other kind is busy time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

WAIT_WEIGHTS = "wait_weights"
WAIT_BATCH = "wait_batch"
WAIT_ADMISSION = "wait_admission"


def is_idle_kind(kind: str) -> bool:
  """True for kinds that count as idle time (names starting with "wait")."""
  return kind.startswith("wait")


@dataclasses.dataclass(frozen=True)
class Span:
  """One interval of activity.

  Attributes:
    component: who, e.g. "sampler", "learner", "channel" (or "sampler/1" per replica).
    kind: what, e.g. "decode", "train_step", "push", "wait_weights".
    start: seconds on the timeline's clock.
    end: seconds, >= start.
    slots_active: decode slots in use during the span (sampler), or None.
    slots_total: decode slots available, or None.
  """

  component: str
  kind: str
  start: float
  end: float
  slots_active: int | None = None
  slots_total: int | None = None

  def __post_init__(self):
    if self.end < self.start:
      raise ValueError(f"Span {self.component}/{self.kind}: end {self.end} < start {self.start}.")
    if (self.slots_active is None) != (self.slots_total is None):
      raise ValueError("Span: give both slots_active and slots_total, or neither.")
    if self.slots_total is not None and not 0 <= self.slots_active <= self.slots_total:
      raise ValueError(f"Span: slots_active={self.slots_active} not in [0, slots_total="
                       f"{self.slots_total}].")

  @property
  def duration(self) -> float:
    """end - start, seconds."""
    return self.end - self.start


class VirtualClock:
  """A clock that only moves when told to (reproducible runs, simulators). Thread-safe."""

  def __init__(self, start: float = 0.0):
    self._t = float(start)
    self._lock = threading.Lock()

  def __call__(self) -> float:
    """Current time, seconds."""
    with self._lock:
      return self._t

  def advance(self, dt: float) -> float:
    """Moves time forward by dt >= 0 seconds; returns the new time.

    Raises:
      ValueError: if dt < 0.
    """
    if dt < 0:
      raise ValueError(f"VirtualClock.advance: dt={dt} < 0.")
    with self._lock:
      self._t += dt
      return self._t

  def set(self, t: float) -> None:
    """Jumps to time t (not earlier than now).

    Raises:
      ValueError: if t is before the current time.
    """
    with self._lock:
      if t < self._t:
        raise ValueError(f"VirtualClock.set: {t} is before now ({self._t}).")
      self._t = float(t)


class RunningSummary:
  """O(1)-per-span totals from which `summary` gives `summarize`'s numbers over the whole run.

  Busy time per component is a union: a span adds only the part after the latest end seen for
  its component, which is the exact union when each component's spans arrive in start order.
  """

  def __init__(self):
    self.t0, self.t1 = math.inf, -math.inf
    self.busy: dict[str, float] = {}
    self.last_end: dict = {}  # union bookkeeping: latest end per component (and wait kind)
    self.slot_num = self.slot_den = 0.0
    self.push_stall_s = self.queue_wait_s = 0.0

  def add(self, s: Span) -> None:
    """Accounts for one span."""
    self.t0, self.t1 = min(self.t0, s.start), max(self.t1, s.end)
    self.busy.setdefault(s.component, 0.0)
    if not is_idle_kind(s.kind):
      self.busy[s.component] += self._new_part(s.component, s)
    if s.component == "sampler" and s.kind == "decode" and s.slots_total is not None:
      self.slot_num += s.slots_active * s.duration
      self.slot_den += s.slots_total * s.duration
    if s.component == "sampler" and s.kind == WAIT_WEIGHTS:
      self.push_stall_s += self._new_part(("stall",), s)
    if s.component == "learner" and s.kind == WAIT_BATCH:
      self.queue_wait_s += self._new_part(("wait",), s)

  def _new_part(self, key, s: Span) -> float:
    last = self.last_end.get(key, -math.inf)
    self.last_end[key] = max(last, s.end)
    return max(0.0, s.end - max(s.start, last))

  def summary(self) -> TimelineSummary:
    """The summary over [first start, last end] of everything added."""
    if self.t1 < self.t0:
      return TimelineSummary((0.0, 0.0), {}, {}, 0.0, 0.0, 0.0)
    width = self.t1 - self.t0
    busy = {c: (b / width if width > 0 else 0.0) for c, b in sorted(self.busy.items())}
    return TimelineSummary(
        window=(self.t0, self.t1), busy=busy, idle={c: 1.0 - b for c, b in busy.items()},
        slot_occupancy=self.slot_num / self.slot_den if self.slot_den > 0 else 0.0,
        push_stall_s=self.push_stall_s, queue_wait_s=self.queue_wait_s)


class Timeline:
  """Thread-safe span recorder with a running summary and optional append-only JSONL file.

  Example:
    tl = Timeline()                       # or Timeline(clock=VirtualClock(), path="t.jsonl")
    with tl.span("learner", "train_step"):
      ...
    tl.record("sampler", "decode", t0, t1, slots_active=5, slots_total=8)
    summary = tl.summary()                # O(components), whatever the number of spans
    tl.flush()                            # appends the spans not yet written to the file
  """

  def __init__(self, clock: Callable[[], float] = time.perf_counter,
               path: str | pathlib.Path | None = None, truncate: bool = True):
    """Args:
      clock: zero-argument callable returning seconds (`VirtualClock` works).
      path: JSONL file the spans are appended to by `flush`; None = memory only.
      truncate: empty the file now (a new timeline); False when `load_state_dict` follows.
    """
    self._clock = clock
    self._spans: list[Span] = []
    self._lock = threading.Lock()
    self._running = RunningSummary()
    self._path = None if path is None else pathlib.Path(path)
    self._written = 0
    if self._path is not None and truncate:
      self._path.write_text("")

  def now(self) -> float:
    """The clock's current time, seconds."""
    return self._clock()

  def record(self, component: str, kind: str, start: float, end: float,
             slots_active: int | None = None, slots_total: int | None = None) -> Span:
    """Adds a finished span and returns it."""
    span = Span(component, kind, float(start), float(end), slots_active, slots_total)
    with self._lock:
      self._spans.append(span)
      self._running.add(span)
    return span

  def summary(self) -> TimelineSummary:
    """`summarize` of every span so far, from the running totals (O(components))."""
    with self._lock:
      return self._running.summary()

  def flush(self) -> int:
    """Appends the spans recorded since the last flush to the file; returns spans written in
    all (no-op without a file)."""
    with self._lock:
      new, self._written = self._spans[self._written:], len(self._spans)
      written = self._written
    if self._path is not None and new:
      with open(self._path, "a") as f:
        f.write("".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in new))
    return written

  @contextlib.contextmanager
  def span(self, component: str, kind: str, slots_active: int | None = None,
           slots_total: int | None = None) -> Iterator[None]:
    """Context manager recording [enter, exit) as a span (also when the body raises)."""
    start = self._clock()
    try:
      yield
    finally:
      self.record(component, kind, start, self._clock(), slots_active, slots_total)

  def spans(self, component: str | None = None, kind: str | None = None) -> list[Span]:
    """Recorded spans (optionally filtered), sorted by start time."""
    with self._lock:
      out = [s for s in self._spans if (component is None or s.component == component)
             and (kind is None or s.kind == kind)]
    return sorted(out, key=lambda s: (s.start, s.end))

  def state_dict(self) -> dict:
    """File-backed: flushes, then {"num_spans": spans in the file} (the checkpoint never
    copies the timeline); memory only: the JSON-able spans. The clock is not part of it."""
    if self._path is not None:
      return {"num_spans": self.flush()}
    return {"spans": [dataclasses.asdict(s) for s in self.spans()]}

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict`: the first "num_spans" spans of this timeline's file (the file
    is truncated to them), or the listed "spans".

    Raises:
      ValueError: for "num_spans" without a file, or a file with fewer spans.
    """
    if "num_spans" in state:
      n = int(state["num_spans"])
      if self._path is None or not self._path.exists():
        raise ValueError(f"Timeline.load_state_dict: {n} spans are in a file, but this timeline "
                         "has none; build it with path=<the run's timeline.jsonl>.")
      with open(self._path) as f:
        lines = [line for line in f if line.strip()][:n]
      if len(lines) < n:
        raise ValueError(f"Timeline.load_state_dict: {self._path} has {len(lines)} spans, the "
                         f"checkpoint expects {n}.")
      self._path.write_text("".join(lines))
      spans = [Span(**json.loads(line)) for line in lines]
      written = n
    else:
      spans, written = [Span(**d) for d in state["spans"]], 0
      if self._path is not None:
        self._path.write_text("")
    running = RunningSummary()
    for sp in sorted(spans, key=lambda x: (x.start, x.end)):
      running.add(sp)
    with self._lock:
      self._spans, self._running, self._written = spans, running, written

  def to_jsonl(self, path: str) -> None:
    """Writes one JSON object per span."""
    with open(path, "w") as f:
      for s in self.spans():
        f.write(json.dumps(dataclasses.asdict(s)) + "\n")

  @classmethod
  def from_jsonl(cls, path: str) -> Timeline:
    """Reads spans written by `to_jsonl` into a new Timeline."""
    tl = cls()
    with open(path) as f:
      for line in f:
        if line.strip():
          tl.record(**json.loads(line))
    return tl


# ---------------------------------------------------------------------------------------------
# Derived numbers (pure functions of spans).


def _window(spans: Sequence[Span], window: tuple[float, float] | None) -> tuple[float, float]:
  if window is not None:
    if window[1] < window[0]:
      raise ValueError(f"window {window} ends before it starts.")
    return window
  if not spans:
    return (0.0, 0.0)
  return (min(s.start for s in spans), max(s.end for s in spans))


def _clipped(spans: Iterable[Span], lo: float, hi: float) -> list[tuple[float, float]]:
  return [(max(s.start, lo), min(s.end, hi)) for s in spans if s.end > lo and s.start < hi]


def _union_length(intervals: list[tuple[float, float]]) -> float:
  total, cur_lo, cur_hi = 0.0, None, None
  for lo, hi in sorted(intervals):
    if cur_hi is None or lo > cur_hi:
      if cur_hi is not None:
        total += cur_hi - cur_lo
      cur_lo, cur_hi = lo, hi
    else:
      cur_hi = max(cur_hi, hi)
  if cur_hi is not None:
    total += cur_hi - cur_lo
  return total


def busy_fraction(spans: Sequence[Span], component: str,
                  window: tuple[float, float] | None = None) -> float:
  """Fraction of the window during which `component` ran some non-wait span.

  Overlapping spans count once (union). Idle fraction = 1 - busy fraction (waits and gaps).

  Args:
    spans: all spans of a run.
    component: component name.
    window: (t0, t1) seconds; default = first start to last end over all spans.

  Returns:
    busy time / window length in [0, 1] (0.0 for an empty window).
  """
  lo, hi = _window(spans, window)
  if hi <= lo:
    return 0.0
  busy = [s for s in spans if s.component == component and not is_idle_kind(s.kind)]
  return _union_length(_clipped(busy, lo, hi)) / (hi - lo)


def slot_occupancy(spans: Sequence[Span], component: str = "sampler", kind: str = "decode",
                   window: tuple[float, float] | None = None) -> float:
  """Time-weighted slot occupancy: sum(active * dt) / sum(total * dt) over decode spans.

  Returns:
    A fraction in [0, 1]; 0.0 when there is no such span with slot counts.
  """
  lo, hi = _window(spans, window)
  num = den = 0.0
  for s in spans:
    if s.component != component or s.kind != kind or s.slots_total is None:
      continue
    dt = min(s.end, hi) - max(s.start, lo)
    if dt > 0:
      num += s.slots_active * dt
      den += s.slots_total * dt
  return num / den if den > 0 else 0.0


def total_time(spans: Sequence[Span], component: str, kind: str,
               window: tuple[float, float] | None = None) -> float:
  """Seconds covered by spans of (component, kind) inside the window (union)."""
  lo, hi = _window(spans, window)
  sel = [s for s in spans if s.component == component and s.kind == kind]
  return _union_length(_clipped(sel, lo, hi))


def push_stall(spans: Sequence[Span], component: str = "sampler",
               window: tuple[float, float] | None = None) -> float:
  """Seconds the sampler stalled waiting for weights (`WAIT_WEIGHTS` spans)."""
  return total_time(spans, component, WAIT_WEIGHTS, window)


def queue_wait(spans: Sequence[Span], component: str = "learner",
               window: tuple[float, float] | None = None) -> float:
  """Seconds the learner waited for a batch from the queue (`WAIT_BATCH` spans)."""
  return total_time(spans, component, WAIT_BATCH, window)


@dataclasses.dataclass(frozen=True)
class TimelineSummary:
  """Numbers for one window.

  Attributes:
    window: (t0, t1) seconds.
    busy: component -> busy fraction in [0, 1].
    idle: component -> 1 - busy.
    slot_occupancy: sampler decode slot occupancy in [0, 1] (component "sampler").
    push_stall_s: seconds the sampler waited on weight pushes.
    queue_wait_s: seconds the learner waited on the queue.
  """

  window: tuple[float, float]
  busy: dict[str, float]
  idle: dict[str, float]
  slot_occupancy: float
  push_stall_s: float
  queue_wait_s: float


def summarize(spans: Sequence[Span], window: tuple[float, float] | None = None
              ) -> TimelineSummary:
  """All derived numbers for the components present in `spans`."""
  lo, hi = _window(spans, window)
  comps = sorted({s.component for s in spans})
  busy = {c: busy_fraction(spans, c, (lo, hi)) for c in comps}
  return TimelineSummary(
      window=(lo, hi), busy=busy, idle={c: 1.0 - b for c, b in busy.items()},
      slot_occupancy=slot_occupancy(spans, window=(lo, hi)),
      push_stall_s=push_stall(spans, window=(lo, hi)),
      queue_wait_s=queue_wait(spans, window=(lo, hi)))


def plot_gantt(spans: Sequence[Span], path: str, title: str | None = None,
               xlabel: str = "time (s)", min_width_px: float = 2.0) -> None:
  """Writes a Gantt chart PNG: one row per component, one colour per kind, time from t0.

  Every span is drawn at least `min_width_px` pixels wide (a 5 ms weight push on a minutes-long
  axis would otherwise vanish below a pixel), so each one stays visible; widths of short spans
  are then not to scale. Uses matplotlib's Agg canvas directly (no pyplot global state).
  """
  # Imported here: matplotlib is only needed for plots.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.patches import Patch

  comps = sorted({s.component for s in spans})
  kinds = sorted({s.kind for s in spans})
  t0 = min((s.start for s in spans), default=0.0)
  extent = max((s.end for s in spans), default=t0) - t0
  width_in, dpi = 10.0, 100
  fig = Figure(figsize=(width_in, 1.0 + 0.6 * max(1, len(comps))))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  # Axes span ~75% of the figure (legend on the right): seconds per pixel of the time axis.
  min_width = min_width_px * extent / max(1.0, 0.75 * width_in * dpi)
  greys = iter(["#d9d9d9", "#b0b0b0", "#8c8c8c", "#e8e8e8", "#707070"] * len(kinds))
  busy_kinds = [k for k in kinds if not is_idle_kind(k)]
  colours = {k: next(greys) if is_idle_kind(k) else f"C{busy_kinds.index(k) % 10}" for k in kinds}
  for row, comp in enumerate(comps):
    for kind in kinds:
      bars = [(s.start - t0, max(s.duration, min_width)) for s in spans
              if s.component == comp and s.kind == kind]
      if bars:
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colours[kind])
  ax.set_yticks(range(len(comps)), comps)
  ax.set_ylabel("mesh / component")
  ax.set_xlabel(xlabel)
  ax.legend(handles=[Patch(color=colours[k], label=k) for k in kinds], loc="upper left",
            bbox_to_anchor=(1.0, 1.0), fontsize="small")
  ax.set_title(title or "Timeline of the meshes")
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
