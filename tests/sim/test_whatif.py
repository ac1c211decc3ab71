"""What-if on the analytic accelerator cost model (hand-computed numbers) and a tiny sweep."""

import dataclasses

import pytest

from rlax_pipe.sim import whatif


def test_cost_model_numbers():
  c = whatif.Cluster(workload=whatif.Workload(completion_sigma=0.0))  # every completion 2048
  shape = c.shape
  assert shape.kv_bytes_per_token == 131072  # 2 * 32 layers * 8 heads * 128 dims * 2 bytes
  # Slots: (0.9 * 80e9 - weights) / (131072 * (512 + 2048)).
  assert whatif.engine_slots(c) == int((0.9 * 80e9 - shape.weight_bytes) // (131072 * 2560))
  m = whatif.costs(c, 8)
  assert m.decode_step_s == pytest.approx(shape.weight_bytes / (3.35e12 * 0.8))
  assert m.token_step_s == pytest.approx(131072 / (3.35e12 * 0.8))
  # Pushes: bf16 weights over NVLink (900 GB/s) at 50% + 5 ms.
  assert m.push(int(shape.weight_bytes)) == pytest.approx(0.005 + shape.weight_bytes / 450e9,
                                                          rel=1e-6)
  # 16 bytes/param * N / (0.7 * 80e9) devices at least.
  assert whatif.min_learner_devices(c) == -(-16 * shape.matmul_params // (0.7 * 80e9))


def test_small_sweep_and_report(tmp_path):
  c = whatif.Cluster(num_devices=16, workload=dataclasses.replace(
      whatif.Workload(), groups_per_step=4, group_size=8, mean_completion_tokens=512,
      max_completion_tokens=4096))
  out = whatif.report(c, [("sync", 0, "block"), ("pipeline", 2, "block")],
                      learner_devices=[4, 8, 12],
                      num_steps=8, warmup_steps=2, png_path=str(tmp_path / "split.png"))
  assert (tmp_path / "split.png").exists()
  assert len(out["rows"]) == 6 and len(out["best"]) == 2
  best = {r["driver"]: r for r in out["best"]}
  assert best["pipeline"]["tokens_per_s"] > best["sync"]["tokens_per_s"]
  assert 0 < out["sync_idle"]["device_idle"] < 1
  assert all(r["token_lag_max"] <= 2 for r in out["rows"])
  assert out["cost_model"]["source"].startswith("analytic")
  with pytest.raises(ValueError):
    whatif.sim_config(c, 2, "pipeline", 1)  # below the FSDP minimum of 3 devices
