"""The staleness sweep and the driver comparison on tiny runs."""

import json

import pytest

from lib import bench
from lib import sweep
from rlax_pipe.config_dict import ConfigError
from rlax_pipe.run_dir import RunDir


class _FakeJob:
  """What `TargetCheck` reads of a job: the learner step and the run dir."""

  def __init__(self, run_dir):
    self.run_dir = RunDir(run_dir)
    self.learner = type("L", (), {"step": 1})()


def test_sweep_table_and_plots(tmp_path, tiny_init, tiny_config, saved_figures,
                               assert_every_panel_labelled):
  base = tiny_config(tmp_path, tiny_init, steps=2)
  table = sweep.run_sweep(base, [0, None], ["tis_pg"], str(tmp_path / "sweep"), seeds=(0, 1))
  assert [r["max_lag"] for r in table] == ["0", "inf"]
  assert table[0]["token_lag_max"] == 0  # max_lag 0 under block is synchronous
  assert table[0]["sample_lag_max"] == 0 and table[0]["sample_lag_mean"] == 0.0
  for r in table:
    assert r["seeds"] == 2 and len({s["run_dir"] for s in r["per_seed"]}) == 2
    assert r["samples_per_s"] > 0 and 0 < r["ess_mean"] <= 1.0 + 1e-5
    assert r["devices"] == 6  # tiny_config: sampler tp 2 + learner fsdp 2 x tp 2
    assert r["samples_per_device_s"] == pytest.approx(r["samples_per_s"] / 6)
    assert r["heldout_end_ci"] >= 0 and r["eval_problems"] == 4
    # the throughput's clock is named: tiny_config's reproducible runs use the hand-set model
    assert r["throughput_clock"].startswith("default: hand-set")
    per_seed = [s["heldout_end"] for s in r["per_seed"]]
    assert r["heldout_end"] == pytest.approx(sum(per_seed) / 2)
  runs_figures = len(saved_figures)  # the runs' own figures come first
  paths = sweep.plot_sweep(table, str(tmp_path / "sweep"))
  assert len(paths) == 7 and all((tmp_path / "sweep" / p.split("/")[-1]).exists() for p in paths)
  assert paths[-1].endswith("pareto.png")
  assert_every_panel_labelled(saved_figures)
  # every panel draws intervals: error bars (LineCollections) or shaded bands
  for fig in saved_figures[runs_figures:]:
    for ax in fig.axes:
      assert ax.collections, f"panel {ax.get_title()!r} draws no interval"


def test_compare_reports_ratios(tmp_path, tiny_init, tiny_config):
  base = tiny_config(tmp_path, tiny_init, steps=2)
  summaries = bench.run_drivers(base, ("sync", "pipeline"), str(tmp_path / "bench"))
  start = summaries["sync"]["initial_heldout_accuracy"]
  # The input: a target at (or below) the starting accuracy gave "time to target 0".
  with pytest.raises(ConfigError, match=rf"--target_accuracy={start:g} is not above the "
                                        rf"starting held-out accuracy {start:g}"):
    bench.compare(summaries, target=start)
  with pytest.raises(ConfigError, match="is not above"):
    bench.TargetCheck(0.0).on_step(_FakeJob(tmp_path / "bench" / "sync"), None, 0.0)
  res = bench.compare(summaries, target=1.0)  # above the start: not reached in 2 steps
  assert res["time_to_target_s_sync"] is None and res["starting_accuracy"] == start
  assert res["throughput_ratio_pipeline_vs_sync"] > 0
  assert set(res["idle_fraction_pipeline"]) >= {"sampler", "learner"}
  json.dumps(res)
