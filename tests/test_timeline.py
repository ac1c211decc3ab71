"""Tests for timeline spans and the numbers derived from them (hand-computed)."""

import threading

import pytest

from rlax_pipe import timeline as tl


def _hand_made():
  t = tl.Timeline(clock=tl.VirtualClock())
  # sampler: decode 0-4 (6/8 slots), wait for weights 4-5, decode 5-9 (2/8), prefill 8-10
  t.record("sampler", "decode", 0, 4, slots_active=6, slots_total=8)
  t.record("sampler", tl.WAIT_WEIGHTS, 4, 5)
  t.record("sampler", "decode", 5, 9, slots_active=2, slots_total=8)
  t.record("sampler", "prefill", 8, 10)
  # learner: wait 0-3, train 3-6, wait 6-7, train 7-9
  t.record("learner", tl.WAIT_BATCH, 0, 3)
  t.record("learner", "train_step", 3, 6)
  t.record("learner", tl.WAIT_BATCH, 6, 7)
  t.record("learner", "train_step", 7, 9)
  t.record("channel", "push", 6, 6.5)
  return t


def test_summary_numbers():
  s = tl.summarize(_hand_made().spans())
  assert s.window == (0.0, 10.0)
  assert s.busy == pytest.approx({"sampler": 0.9, "learner": 0.5, "channel": 0.05})
  assert s.idle["sampler"] == pytest.approx(0.1)
  assert s.slot_occupancy == pytest.approx((6 * 4 + 2 * 4) / (8 * 4 + 8 * 4))
  assert s.push_stall_s == pytest.approx(1.0)
  assert s.queue_wait_s == pytest.approx(4.0)


def test_window_clipping():
  spans = _hand_made().spans()
  assert tl.busy_fraction(spans, "learner", (2, 8)) == pytest.approx(4 / 6)
  assert tl.slot_occupancy(spans, window=(3, 6)) == pytest.approx((6 * 1 + 2 * 1) / (8 * 2))
  assert tl.queue_wait(spans, window=(2, 8)) == pytest.approx(2.0)
  assert tl.busy_fraction(spans, "nobody") == 0.0
  assert tl.busy_fraction([], "learner") == 0.0
  with pytest.raises(ValueError, match="ends before"):
    tl.busy_fraction(spans, "learner", (3, 1))


def test_span_validation_and_context_manager():
  with pytest.raises(ValueError, match="end 1.0 < start 2.0"):
    tl.Span("a", "b", 2.0, 1.0)
  with pytest.raises(ValueError, match="both"):
    tl.Span("a", "b", 0, 1, slots_active=1)
  with pytest.raises(ValueError, match="not in"):
    tl.Span("a", "b", 0, 1, slots_active=9, slots_total=8)
  clock = tl.VirtualClock(10.0)
  t = tl.Timeline(clock)
  with pytest.raises(RuntimeError):
    with t.span("learner", "train_step"):
      clock.advance(2.5)
      raise RuntimeError("boom")
  assert t.spans() == [tl.Span("learner", "train_step", 10.0, 12.5)]
  with pytest.raises(ValueError):
    clock.advance(-1)
  with pytest.raises(ValueError):
    clock.set(1.0)


def test_thread_safe_recording():
  t = tl.Timeline()

  def work(i):
    for j in range(200):
      t.record(f"c{i}", "decode", j, j + 1)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  assert len(t.spans()) == 800 and len(t.spans(component="c2")) == 200


def test_jsonl_round_trip_and_gantt(tmp_path):
  t = _hand_made()
  path = str(tmp_path / "timeline.jsonl")
  t.to_jsonl(path)
  assert tl.Timeline.from_jsonl(path).spans() == t.spans()
  png = tmp_path / "gantt.png"
  tl.plot_gantt(t.spans(), str(png), title="toy run")
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_running_summary_equals_summarize_on_random_sequential_spans():
  import random  # pylint: disable=import-outside-toplevel
  rng = random.Random(0)
  t = tl.Timeline(clock=tl.VirtualClock())
  clocks = {"sampler": 0.0, "learner": 0.0, "channel": 0.0}
  for _ in range(500):
    c = rng.choice(list(clocks))
    start = clocks[c] + rng.choice([0.0, rng.random()])
    end = start + rng.random()
    kind = rng.choice(["decode", "prefill", tl.WAIT_WEIGHTS, tl.WAIT_BATCH, "train_step"])
    slots = (rng.randint(0, 8), 8) if kind == "decode" else (None, None)
    t.record(c, kind, start, end, *slots)
    clocks[c] = max(start, end - (0.2 if rng.random() < 0.1 else 0.0))  # overlaps, start-ordered
  got, want = t.summary(), tl.summarize(t.spans())
  assert got.window == want.window
  assert got.busy == pytest.approx(want.busy)
  assert got.slot_occupancy == pytest.approx(want.slot_occupancy)
  assert got.push_stall_s == pytest.approx(want.push_stall_s)
  assert got.queue_wait_s == pytest.approx(want.queue_wait_s)
  assert tl.Timeline().summary().busy == {}


def test_file_backed_timeline_appends_and_resumes(tmp_path):
  path = tmp_path / "timeline.jsonl"
  t = tl.Timeline(clock=tl.VirtualClock(), path=path)
  t.record("sampler", "decode", 0, 1, 2, 4)
  assert t.state_dict() == {"num_spans": 1}  # a checkpoint holds a count, not the spans
  t.record("learner", "train_step", 1, 2)
  t.flush()
  size = path.stat().st_size
  t.record("learner", "train_step", 2, 3)
  t.flush()
  assert path.read_text().count("\n") == 3 and path.stat().st_size > size  # appended
  r = tl.Timeline(clock=tl.VirtualClock(), path=tmp_path / "other.jsonl")
  r._path = path  # pylint: disable=protected-access  (a resumed run opens the same file)
  r.load_state_dict({"num_spans": 2})
  assert len(r.spans()) == 2 and path.read_text().count("\n") == 2  # truncated to the checkpoint
  assert r.summary().busy == tl.summarize(r.spans()).busy
  with pytest.raises(ValueError, match="expects 5"):
    r.load_state_dict({"num_spans": 5})
