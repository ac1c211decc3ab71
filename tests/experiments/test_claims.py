"""The learning claims A11-A14 (experiments/lib/claims.py) on tiny runs, and the stress preset."""

import functools
import math

import pytest

from lib import ablations
from lib import claims
from lib import config_cli
from lib import seeds
from rlax_pipe import config_dict
from rlax_pipe.pipeline.config import RunConfig

_VERDICTS = ("shown", "not shown", "contradicted")


@pytest.fixture(scope="module", name="claims_dir")
def claims_dir_fixture(tmp_path_factory):
  """One output dir for every claim: cells two claims share run once."""
  return tmp_path_factory.mktemp("claims")


def _split(rows):
  return ([r for r in rows if "verdict" not in r], [r for r in rows if "verdict" in r])


@pytest.mark.parametrize("name", claims.CLAIMS)
def test_claims_tiny(name, claims_dir, tiny_config, tiny_init, saved_figures,
                     assert_every_panel_labelled):
  base = tiny_config(claims_dir, tiny_init, steps=2)
  nseeds = 1  # two seeds: test_sweep_table_and_plots
  rows = ablations.get_ablation(name)(str(claims_dir), tiny=True, base=base,
                                      seeds=tuple(range(nseeds)))
  cells, verdicts = _split(rows)
  want, comps = claims.claim_cells(name, base, tiny=True)
  assert [r["label"] for r in cells] == [label for label, _, _ in want]
  assert len(verdicts) == len(comps) and all(v["verdict"] in _VERDICTS for v in verdicts)
  assert all(v["paired_verdict"] == "not shown" for v in verdicts)  # one seed: no interval
  for r in cells:
    assert r["seeds"] == nseeds and "heldout_end_ci" in r and "ess_mean_ci" in r
    assert math.isnan(r["heldout_end_ci"]) == (nseeds == 1)
  assert all(v["verdict"] == "not shown" for v in verdicts)  # one seed: no interval
  assert (claims_dir / f"{name}.png").exists()
  assert_every_panel_labelled(saved_figures)
  by = {r["label"]: r for r in cells}
  if name == "A11":
    assert all(0 < r["ess_mean"] <= 1 + 1e-5 for r in cells)
    assert (claims_dir / "A11_pareto.png").exists()
  if name == "A12":
    from rlax_pipe.run_dir import read_config  # pylint: disable=import-outside-toplevel
    for r in cells:
      assert r["max_lag"] == "1"
      assert read_config(r["per_seed"][0]["run_dir"])["learner"]["num_minibatches"] == 2
  if name == "A13":  # lag 0, yet the bf16 sampler's log-probs differ from the fp32 learner's
    assert by["bf16_nocorr"]["token_lag_max"] == 0 and by["bf16_tis"]["token_lag_max"] == 0
    assert by["bf16_nocorr"]["logp_mismatch_mean"] > 1e-4
  if name == "A14":
    assert by["tis_lagaware_lag1"]["frac_truncated_mean"] >= by["tis_fixed_lag1"][
        "frac_truncated_mean"]


