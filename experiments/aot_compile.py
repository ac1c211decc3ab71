"""Compiles every device program of a preset for a TPU topology on a machine without a TPU
(issue #28; needs libtpu: pip install 'libtpu==0.0.42.*'). One JSON line per program:
compiled or the compiler's error, bytes per device against the chip's HBM, cost, collectives.

  python3 experiments/aot_compile.py --topology=v5e:2x2 --model=tiny
  python3 experiments/aot_compile.py --topology=v5e:2x4 --model=qwen3-0.6b --sampler_tp=1
  python3 experiments/aot_compile.py --topology=v5p:2x2x1 --model=llama-3.1-8b --roles=learner
  python3 experiments/aot_compile.py --topology=v5e:2x4 --model=qwen3-0.6b --roles=reshard \
      --reshard_learner_mesh=fsdp:4 --reshard_sampler_mesh=tp:4
  python3 experiments/aot_compile.py ... --hlo_dir=/tmp/hlo   # also save each program's HLO
  python3 experiments/aot_compile.py --reread=/tmp/hlo/a.hlo.txt,...  # re-count, no compile

Compiled for TPU, not run: no number printed is a timing.
"""

import dataclasses
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the runtime stays on CPU; libtpu compiles only

# pylint: disable=wrong-import-position
from absl import app
from absl import flags

from lib import aot_runs
from rlax_pipe import aot
from rlax_pipe.run_dir import to_jsonable
from rlax_pipe.sampler.config import SamplerConfig

_TOPOLOGY = flags.DEFINE_string("topology", "v5e:2x2", "TPU slice to compile for (v5e:2x2, "
                                "v5e:2x4, v5p:2x2x1, v6e:2x2, v4:2x2x1, ...).")
_MODEL = flags.DEFINE_enum("model", "tiny", sorted(aot_runs.MODELS), "Model shape preset.")
_NLAYERS = flags.DEFINE_integer("n_layers", 0, "Override the preset's layer count (0 = the "
                                "preset's; the layer scan compiles one body, so a few layers "
                                "show the per-layer memory at a fraction of the compile time).")
_ROLES = flags.DEFINE_list("roles", ["sampler", "learner", "reshard"],
                           "sampler, learner and/or reshard (the learner->sampler weight push).")
_IMPLS = flags.DEFINE_list("impls", list(aot.SAMPLER_IMPLS), "Sampler attention impls.")
_TP = flags.DEFINE_integer("sampler_tp", 1, "Devices (tp) of one sampler replica.")
_SLOTS = flags.DEFINE_integer("slots", 64, "Decode slots.")
_PAGES = flags.DEFINE_integer("num_pages", 4096, "KV pages per layer.")
_PAGE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
_LEN = flags.DEFINE_integer("max_seq_len", 2048, "Sampler max sequence length.")
_STEPS = flags.DEFINE_integer("steps", 8, "Decode steps per dispatch.")
_MESHES = flags.DEFINE_multi_string("learner_mesh", ["fsdp:4", "fsdp:2,tp:2"],
                                    "Learner meshes (repeat the flag), name:size,...")
_RESHARD_L = flags.DEFINE_string("reshard_learner_mesh", "fsdp:2",
                                 "Reshard: learner mesh on the first chips, name:size,...")
_RESHARD_S = flags.DEFINE_string("reshard_sampler_mesh", "tp:2",
                                 "Reshard: sampler mesh on the chips after the learner's.")
_SEQ = flags.DEFINE_integer("seq_len", 2048, "Learner row length.")
_ROWS = flags.DEFINE_integer("micro_batch_rows", 8, "Learner micro-batch rows.")
_REMAT = flags.DEFINE_enum("remat", "full", ["none", "full", "dots"], "Learner remat policy.")
_BLOCK = flags.DEFINE_integer("attention_block_len", 512, "Learner attention block length.")
_HLO_DIR = flags.DEFINE_string("hlo_dir", "", "If set, each program's optimized TPU HLO text is "
                                "written under this folder (to re-read without recompiling).")
_REREAD = flags.DEFINE_list("reread", [], "HLO files written by --hlo_dir: print their "
                            "trip-count-weighted costs (rlax_pipe.hlo_costs) and compile nothing.")
_ATTN = flags.DEFINE_enum("attention_impl", "blockwise", ["blockwise", "flash", "auto"],
                          "Learner training attention (LearnerConfig.attention_impl).")


def main(argv):
  del argv
  if _REREAD.value:
    for path in _REREAD.value:
      print(json.dumps(aot_runs.reread_record(path)), flush=True)
    return
  name, model_cfg = _MODEL.value, aot_runs.MODELS[_MODEL.value]
  if _NLAYERS.value:
    model_cfg = dataclasses.replace(model_cfg, n_layers=_NLAYERS.value)
    name = f"{name}[{_NLAYERS.value} layers]"
  records = []
  if "sampler" in _ROLES.value:
    cfg = SamplerConfig(num_slots=_SLOTS.value, page_size=_PAGE.value, num_pages=_PAGES.value,
                        max_seq_len=min(_LEN.value, model_cfg.max_seq_len), max_new_tokens=128,
                        cache_dtype="bfloat16")
    records.append(aot_runs.sampler_records(name, model_cfg, cfg, _TOPOLOGY.value, _TP.value,
                                            tuple(_IMPLS.value), _STEPS.value,
                                            hlo_dir=_HLO_DIR.value or None))
  if "learner" in _ROLES.value:
    meshes = [aot_runs.parse_mesh(m.split(",")) for m in _MESHES.value]
    records.append(aot_runs.learner_records(name, model_cfg, _TOPOLOGY.value, meshes,
                                            _SEQ.value, _ROWS.value, _REMAT.value,
                                            _BLOCK.value, _ATTN.value,
                                            hlo_dir=_HLO_DIR.value or None))
  if "reshard" in _ROLES.value:
    records.append(aot_runs.reshard_records(
        name, model_cfg, _TOPOLOGY.value, aot_runs.parse_mesh(_RESHARD_L.value.split(",")),
        aot_runs.parse_mesh(_RESHARD_S.value.split(",")), hlo_dir=_HLO_DIR.value or None))
  for gen in records:
    for rec in gen:
      print(json.dumps(to_jsonable(rec, strict=True)), flush=True)


if __name__ == "__main__":
  app.run(main)
