"""Rules of a `RunConfig` that need the model or the file system, checked when the job is built.

`config_checks` relates fields to each other when the config is built (no model, no files);
`check_job_settings(cfg, model)` runs in `job.build_job` before any device work, so that a
mistake found here ends the run at startup with one line naming the `--config.` field and the
fix (`ConfigError`), not with a traceback mid-run or after training: LoRA targets and rank
against the model's weights, the KL reference directory, and whether LoRA adapters can also be
exported in PEFT format.
"""

from __future__ import annotations

import pathlib

from absl import logging

from rlax_pipe.config import LoraConfig
from rlax_pipe.config_dict import ConfigError, name_fields
from rlax_pipe.model import lora as lora_lib
from rlax_pipe.model import lora_hf


def check_job_settings(cfg, model) -> None:
  """The rules that need the model or the file system, checked when the job is built (before
  any device work): LoRA's targets and rank against the model's weights, the KL reference
  directory, and whether LoRA adapters can also be exported in PEFT format.

  Args:
    cfg: the `RunConfig`.
    model: the learner's `rlax_pipe.model.Model`.

  Raises:
    ConfigError: a LoRA target that matches no weight matrix or a rank above a targeted
      matrix's width (naming `RunConfig.learner.lora.<field>`), or a KL reference that is not
      an HF model directory (`RunConfig.objective.kl_reference`).
  """
  lora = None
  if cfg.learner.lora.enabled:
    try:
      lora = lora_lib.LoraAdapters(model, cfg.learner.lora)
    except ValueError as e:
      raise ConfigError(name_fields(str(e), LoraConfig, "RunConfig.learner.lora.")) from None
  o = cfg.objective
  if o.kl != "off" and o.kl_reference is not None:
    path = pathlib.Path(o.kl_reference)
    if not (path / "config.json").is_file():
      what = "does not exist" if not path.exists() else "holds no config.json"
      raise ConfigError(
          f"RunConfig.objective.kl_reference={o.kl_reference!r}: the directory {what}; pass an "
          "HF model directory (config.json + *.safetensors) of the same architecture, or leave "
          "it unset to use the initial params as the KL reference.")
  if lora is not None and cfg.export_hf:
    # Decided: a warning, not an error. Training with such a target is fine and hf/ (the merged
    # policy) is still exported; only hf_lora/ (the PEFT adapter directory) is skipped.
    problem = lora_hf.peft_export_problem(lora)
    if problem is not None:
      logging.warning("RunConfig.learner.lora.target_modules=%s: run_dir/hf_lora/ will not be "
                      "written at the end (%s); run_dir/hf/ gets the merged policy.",
                      cfg.learner.lora.target_modules, problem)
