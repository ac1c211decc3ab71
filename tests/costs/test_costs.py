"""Cost model: exact virtual time, the fit (against closed-form OLS formulas), the chip table and
the analytic accelerator model."""

import math

import numpy as np
import pytest

from rlax_pipe import costs
from rlax_pipe.costs import fit as fit_lib
from rlax_pipe.costs.model import QUANTUM


def test_durations_are_quantized_and_coefficients_checked():
  m = costs.CostModel(push_s=0.0123456789, push_byte_s=2.2e-12)
  d = m.push(16 * 10**9)
  assert d / QUANTUM == round(d / QUANTUM)
  assert d == pytest.approx(0.0123456789 + 2.2e-12 * 16e9, abs=QUANTUM)
  with pytest.raises(ValueError, match="push_s"):
    costs.CostModel(push_s=-1.0)


@pytest.mark.parametrize("floor", [0.0, 3e-3, 1.0])
def test_decode_run_equals_the_engine_steps_bit_for_bit(floor):
  # The simulator's vectorised run and the driver's step-by-step durations agree exactly,
  # including a run that crosses from the compute floor into the memory-bound regime, and their
  # sums are exact whatever the order.
  m = costs.CostModel(engine_step_s=1.3e-4, install_s=2e-4, dispatch_s=7e-5, decode_step_s=1.1e-3,
                      slot_step_s=3.3e-5, token_step_s=2.7e-7, flop_slot_step_s=floor / 8)
  for n, active, live0, k in [(1, 8, 100, 1), (17, 8, 40, 1), (300, 3, 1, 1), (64, 8, 5000, 1),
                              (20, 5, 300, 8)]:
    run = m.decode_run(n, active, live0, installs_first=1, steps=k)
    t = 5.0
    for i in range(n):
      live = sum(live0 + active * k * i + active * j for j in range(k))  # live tokens per step
      _, rest = m.engine_step(costs.EngineStep(installs=int(i == 0), dispatches=1, decode_steps=k,
                                               slot_steps=active * k, live_token_steps=live))
      assert rest == run[i]
      t += rest
    assert t == 5.0 + float(run.sum()) == 5.0 + float(run[::-1].sum())


def test_fit_matches_closed_form_simple_regression():
  # y = a + b x + noise: slope and intercept standard errors of simple regression
  # (se_b = s / sqrt(Sxx), se_a = s sqrt(1/n + xbar^2 / Sxx)) and t-based 95% intervals.
  rng = np.random.default_rng(0)
  x = rng.integers(1, 200, 60).astype(float)
  y = 0.01 + 2e-4 * x + rng.normal(0, 1e-3, 60)
  coefs, op = fit_lib.fit_ols({"a": np.ones(60), "b": x}, y)
  sxx = ((x - x.mean()) ** 2).sum()
  b = ((x - x.mean()) * (y - y.mean())).sum() / sxx
  a = y.mean() - b * x.mean()
  s = math.sqrt(((y - a - b * x) ** 2).sum() / 58)
  assert coefs["b"].estimate == pytest.approx(b, rel=1e-9)
  assert coefs["a"].estimate == pytest.approx(a, rel=1e-9)
  assert coefs["b"].std_err == pytest.approx(s / math.sqrt(sxx), rel=1e-9)
  assert coefs["a"].std_err == pytest.approx(s * math.sqrt(1 / 60 + x.mean() ** 2 / sxx),
                                             rel=1e-9)
  t = 2.0017  # t_{0.975, 58}
  lo, hi = coefs["b"].ci95
  assert (hi - lo) / 2 == pytest.approx(t * coefs["b"].std_err, rel=1e-3)
  assert lo < 2e-4 < hi and op.n == 60 and op.r2 > 0.9


def test_fit_reports_aliased_unobserved_and_negative():
  rng = np.random.default_rng(1)
  rec = costs.CostRecorder()
  for _ in range(40):  # one decode step per dispatch: dispatches == decode_steps
    slots = int(rng.integers(1, 64))
    rec.record("engine_step", 0.002 + 1e-4 * slots + rng.normal(0, 1e-5), dispatches=1,
               decode_steps=1, slot_steps=slots, live_token_steps=slots * 50,
               prefill_tokens=int(rng.integers(0, 30)))
  fit = costs.fit_cost_model(rec.records(), source="test")
  c = fit.coefficients
  assert c["decode_step_s"].status == "aliased with engine_step_s"
  assert c["dispatch_s"].status.startswith("aliased")
  assert c["install_s"].status == "not observed"
  assert c["train_step_s"].status == "not observed"
  # live_token_steps = 50 * slot_steps: aliased with slot_step_s, which keeps the time.
  assert c["token_step_s"].status.startswith("aliased")
  assert c["slot_step_s"].estimate == pytest.approx(1e-4, rel=0.02)
  # prefill tokens cost nothing here: an estimate below 0 is dropped, never kept negative.
  assert c["prefill_token_s"].estimate >= 0
  m = fit.cost_model
  assert sum(m.engine_step(costs.EngineStep(dispatches=1, decode_steps=1, slot_steps=10,
                                            live_token_steps=500))) == pytest.approx(
                                                0.003, rel=0.02)
  assert m.source == "test"


