"""A LoRA RL job end to end (reproducible pipeline driver): adapters-only pushes counted in the
metrics, bounded lag, the merged HF export and the PEFT adapter directory at the end."""

import dataclasses
import json

import numpy as np

from rlax_pipe.config import LoraConfig
from rlax_pipe.model import transformer
from rlax_pipe.pipeline import run as run_lib


def test_lora_job_pushes_adapters_and_exports_both_forms(tmp_path, tiny_init, tiny_config,
                                                         train_rows):
  cfg = tiny_config(tmp_path, tiny_init, steps=2)
  cfg = dataclasses.replace(cfg, learner=dataclasses.replace(
      cfg.learner, lora=LoraConfig(rank=2, alpha=4.0, target_modules=("wq", "wv"))))
  summary = run_lib.run(cfg)
  rows = train_rows(cfg.run_dir)
  assert [r["version"] for r in rows] == [1, 2] and summary["steps"] == 2
  assert all(r["token_lag_max"] <= 1 for r in rows)
  model_cfg = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
  d, h, k, hd, n = (model_cfg["hidden_size"], model_cfg["num_attention_heads"],
                    model_cfg["num_key_value_heads"], model_cfg["head_dim"],
                    model_cfg["num_hidden_layers"])
  adapter_bytes = 4 * n * 2 * (d + h * hd + d + k * hd)  # float32 A [2, d] + B [out, 2]
  assert [r["push_bytes"] for r in rows] == [adapter_bytes] * 2
  peft_cfg = json.loads((tmp_path / "run" / "hf_lora" / "adapter_config.json").read_text())
  assert peft_cfg["r"] == 2 and sorted(peft_cfg["target_modules"]) == ["q_proj", "v_proj"]
  assert (tmp_path / "run" / "hf" / "model.safetensors").exists()
