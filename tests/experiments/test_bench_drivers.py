"""bench_pipeline's suites on tiny inputs: the honest driver comparison (threaded measured runs,
the fitted cost model, virtual and simulated predictions), the control-plane costs and the
accelerator prediction."""

import json
import math
import pathlib

from lib import bench_drivers
from lib import control_plane


def test_compare_drivers_measures_calibrates_and_predicts(tmp_path, tiny_init, tiny_config):
  base = tiny_config(tmp_path, tiny_init, steps=5)
  res = bench_drivers.compare_drivers(base, ("sync", "pipeline"), str(tmp_path / "b"),
                                      warmup_steps=1, seeds=(0,), fresh_process=False)
  json.dumps(res)
  assert pathlib.Path(res["cost_fit_path"]).exists()
  assert res["cost_model_pooled"]["source"].startswith("measured: threaded bench runs")
  assert res["cost_model_sync"]["source"].startswith("measured: threaded sync run")
  for key in ("wall_throughput_ratio_pipeline_vs_sync", "virtual_vs_measured_throughput_error",
              "sim_vs_measured_throughput_error", "sim_vs_measured_staleness_error_steps",
              "compile_s_sync", "compile_s_pipeline", "measured_sample_lag_mean_pipeline",
              "measured_token_lag_mean_pipeline", "virtual_slot_occupancy_sync",
              "virtual_vs_measured_throughput_error_pooled", "sim_samples_per_s_pooled_sync"):
    assert math.isfinite(res[key]), key
  assert res["compile_s_sync"] > 0  # the first process compiled everything
  assert res["measured_sample_lag_mean_sync"] == 0.0 == res["sim_sample_lag_mean_sync"]
  assert res["measured_sample_lag_mean_pipeline"] >= res["measured_token_lag_mean_pipeline"]


def test_steady_state_leaves_out_compiles_and_warmup():
  rows = [{"now": t, "compiles": c, "samples": 4, "tokens": 40, "lag_hist": [3, 1],
           "sample_lags": [0, 1, 0, 0]}
          for t, c in ((1.0, 5), (2.0, 5), (3.0, 6), (3.5, 6), (4.0, 6))]
  s = bench_drivers.steady_state(rows, [], warmup_steps=1, start=0.0)
  # interval 2 -> 3 compiled: used intervals 1 -> 2, 3 -> 3.5, 3.5 -> 4 = 2.0 s, 12 samples.
  assert s["steps_used"] == 3 and s["compile_intervals"] == 1
  assert s["samples_per_s"] == 6.0 and s["sample_lag_mean"] == 0.25
  assert s["token_lag_mean"] == 0.25


def test_control_plane_small():
  out = control_plane.control_plane(live_groups=300, group_size=4, groups_per_step=64,
                                    max_lag=5, steps=2, seq_len=256, timeline_spans=2000)
  json.dumps(out)
  assert out["live_groups_block"] == 300 and out["live_groups_learner_wait"] == 300
  for key in ("admission_us_per_event", "learner_host_overhead_fraction",
              "timeline_summary_us", "retirement_us_per_group"):
    assert out[key] > 0


def test_accelerator_prediction_small():
  out = bench_drivers.accelerator_prediction(
      num_steps=4, warmup_steps=1, workload=bench_drivers.talk_workload(4, 4))
  json.dumps(out)
  assert out["predicted_accelerator_speedup_pipeline_vs_sync"] > 1
  assert out["sync_round_t100_s"] >= out["sync_round_t99_s"] > 0
  assert out["accelerator_cost_model"]["source"].startswith("analytic")
