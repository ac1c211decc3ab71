"""The gradient-fidelity instrument (issue 26): verdict logic, report, and a tiny end-to-end run."""

import dataclasses
import json

import numpy as np
import pytest

from configs import stress
from lib import fidelity_report
from lib import fidelity_run
from rlax_pipe.objectives import ObjectiveConfig


def _row(case, lag, obj, cosine, trace_var=(1.0, 0.9, 1.1), bias=(0.0, -0.1, 0.1),
         per_batch=None):
  iv = [0.5, 0.4, 0.6]
  return dict(case=case, lag=lag, objective=obj, cosine=list(cosine), trace_var=list(trace_var),
              bias_parallel=list(bias), proj_var=iv, ess=iv, frac_truncated=iv,
              sq_error=iv, per_batch=per_batch or {})


def test_claims_verdicts_and_report(tmp_path):
  pb = lambda c, e: dict(cosine=list(c), sq_error=list(e), parallel=[1.0] * len(c))
  rows = [_row("lag", 0, "no_correction", (0.5, 0.45, 0.55)),
          _row("lag", 0, "untruncated_is", (0.5, 0.45, 0.55), trace_var=(1.0, 0.9, 1.1)),
          _row("lag", 8, "tis", (0.4, 0.35, 0.45), trace_var=(2.0, 1.8, 2.2),
               per_batch=pb([0.3, 0.5, 0.4], [2.0, 3.0, 2.5])),
          _row("lag", 8, "no_correction", (0.2, 0.15, 0.25),
               per_batch=pb([0.1, 0.3, 0.2], [4.0, 5.0, 4.4])),
          _row("lag", 8, "untruncated_is", (0.3, 0.1, 0.5), trace_var=(9.0, 5.0, 13.0)),
          _row("lag", 8, "tis_lag_aware", (0.1, 0.05, 0.15),
               per_batch=pb([0.31, 0.52, 0.39], [2.0, 3.0, 2.5])),
          _row("bf16", 0, "no_correction", (0.48, 0.4, 0.56))]
  table = dict(rows=rows)
  v = {c["claim"]: c["verdict"] for c in fidelity_report.claims(table)}
  assert v["(a) TIS closer to g* than no correction (cosine)"] == "shown"  # paired +0.2 each
  assert v["(a) TIS lower error than no correction (|g-g*|^2)"] == "shown"
  assert v["(b1) untruncated IS variance grows with lag"] == "shown"      # 9 [5, 13] > 1
  assert v["(b2) TIS lower variance than untruncated IS"] == "shown"
  assert v["(c) bf16 sampler lowers the lag-0 cosine"] == "not shown"      # overlapping
  assert v["(d) lag-aware TIS closer to g* than fixed TIS (cosine)"] == "not shown"  # +-0.01
  assert not any(k.startswith("(b4)") for k in v)  # no CISPO row: skipped, not invented
  assert not any(k.startswith("(b2) TIS lower error") for k in v)  # IS has no per-batch data
  md = fidelity_report.markdown(table, fidelity_report.claims(table))
  assert "| lag | 8 | tis |" in md
  fidelity_report.plot(table, str(tmp_path / "f.png"))
  assert (tmp_path / "f.png").stat().st_size > 0