def test_fit_round_trip(tmp_path):
  rec = costs.CostRecorder()
  for i in range(10):
    rec.record("push", 0.004 + 1e-3 * (i % 3), bytes=1000)
    rec.record("train_step", 0.1 + 1e-5 * 256 * (i + 1), tokens=256 * (i + 1), micro_batches=1)
  rec.to_jsonl(tmp_path / "r.jsonl")
  fit = costs.fit_cost_model(costs.read_records(tmp_path / "r.jsonl"), source="x")
  assert fit.coefficients["push_byte_s"].status.startswith("aliased")  # bytes never vary
  assert fit.cost_model.push(1000) == pytest.approx(0.0049, rel=1e-6)  # mean of i % 3 is 0.9
  assert fit.cost_model.train_token_s == pytest.approx(1e-5, rel=1e-6)
  fit.save(tmp_path / "fit.json")
  assert costs.load_cost_model(tmp_path / "fit.json") == fit.cost_model


def test_chip_table_and_lookup():
  assert costs.chip("h200").hbm_bandwidth == 4.8e12
  assert costs.chip_for_device("NVIDIA H100 PCIe").name == "H100-PCIe"
  assert costs.chip_for_device("NVIDIA H100 80GB HBM3").name == "H100"
  assert costs.chip_for_device("TPU v5 lite").name == "TPU-v5e"
  assert costs.chip_for_device("cpu") is None
  assert costs.chip_for_device("NVIDIA L40S") is None  # not an L4
  assert costs.chip_for_device("NVIDIA L4").name == "L4"
  assert costs.chip_for_device("TPU v5p").name == "TPU-v5p"
  assert costs.chip_for_device("NVIDIA A100-SXM4-80GB").name == "A100-80GB"
  assert costs.chip_for_device("NVIDIA H200").name == "H200"
  with pytest.raises(KeyError, match="known"):
    costs.chip("B9000")


def test_learner_mfu_peak_reads_the_chip_table():
  # The learner's MFU peak comes from the one table (data-sheet values: H200 dense bf16 989.5
  # TFLOP/s = 1,979 "with sparsity" / 2; A100 312 dense).
  from rlax_pipe.learner import flops  # pylint: disable=g-import-not-at-top
  assert flops.peak_tflops("NVIDIA H200")[0] == 989.5
  assert flops.peak_tflops("NVIDIA A100-SXM4-80GB")[0] == 312.0
  peak, why = flops.peak_tflops("Some NPU")
  assert peak is None and "--peak_tflops" in why


def test_analytic_model_of_llama3_8b_on_h200():
  shape = costs.ModelShape.of(costs.LLAMA_3_8B, "llama-3-8b")
  # Llama-3-8B: 32 x (4096*4096*2 + 2*4096*1024 + 3*4096*14336) + 4096*128256 matmul params.
  n = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 4096 * 128256
  assert shape.matmul_params == n
  assert shape.weight_bytes == 2 * (n + 4096 * 128256)  # untied embedding stored too
  assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
  m = costs.analytic_cost_model(shape, "H200", sampler_tp=1, learner_devices=4,
                                train_row_len=4096)
  assert m.decode_step_s == pytest.approx(shape.weight_bytes / (4.8e12 * 0.8), rel=1e-6)
  assert m.train_token_s == pytest.approx(
      (6 * n + 12 * 32 * 32 * 128 * 4096) / (4 * 989.5e12 * 0.4), rel=1e-6)
  assert m.source.startswith("analytic: llama-3-8b on H200")
  slots = costs.kv_limited_slots(shape, "H200", 1, tokens_per_slot=2048)
  assert slots == int((0.9 * 141e9 - shape.weight_bytes) // (131072 * 2048))
  with pytest.raises(ValueError, match="raise sampler_tp"):
    costs.analytic_cost_model(shape, "TPU-v5e", sampler_tp=1, learner_devices=1, train_row_len=1)


def test_records_overlapping_a_compile_are_left_out():
  rec = costs.CostRecorder()
  for i in range(20):  # one record per second; step 3..5 overlaps a 2.5 s compile
    rec.record("push", 0.01 if i not in (3, 4, 5) else 3.0, start_s=float(i), bytes=10)
  rec.add_compile(3.5, 6.0)
  flagged = [r.start_s for r in rec.records() if r.features.get("compiles")]
  assert flagged == [3.0, 4.0, 5.0]
  fit = costs.fit_cost_model(rec.records(), source="x")
  assert fit.cost_model.push_s == pytest.approx(0.01) and fit.ops["push"].excluded == 3
