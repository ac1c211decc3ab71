"""Cost model of a run: measured on the machine, or derived from a named chip's specifications.

  model        `CostModel` (seconds per engine step, learner step, push; exact virtual time);
  fit          timed operations of a calibration run -> `CostModel` with 95% confidence intervals;
  chips        the one table of named accelerators (HBM, bandwidth, bf16 peak, interconnect);
  accelerator  analytic `CostModel` from a model's shape and a chip (what-ifs).
"""

from rlax_pipe.costs.accelerator import analytic_cost_model
from rlax_pipe.costs.accelerator import Assumptions
from rlax_pipe.costs.accelerator import expected_experts_hit
from rlax_pipe.costs.accelerator import GPT_OSS_20B
from rlax_pipe.costs.accelerator import GPT_OSS_20B_SHAPE
from rlax_pipe.costs.accelerator import kv_limited_slots
from rlax_pipe.costs.accelerator import LLAMA_3_8B
from rlax_pipe.costs.accelerator import ModelShape
from rlax_pipe.costs.accelerator import QWEN3_30B_A3B
from rlax_pipe.costs.accelerator import QWEN3_30B_A3B_SHAPE
from rlax_pipe.costs.chips import Chip
from rlax_pipe.costs.chips import chip
from rlax_pipe.costs.chips import chip_for_device
from rlax_pipe.costs.chips import CHIPS
from rlax_pipe.costs.fit import CostFit
from rlax_pipe.costs.fit import CostRecord
from rlax_pipe.costs.fit import CostRecorder
from rlax_pipe.costs.fit import fit_cost_model
from rlax_pipe.costs.fit import read_records
from rlax_pipe.costs.model import CostModel
from rlax_pipe.costs.model import EngineStep
from rlax_pipe.costs.model import load_cost_model

__all__ = (
    "Assumptions", "CHIPS", "Chip", "CostFit", "CostModel", "CostRecord", "CostRecorder",
    "EngineStep", "GPT_OSS_20B", "GPT_OSS_20B_SHAPE", "LLAMA_3_8B", "ModelShape", "QWEN3_30B_A3B",
    "QWEN3_30B_A3B_SHAPE",
    "analytic_cost_model", "chip", "chip_for_device", "expected_experts_hit", "fit_cost_model",
    "kv_limited_slots", "load_cost_model", "read_records",
)