def test_reference_free_claims():
  """[rf] verdicts from per-batch energies and jackknife pseudo-values (no g*)."""
  def free(obj, lag, energy, mse, bias2):
    r = _row("lag", lag, obj, (0.5, 0.4, 0.6))
    r["per_batch"] = dict(energy=list(energy), mse=list(mse), bias2=list(bias2))
    return r
  e_nc = [1.0, 2.0, 0.0, 4.0]  # batch 3: every group had equal rewards (no gradient)
  rows = [free("no_correction", 1, e_nc, [1.0] * 4, [0.1, 0.0, -0.1, 0.05]),
          free("untruncated_is", 1, [1.1, 2.1, 0.0, 4.5], [1.0] * 4, [0.0] * 4),
          free("no_correction", 16, e_nc, [5.0, 6.0, 5.5, 6.5], [1.0, 1.2, 0.9, 1.1]),
          free("untruncated_is", 16, [8.0, 30.0, 0.0, 20.0], [9.0, 12.0, 8.0, 10.0], [0.0] * 4),
          free("tis", 16, [2.0, 3.0, 0.0, 5.0], [3.0, 3.5, 2.5, 3.2], [0.2, 0.3, 0.25, 0.3])]
  rows[3]["ess"] = [0.6, 0.5, 0.7]  # untruncated IS at lag 16 (lag 1: [0.4, 0.6]: overlaps)
  got = {c["claim"]: c for c in fidelity_report.claims(dict(rows=rows))}
  assert got["(b1) importance-weight ESS falls with lag (largest lag vs lag 1)"][
      "verdict"] == "not shown"
  assert "(b1) importance-ratio variance grows with lag (largest lag vs lag 1)" not in got
  assert got["(a) [rf] TIS lower MSE than no correction"]["verdict"] == "shown"
  assert got["(a) [rf] no correction is biased against IS"]["verdict"] == "shown"
  inflate = got["(b1) [rf] untruncated IS inflates the per-batch energy over no correction"]
  assert inflate["verdict"] == "shown" and inflate["wins"][0] == 1.0  # 3 batches, zero skipped
  np.testing.assert_allclose(inflate["difference"][0], np.mean(np.log([8.0, 15.0, 5.0])))
  grows = got["(b1) [rf] that inflation grows with lag (largest lag vs lag 1)"]
  assert grows["verdict"] == "shown" and grows["second"]["lag"] == 1
  assert got["(b2) [rf] TIS lower MSE than untruncated IS"]["verdict"] == "shown"
  assert got["(b3) [rf] TIS is biased against untruncated IS (the price)"]["verdict"] == "shown"
  assert not any("CISPO" in k or "bf16" in k for k in got)  # not measured: not invented
  assert "| (b2) [rf] TIS lower MSE" in fidelity_report.markdown(
      dict(rows=rows), list(got.values()))


def test_instrument_config_validation():
  with pytest.raises(ValueError, match="batches"):
    fidelity_run.InstrumentConfig(batches=1)
  c = fidelity_run.InstrumentConfig(lags=(0, 4), mixed_lags=(2,), num_targets=2,
                                    target_stride=3)
  assert c.train_steps == 7 and c.targets() == [7, 4]


@pytest.mark.slow
def test_tiny_instrument_end_to_end():
  """Own 1-step run, one target, lags 0 and 1, two objectives: finite metrics in range."""
  run = stress.stress_config(tiny=True)
  run = dataclasses.replace(run, pipeline=dataclasses.replace(run.pipeline, group_size=4))
  cfg = fidelity_run.InstrumentConfig(lags=(0, 1), mixed_lags=(), num_targets=1, batches=2,
                                      true_batches=2, bf16_case=False)
  s = fidelity_run.make_setup(run)
  ckpts = fidelity_run.train_checkpoints(s, cfg.train_steps, 0, log=lambda *_: None)
  assert len(ckpts) == 2
  batch = fidelity_run.sample_batch(s, ckpts, [0, 1], np.random.default_rng(0), 3)
  m = batch["loss_mask"] > 0
  assert set(np.unique(batch["policy_versions"][m])) <= {0, 1}
  objs = {"no_correction": ObjectiveConfig(name="no_correction"),
          "tis": ObjectiveConfig(name="tis_pg")}
  table = fidelity_run.measure(s, ckpts, cfg, objs, log=lambda *_: None)
  assert {(r["lag"], r["objective"]) for r in table["rows"]} == {
      (k, o) for k in (0, 1) for o in objs}
  for r in table["rows"]:
    assert -1 <= r["cosine"][0] <= 1 and r["trace_var"][0] >= 0
    assert 0 < r["ess"][0] <= 1 + 1e-6
  json.dumps(table, default=float)


