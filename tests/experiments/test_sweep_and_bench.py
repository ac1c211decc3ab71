"""The staleness sweep and the driver comparison on tiny runs."""

import json

from lib import bench
from lib import sweep


def test_sweep_table_and_plots(tmp_path, tiny_init, tiny_config):
  base = tiny_config(tmp_path, tiny_init, steps=2)
  table = sweep.run_sweep(base, [0, None], ["tis_pg"], str(tmp_path / "sweep"))
  assert [r["max_lag"] for r in table] == ["0", "inf"]
  assert table[0]["token_lag_max"] == 0  # max_lag 0 under block is synchronous
  assert table[0]["sample_lag_max"] == 0 and table[0]["sample_lag_mean"] == 0.0
  for r in table:
    assert r["samples_per_s"] > 0 and 0 < r["ess_mean"] <= 1.0 + 1e-5
  paths = sweep.plot_sweep(table, str(tmp_path / "sweep"))
  assert len(paths) == 6 and all((tmp_path / "sweep" / p.split("/")[-1]).exists() for p in paths)


def test_compare_reports_ratios(tmp_path, tiny_init, tiny_config):
  base = tiny_config(tmp_path, tiny_init, steps=2)
  summaries = bench.run_drivers(base, ("sync", "pipeline"), str(tmp_path / "bench"))
  res = bench.compare(summaries, target=0.0)  # every eval reaches 0: time of the first eval
  assert res["time_to_target_s_sync"] == 0.0
  assert res["throughput_ratio_pipeline_vs_sync"] > 0
  assert set(res["idle_fraction_pipeline"]) >= {"sampler", "learner"}
  json.dumps(res)
