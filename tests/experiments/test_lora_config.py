"""LoRA from the entry point: `--config.learner.lora.*` overrides, validation naming the flag."""

import pytest

from rlax_pipe.config import LoraConfig

from test_configs import RL_FILE, _parse  # pylint: disable=wrong-import-order


def test_lora_fields_are_selectable_from_the_command_line():
  assert _parse([]).learner.lora == LoraConfig()  # off by default
  cfg = _parse([f"--config={RL_FILE}:tiny", "--config.learner.lora.rank=4",
                "--config.learner.lora.alpha=8.0",
                "--config.learner.lora.target_modules=('wq', 'wv')"])
  assert cfg.learner.lora == LoraConfig(rank=4, alpha=8.0, target_modules=("wq", "wv"))
  hash(cfg.learner)
  with pytest.raises(ValueError, match="--config.learner.lora.rank=-2"):
    _parse(["--config.learner.lora.rank=-2"])
