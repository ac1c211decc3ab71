"""PEFT-format export of the built-in model's LoRA adapters (an `adapter_config.json` directory).

`save_peft_adapter` writes what `peft.PeftModel.from_pretrained(base_hf_model, path)` loads:
`adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules as HF module names) and
`adapter_model.safetensors` with, per adapted HF Linear `<module>` of every layer,
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. PEFT applies
W x + (lora_alpha / r) B (A x) (Hu et al. 2021, eq. 3), the same update as
`LoraAdapters.merge`, so the adapted HF model gives the logits of the merged built-in model.

Layouts: our A [L, r, *In] / B [L, *Out, r] flatten In / Out row-major, exactly as `hf_io`
flattens a weight's input / output axes into HF's [out, in] (e.g. wo [H, D, E]: In = (H, D) ->
o_proj's H*D inputs), so layer i's A is `A[i].reshape(r, I)` and its B `B[i].reshape(O, r)`.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any, Mapping

import jax
import numpy as np

from rlax_pipe.model import builtin
from rlax_pipe.model import hf_io
from rlax_pipe.model.lora import A_NAME, B_NAME, LoraAdapters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def _hf_module(spec_path: tuple[str, ...]) -> tuple[str, int, bool]:
  """(HF module name with "{i}" for the layer, number of input axes, per-layer) of a weight.

  Raises:
    ValueError: for a weight with no HF Linear counterpart (the embedding, norms).
  """
  if spec_path[0] == "layers" and len(spec_path) == 2:
    hf, kind = hf_io.LAYER_TENSORS[spec_path[1]]
    per_layer = True
    hf = f"model.layers.{{i}}.{hf}"
  else:
    top = hf_io.TOP_TENSORS
    hf, kind = top.get(spec_path[0], (None, None))
    per_layer = False
  if not isinstance(kind, int) or not hf.endswith(".weight"):
    raise ValueError(f"LoRA on {'/'.join(spec_path)} has no PEFT export (not an HF Linear "
                     "weight); export the merged params instead (`Learner.merged_params`).")
  return hf[:-len(".weight")], kind, per_layer


def peft_export_problem(lora: LoraAdapters) -> str | None:
  """Why `save_peft_adapter` cannot write these adapters, or None when it can.

  Checked before training (the job warns at startup: the run trains and exports the merged
  policy, only the PEFT adapter directory is skipped), so the export itself needs no try.

  Returns:
    None, or one sentence: the model is not the built-in Transformer, or an adapted weight
    (e.g. the embedding) has no HF Linear counterpart that PEFT could adapt.
  """
  if not isinstance(lora.model, builtin.Transformer):
    return (f"PEFT export needs the built-in Transformer, not {type(lora.model).__name__}; "
            "export the merged params instead")
  for spec in lora.specs:
    try:
      _hf_module(spec.path)
    except ValueError as e:
      return str(e)
  return None


def save_peft_adapter(path: str | os.PathLike, adapters: Mapping[str, Any], lora: LoraAdapters,
                      *, base_model_name_or_path: str | None = None) -> list[pathlib.Path]:
  """Writes the adapters of a built-in model as a PEFT LoRA adapter directory.

  Args:
    path: target directory (created); must not hold an adapter already.
    adapters: host or device adapters tree (`LoraAdapters.abstract_params()` layout).
    lora: the adapter space; its model must be the built-in `Transformer`.
    base_model_name_or_path: recorded in adapter_config.json (e.g. the HF directory the base
      was loaded from); None = "".

  Returns:
    The two paths written.

  Raises:
    TypeError: if `lora.model` is not the built-in `Transformer`.
    ValueError: for an adapted weight without an HF Linear counterpart.
    FileExistsError: if `path` already holds an adapter_config.json.

  Example:
    >>> save_peft_adapter("out/lora", jax.device_get(learner.params), learner.lora)
    >>> # torch: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "out/lora")
  """
  if not isinstance(lora.model, builtin.Transformer):
    raise TypeError(f"save_peft_adapter needs the built-in Transformer, got "
                    f"{type(lora.model).__name__}; export the merged params instead.")
  path = pathlib.Path(path)
  if (path / ADAPTER_CONFIG).exists():
    raise FileExistsError(f"{path} already holds a PEFT adapter ({ADAPTER_CONFIG}).")
  adapters = jax.tree.map(np.asarray, jax.device_get(dict(adapters)))
  r, tensors, modules = lora.cfg.rank, {}, []
  for spec in lora.specs:
    module, _, per_layer = _hf_module(spec.path)
    i_width, o_width = math.prod(spec.in_shape), math.prod(spec.out_shape)
    a, b = adapters[spec.name][A_NAME], adapters[spec.name][B_NAME]
    layers = range(spec.shape[0]) if per_layer else [None]
    for i in layers:
      name = _PREFIX + (module.format(i=i) if per_layer else module)
      ai, bi = (a, b) if i is None else (a[i], b[i])
      tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(ai.reshape(r, i_width))
      tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(bi.reshape(o_width, r))
    modules.append(module.rsplit(".", 1)[-1])
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": lora.cfg.alpha,
      "target_modules": sorted(set(modules)), "lora_dropout": 0.0, "bias": "none",
      "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
      "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
      "base_model_name_or_path": base_model_name_or_path or "",
  }
  path.mkdir(parents=True, exist_ok=True)
  from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  st_numpy.save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
  (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  return [path / ADAPTER_WEIGHTS, path / ADAPTER_CONFIG]
