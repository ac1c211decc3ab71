"""Issue 26 item 3: the pinned systems comparison's settings, virtual-clock arguments and table
(the runs themselves need two idle cores: experiments/pinned_systems_run.py)."""

import pytest

from lib import pinned_run


def test_settings_refuse_a_window_without_steps_and_one_core_for_both():
  with pytest.raises(ValueError, match="must exceed warmup_steps"):
    pinned_run.Settings(out_dir="/tmp/x", steps=3, warmup_steps=3)
  with pytest.raises(ValueError, match="different cores"):
    pinned_run.Settings(out_dir="/tmp/x", learner_core=1, sampler_core=1)


def test_virtual_run_is_the_same_config_on_the_reproducible_clock():
  st = pinned_run.Settings(out_dir="/tmp/x", steps=5, warmup_steps=1, tiny=True)
  real = pinned_run.run_args("pipeline", "/tmp/x/r", 5, True)
  virt = pinned_run.virtual_args(st, "pipeline", "/tmp/x/r", "/tmp/fit.json")
  assert "--config.pipeline.mode=threaded" in real
  assert [a for a in virt if "mode=" in a] == ["--config.pipeline.mode=reproducible"]
  assert virt[-1] == "--config.pipeline.cost_model_file=/tmp/fit.json"
  assert set(real) - set(virt) == {"--config.pipeline.mode=threaded"}


def test_table_reports_errors_and_missing_parts():
  ok = dict(driver="pipeline", measured=dict(samples_per_s=2.0, sample_lag_mean=1.0),
            predicted=dict(samples_per_s=2.1, sample_lag_mean=1.2), throughput_rel_err=0.05,
            virtual=dict(measured=dict(samples_per_s=1.5, sample_lag_mean=1.1)),
            virtual_throughput_rel_err=-0.25)
  ok["pass"] = False
  failed = dict(driver="sync", error="exit code 1")
  md = pinned_run.table([ok, failed]).splitlines()
  assert md[2].split(" | ")[1:] == ["2.000", "2.100", "1.500", "+5.0%", "-25.0%", "1.00", "1.20",
                                    "1.10", "False |"]
  assert md[3].endswith("exit code 1 |") and "n/a" in md[3]
