"""Every ablation's tiny variant runs and leaves its figure."""

import pytest

from lib import ablations


@pytest.mark.parametrize("name", ablations.SIMULATED)
def test_simulated_ablations_tiny(tmp_path, name, saved_figures, assert_every_panel_labelled):
  rows = ablations.get_ablation(name)(str(tmp_path), tiny=True)
  assert rows and (tmp_path / f"{name}.png").exists()
  assert_every_panel_labelled(saved_figures)


def test_a1_sync_idle_grows_with_tail(tmp_path):
  rows = ablations.a1_long_tail(str(tmp_path), tiny=True)
  light, heavy = rows[0], rows[-1]
  assert heavy["sigma"] > light["sigma"]
  assert heavy["idle_sampler_slots"] > light["idle_sampler_slots"]


def test_a8_drop_shortens_trained_lengths(tmp_path):
  rows = {r["policy"] + str(r["capacity_groups"]): r for r in ablations.a8_queue_policy(
      str(tmp_path), tiny=True)}
  assert rows["dropNone"]["trained_mean_length"] < rows["blockNone"]["trained_mean_length"]
  assert rows["blockNone"]["wasted_token_fraction"] == 0


def test_unknown_ablation_lists_choices():
  with pytest.raises(ValueError, match="A10"):
    ablations.get_ablation("A99")


@pytest.mark.parametrize("name", ["A10"])
def test_learning_ablations_tiny(tmp_path, name, tiny_config, tiny_init, saved_figures,
                                assert_every_panel_labelled):
  base = tiny_config(tmp_path, tiny_init, steps=2)
  rows = ablations.get_ablation(name)(str(tmp_path), tiny=True, base=base)
  assert len(rows) == 2 and (tmp_path / f"{name}.png").exists()
  assert_every_panel_labelled(saved_figures)


def test_a9_bf16_sampler_creates_lag0_mismatch(tmp_path, tiny_config, tiny_init):
  base = tiny_config(tmp_path, tiny_init, steps=2)
  rows = {r["label"]: r for r in ablations.a9_precision_mismatch(str(tmp_path), tiny=True,
                                                                 base=base)}
  assert (tmp_path / "A9.png").exists()
  assert rows["fp32_tis"]["token_lag_max"] == 0 and rows["bf16_tis"]["token_lag_max"] == 0
  # Same weights, same tokens: fp32 sampler agrees with the fp32 learner to float rounding, the
  # bf16 sampler does not.
  assert rows["fp32_tis"]["logp_mismatch_mean"] < 1e-4
  assert rows["bf16_tis"]["logp_mismatch_mean"] > 10 * max(rows["fp32_tis"]["logp_mismatch_mean"],
                                                           1e-6)


def test_tiny_flag_makes_the_base_run_tiny():
  """`ablations.py --tiny` defaults its base run to the tiny preset (seconds per cell), not the
  30-step default run; an explicit --config still wins."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from lib import config_cli  # pylint: disable=import-outside-toplevel
  fv = flags.FlagValues()
  holder = config_cli.define_rl_flags(fv, ["prog", "--tiny"], preset="tiny")
  fv(["prog"])
  cfg = config_cli.run_config(holder.value, ["prog"])
  assert cfg.pipeline.num_steps == 3 and cfg.pipeline.group_size == 2
  assert cfg.sampler_mesh_axes == (("tp", 1),)
