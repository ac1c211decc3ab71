"""What-if cost model (hand-computed numbers) and a tiny sweep."""

import dataclasses

import pytest

from rlax_pipe.sim import whatif


def test_cost_model_numbers():
  c = whatif.Cluster()
  # Llama-3-8B KV: 2 * 32 layers * 8 heads * 128 dims * 2 bytes = 131072 bytes per token.
  assert c.model.kv_bytes_per_token == 131072
  # Slots: (0.9 * 80e9 - 16e9) / (131072 * (512 + 2048)) = 56e9 / 335544320 = 166.9 -> 166.
  assert whatif.engine_slots(c) == 166
  curve = whatif.decode_curve(c)
  # 2 ms + 16e9 / 3.35e12 = 6.776 ms; per slot 335544320 / 3.35e12 = 0.1002 ms.
  assert curve.base_s == pytest.approx(0.002 + 16e9 / 3.35e12)
  assert curve.per_slot_s == pytest.approx(335544320 / 3.35e12)
  # Memory-bound at the engine's full batch: compute 2 * 8e9 / (989e12 * 0.5) = 32 us per slot.
  assert curve.latency(166) == pytest.approx(curve.base_s + 166 * curve.per_slot_s)
  # Learner: 0.4 * 989e12 / 48e9 = 8241.7 tokens/s per device.
  assert whatif.learner_tokens_per_s(c, 2) == pytest.approx(2 * 0.4 * 989e12 / 48e9)
  # 16 bytes/param * 8e9 / (0.7 * 80e9) = 2.29 -> 3 devices.
  assert whatif.min_learner_devices(c) == 3
  assert whatif.costs(c, 8).push_s == pytest.approx(16e9 / 50e9)


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
  assert all(r["lag_max"] <= 2 for r in out["rows"])
  with pytest.raises(ValueError):
    whatif.sim_config(c, 2, "pipeline", 1)  # below the FSDP minimum of 3 devices
