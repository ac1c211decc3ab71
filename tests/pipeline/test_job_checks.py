"""Startup validation of settings that would otherwise fail mid-run, after training, or be
silently ignored: each a `ConfigError` naming the `--config.` field and the fix (the entry point
prints it as one line), or a startup warning where training itself is fine."""

import dataclasses
import logging

import pytest

from rlax_pipe import objectives
from rlax_pipe.config import ModelConfig, LoraConfig
from rlax_pipe.config_dict import ConfigError
from rlax_pipe.model import Transformer, lora as lora_lib, lora_hf
from rlax_pipe.pipeline import job as job_lib
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.pipeline.config import PipelineConfig
from rlax_pipe.pipeline.group_filter import GroupFilterConfig

MODEL = Transformer(ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                head_dim=8, d_ff=32, max_seq_len=16))


def _run_cfg(**kw):
  return dataclasses.replace(run_lib.RunConfig(), **kw)


def _with_lora(cfg, **lora):
  return dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, lora=LoraConfig(**lora)))


def test_lora_targets_and_rank_are_checked_against_the_model_at_startup():
  cfg = _run_cfg()
  with pytest.raises(ConfigError, match=r"^RunConfig\.learner\.lora\.target_modules \['q_proj'\] "
                                        r"match no weight matrix.*layers/wq"):
    job_lib.check_job_settings(_with_lora(cfg, rank=2, target_modules=("q_proj",)), MODEL)
  with pytest.raises(ConfigError, match=r"^RunConfig\.learner\.lora\.rank=9 exceeds the smallest "
                                        r"width 8 .* use rank <= 8"):
    job_lib.check_job_settings(_with_lora(cfg, rank=9, target_modules=("wk",)), MODEL)
  job_lib.check_job_settings(_with_lora(cfg, rank=8, target_modules=("wk",)), MODEL)
  job_lib.check_job_settings(cfg, MODEL)  # LoRA off: nothing to check


def test_a_missing_kl_reference_directory_is_named_at_startup(tmp_path):
  cfg = _run_cfg()
  for path, what in ((tmp_path / "nope", "does not exist"), (tmp_path, "holds no config.json")):
    bad = dataclasses.replace(cfg, objective=dataclasses.replace(
        cfg.objective, kl="loss", kl_coef=0.01, kl_reference=str(path)))
    with pytest.raises(ConfigError, match=rf"^RunConfig\.objective\.kl_reference='{path}': the "
                                          rf"directory {what}; pass an HF model directory"):
      job_lib.check_job_settings(bad, MODEL)


def test_lora_the_peft_format_cannot_express_warns_at_startup(caplog):
  """Decided: a warning (training and the merged hf/ export are fine; hf_lora/ is skipped)."""
  embed = lora_lib.LoraAdapters(MODEL, LoraConfig(rank=2, target_modules=("embed", "wq")))
  assert "has no PEFT export" in lora_hf.peft_export_problem(embed)
  assert lora_hf.peft_export_problem(
      lora_lib.LoraAdapters(MODEL, LoraConfig(rank=2, target_modules=("wq", "w_down")))) is None
  cfg = _with_lora(_run_cfg(), rank=2, target_modules=("embed", "wq"))
  with caplog.at_level(logging.WARNING):
    job_lib.check_job_settings(cfg, MODEL)
  assert "hf_lora/ will not be written" in caplog.text and "embed" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    job_lib.check_job_settings(dataclasses.replace(cfg, export_hf=False), MODEL)
  assert "hf_lora" not in caplog.text


@pytest.mark.parametrize("lora,named", [
    (dict(alpha=32.0), "alpha=32.0"), (dict(target_modules=("wq",)), "target_modules=('wq',)")])
def test_lora_fields_set_with_lora_off_are_rejected(lora, named):
  with pytest.raises(ConfigError, match=rf"RunConfig\.learner\.lora\.{re_escape(named)} set with "
                                        r"RunConfig\.learner\.lora\.rank=0 \(LoRA off\)"):
    _with_lora(_run_cfg(), rank=0, **lora)
  _with_lora(_run_cfg(), rank=4, **lora)  # with LoRA on they are used


def re_escape(s):
  import re  # pylint: disable=import-outside-toplevel
  return re.escape(s)


def test_filter_bound_set_with_the_filter_off_is_rejected():
  cfg = _run_cfg()
  pipe = lambda **kw: dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, **kw))
  with pytest.raises(ConfigError, match=r"RunConfig\.pipeline\.filter_max_dropped_per_step=8 set "
                                        r"with RunConfig\.pipeline\.filter_groups='off'"):
    pipe(filter_max_dropped_per_step=8)
  pipe(filter_max_dropped_per_step=8, filter_groups="zero_variance")


def test_group_filter_errors_lead_with_the_config_field():
  with pytest.raises(ValueError, match=r"^--config\.pipeline\.filter_groups='zero' "
                                       r"\(GroupFilterConfig\.mode\): choose one of"):
    GroupFilterConfig(mode="zero")
  with pytest.raises(ValueError, match=r"^--config\.pipeline\.filter_max_dropped_per_step=0"):
    PipelineConfig(filter_groups="zero_variance", filter_max_dropped_per_step=0)
