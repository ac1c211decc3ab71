"""The simulator's validation (experiments/lib/sim_validation.py) on a tiny threaded run."""

import dataclasses
import json

import pytest

from lib import sim_validation


def test_compare_on_a_threaded_run_and_refuses_a_reproducible_one(tmp_path, tiny_init,
                                                                  tiny_config):
  from rlax_pipe.pipeline import run as run_lib  # pylint: disable=import-outside-toplevel
  cfg = tiny_config(tmp_path, tiny_init, mode="threaded", steps=4)
  cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, checkpoint_every=10))
  run_lib.run(cfg)
  row = sim_validation.compare(cfg.run_dir, 1, seeds=(0, 1))
  json.dumps(row)
  assert row["steps"] == 4 and row["driver"] == "pipeline"
  assert row["cost_model"]["source"].startswith("measured")
  assert row["predicted"]["samples_per_s"] > 0 and isinstance(row["pass"], bool)
  assert row["measured"]["sample_lag_mean"] >= row["measured"]["token_lag_mean"]
  repro = tiny_config(tmp_path, tiny_init, steps=1, run_name="repro")
  run_lib.run(repro)
  with pytest.raises(ValueError, match="reproducible run"):
    sim_validation.compare(repro.run_dir, 0)
