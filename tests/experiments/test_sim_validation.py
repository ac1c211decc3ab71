"""The simulator's validation (experiments/lib/sim_validation.py) on a synthetic run directory."""

import json

from lib import sim_validation
from test_calibration import _synthetic, _write_run  # tests/sim helpers


def test_validation_compare_on_a_run_dir(tmp_path):
  _write_run(tmp_path, *_synthetic())
  config = {"sampler": {"num_slots": 16, "max_new_tokens": 64, "max_seq_len": 64},
            "pipeline": {"driver": "sync", "mode": "reproducible", "num_steps": 20,
                         "group_size": 4,
                         "staleness": {"policy": "block", "max_lag": 0, "groups_per_step": 2,
                                       "queue_capacity_groups": None}}}
  (tmp_path / "config.json").write_text(json.dumps(config))
  recorded = [10, 12, 30, 8] * 40
  row = sim_validation.compare(str(tmp_path), 2, recorded, seeds=(0, 1))
  json.dumps(row)
  assert row["steps"] == 20 and row["driver"] == "sync"
  for source in ("metrics", "recorded", "replay"):
    assert row[f"predicted_{source}"]["lag_mean"] == 0.0
    assert row[f"predicted_{source}"]["tokens_per_s"] > 0
    assert isinstance(row[f"pass_{source}"], bool)
