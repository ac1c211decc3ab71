"""Plots (issue #17 items 7 and 9): every panel has a title and a y-label, run-time axes say
which clock they are on, and the Gantt chart shows every weight push (min visible width)."""

import numpy as np
import pytest

from rlax_pipe import plots
from rlax_pipe import timeline as tl

def _rows(clock):
  rows = []
  for step in range(1, 5):
    rows.append({"kind": "train", "step": step, "clock": clock, "time_s": step * 0.5,
                 "reward_mean": 0.1 * step, "lag_hist": [3, 1, 0], "idle_sampler": 0.1,
                 "idle_learner": 0.5})
  rows.append({"kind": "eval", "step": 4, "clock": clock, "time_s": 2.0,
               "heldout_accuracy": 0.5})
  return rows


@pytest.mark.parametrize("clock, words", [("virtual", "virtual clock: modelled device time"),
                                          ("measured", "measured wall clock")])
def test_run_plots_are_labelled_with_their_clock(tmp_path, saved_figures, clock, words,
                                                assert_every_panel_labelled):
  rows = _rows(clock)
  plots.plot_reward_accuracy(rows, str(tmp_path / "r.png"))
  plots.plot_lag_hist(rows, str(tmp_path / "l.png"))
  plots.plot_idle(rows, str(tmp_path / "i.png"))
  assert_every_panel_labelled(saved_figures)
  reward_fig = saved_figures[0]
  assert words in reward_fig.axes[0].get_xlabel()
  assert words in saved_figures[2].axes[0].get_title()


def _push_widths_px(fig):
  """Display widths (pixels) of the bars drawn in the "channel" row."""
  ax = fig.axes[0]
  fig.canvas.draw()
  row = [t.get_text() for t in ax.get_yticklabels()].index("channel")
  widths = []
  for coll in ax.collections:
    for path in coll.get_paths():
      xs, ys = path.vertices[:, 0], path.vertices[:, 1]
      if abs(ys.mean() - row) < 0.5:
        x0, x1 = ax.transData.transform([(xs.min(), row), (xs.max(), row)])[:, 0]
        widths.append(x1 - x0)
  return widths


def test_gantt_shows_every_5ms_push_on_a_long_axis(tmp_path, saved_figures,
                                                 assert_every_panel_labelled):
  """The issue's input: 5 ms pushes on a run of minutes used to be narrower than a pixel."""
  t = tl.Timeline(clock=tl.VirtualClock())
  for i in range(30):
    start = 10.0 * i
    t.record("sampler", "decode", start, start + 10.0, slots_active=4, slots_total=8)
    t.record("learner", "train_step", start + 2.0, start + 9.0)
    t.record("channel", "push", start + 9.0, start + 9.005)
  tl.plot_gantt(t.spans(), str(tmp_path / "g.png"), title="pipeline (reproducible)",
                xlabel="run time (s, virtual clock: modelled device time)")
  assert_every_panel_labelled(saved_figures)
  widths = _push_widths_px(saved_figures[0])
  assert len(widths) == 30 and min(widths) >= 1.5
  # To scale, a 5 ms push on a 300 s axis would be a few thousandths of a pixel.
  axis_px = np.diff(saved_figures[0].axes[0].transData.transform([(0, 0), (300, 0)])[:, 0])[0]
  assert 0.005 / 300 * axis_px < 0.05