def test_claim_a14_fixed_cap_cell_is_a11s_tis_cell(tiny_config, tiny_init, tmp_path):
  """The fixed-cap cell of (d) is the TIS cell of (a) at the largest lag: one run serves both."""
  base = tiny_config(tmp_path, tiny_init)
  from lib import sweep  # pylint: disable=import-outside-toplevel

  def cfg(name, label, tiny=True):  # tiny=False: the full claims, e.g. (d) with 2 minibatches
    cells, _ = claims.claim_cells(name, base, tiny=tiny)
    lag, transform = next((l, t) for lab, l, t in cells if lab == label)
    return transform(sweep.cell_config(base, lag, base.objective.name, "x"))

  assert seeds.config_key(cfg("A11", "tis_pg_lag1")) == seeds.config_key(cfg("A14",
                                                                                "tis_fixed_lag1"))
  assert seeds.config_key(cfg("A11", "tis_pg_lag1")) != seeds.config_key(cfg("A14",
                                                                             "tis_lagaware_lag1"))
  a12 = cfg("A12", "tis_pg_mb2_lag1")
  assert a12.learner.num_minibatches == 2 and a12.objective.name == "tis_pg"
  full = functools.partial(cfg, tiny=False)

  assert seeds.config_key(full("A12", "tis_pg_mb2_lag1")) == seeds.config_key(
      full("A14", "tis_fixed_mb2_lag1"))
  assert seeds.config_key(full("A12", "tis_pg_lag1")) == seeds.config_key(
      full("A11", "tis_pg_lag1"))  # (b) with one update per batch shares (a)'s TIS cell
  assert full("A12", "untruncated_is_lag1").learner.num_minibatches == 1
  aware = full("A14", "tis_lagaware_mb2_lag1")
  assert aware.learner.num_minibatches == 2 and aware.objective.lag_truncation == 0.7
  a13 = cfg("A13", "bf16_tis")
  assert (a13.sampler_compute_dtype, a13.sampler.cache_dtype, a13.pipeline.driver) == (
      "bfloat16", "bfloat16", "sync")


def test_unknown_claim():
  with pytest.raises(ValueError, match="A11"):
    claims.claim_cells("A15", None, tiny=True)


@pytest.mark.parametrize("preset", ["default", "tiny", "noclip", "longlag"])
def test_stress_preset(preset):
  cfg = config_dict.from_config_dict(RunConfig, config_cli.load_config_file(
      config_cli.CONFIGS / "stress.py", preset))
  default = RunConfig()
  assert cfg.learner.optimizer.learning_rate == pytest.approx(
      10 * default.learner.optimizer.learning_rate)
  assert cfg.sampler.sampling.temperature == 1.0
  assert cfg.pipeline.staleness.max_lag == 64
  if preset == "default":
    # the sampler holds C / B = 4 batches in flight; evaluation noise <= 2 points
    assert cfg.sampler.num_slots / (cfg.pipeline.groups_per_step * cfg.pipeline.group_size) == 4
    assert seeds.binomial_half_width(0.5, cfg.pipeline.eval_problems) <= 0.02
  assert (cfg.learner.optimizer.max_grad_norm is None) == (preset == "noclip")
  if preset == "longlag":  # the same 192 samples, 16 batches in flight instead of 4
    batch = cfg.pipeline.groups_per_step * cfg.pipeline.group_size
    assert cfg.sampler.num_slots / batch == 16 and batch * cfg.pipeline.num_steps == 192


def test_stress_preset_unknown():
  with pytest.raises(ValueError, match="tiny"):
    config_cli.load_config_file(config_cli.CONFIGS / "stress.py", "huge")


def test_markdown_rows_and_verdicts():
  rows = [{"label": "tis", "seeds": 3, "heldout_end": 0.41, "heldout_end_ci": 0.015,
           "ess_mean": 0.9, "ess_mean_ci": float("nan")},
          {"verdict": "shown", "claim": "a", "comparison": "tis > none", "reason": "r",
           "source": "AReaL"}]
  text = claims.markdown(rows, ("heldout_end", "ess_mean", "kl_k3_mean"))
  assert "| tis | 3 | 0.41 +- 0.015 | 0.9 | - |" in text
  assert "claim (a) tis > none: **shown** (paired design: -)" in text


@pytest.mark.parametrize("entry", ["ablations.py", "sweep_staleness.py"])
def test_entry_points_reject_zero_seeds(entry):
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = config_cli.CONFIGS.parent.parent
  out = subprocess.run([sys.executable, str(root / "experiments" / entry), "--seeds=0",
                        "--config=experiments/configs/stress.py:tiny"],
                       env=dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=300, cwd=root)
  assert out.returncode != 0
  assert "--seeds=0: 0 is not a positive integer" in out.stderr


def test_only_names_real_cells(tiny_config, tmp_path):
  with pytest.raises(ValueError, match="no cell.*tis_pg_lag7"):
    claims.run_claim("A11", str(tmp_path), tiny=True, base=tiny_config(tmp_path, "builtin"),
                     only=("tis_pg_lag7",))