def test_pareto_interpolates_fidelity_at_mean_token_lag(tmp_path):
  from lib import fidelity_pareto
  table = dict(rows=[_row("lag", 0, "tis", (1.0, 0.9, 1.1)), _row("lag", 4, "tis", (0.6, 0.5, 0.7)),
                     _row("lag", 4, "no_correction", (0.2, 0.1, 0.3))])
  assert fidelity_pareto.fidelity_at(table["rows"], "tis", 1.0) == pytest.approx([0.9, 0.8, 1.0])
  assert fidelity_pareto.fidelity_at(table["rows"], "tis", 5.0) is None  # beyond measured lags
  sweep = [dict(max_lag="4", objective="tis_pg", samples_per_device_s=10.0,
                samples_per_device_s_ci=0.1, token_lag_mean=3.0, heldout_end=0.4,
                heldout_end_ci=0.1, throughput_clock="virtual (measured cost model)"),
           dict(max_lag="0", objective="no_correction", samples_per_device_s=7.0,
                token_lag_mean=0.0)]
  path = tmp_path / "s.json"
  path.write_text(json.dumps(sweep))
  rows = fidelity_pareto.write(table, str(path), str(tmp_path / "pareto"))
  assert rows[0]["objective"] == "tis" and rows[0]["cosine"] == pytest.approx([0.7, 0.6, 0.8])
  assert rows[1]["cosine"] is None  # no lag-0 row for no correction: nothing invented
  assert (tmp_path / "pareto.png").exists()


@pytest.mark.slow
def test_precision_mismatch_small_shape():
  """bf16 vs fp32 on a small Qwen3-like shape: finite, calibrated entropy, ratios near 1."""
  from lib import precision_mismatch as pm
  cfg = dataclasses.replace(pm.qwen3_reduced(), vocab_size=512, d_model=32, n_heads=2,
                            n_kv_heads=1, head_dim=16, d_ff=64, max_seq_len=16)
  out = pm.measure(cfg, rows=1, positions=8, target_entropy=2.0)
  assert abs(out["fp32_entropy_mean"] - 2.0) < 0.3
  assert 0 < out["abs_logp_mismatch_mean"] < 0.1 and 0.9 < out["ess"] <= 1.0


def test_sign_test_is_exact_binomial():
  from lib import fidelity_report as fr
  a = dict(per_batch=dict(sq_error=[1.0] * 8))
  b = dict(per_batch=dict(sq_error=[2.0] * 7 + [0.5]))
  wins = fr._sign_test(a, b, "sq_error", -1)  # a lower on 7 of 8
  assert wins.value == 7 / 8
  assert wins.low == pytest.approx(0.4734903, abs=1e-6)  # Clopper-Pearson 95%, 7/8


def test_merge_tables_refuses_a_row_measured_twice():
  a = dict(rows=[_row("lag", 0, "tis", (0.5, 0.4, 0.6))], truth=[{"version": 72}], config={})
  b = dict(rows=[_row("lag", 8, "tis", (0.5, 0.4, 0.6))], truth=[{"version": 72}], config={})
  m = fidelity_report.merge([a, b])
  assert [r["lag"] for r in m["rows"]] == [0, 8] and len(m["sources"]) == 2
  with pytest.raises(ValueError, match="in two tables"):
    fidelity_report.merge([a, a])


def test_plot_draws_non_positive_intervals_on_log_axes(tmp_path):
  """A reference-free MSE can be estimated <= 0 (a near-zero gradient); the log panels draw it."""
  rows = []
  for lag, mse in ((0, [1.0, 0.5, 1.5]), (8, [-0.01, -0.03, 0.02]), (16, [0.5, -0.1, 1.1])):
    r = _row("lag", lag, "tis", (0.5, 0.4, 0.6))
    r.update(energy=[1.0, 0.5, 1.5], mse=mse)
    rows.append(r)
  fidelity_report.plot(dict(rows=rows), str(tmp_path / "f.png"))
  assert (tmp_path / "f.png").stat().st_size > 0
