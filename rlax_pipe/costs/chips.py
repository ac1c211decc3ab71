"""Named accelerators: HBM capacity and bandwidth, dense bf16 peak, interconnect (one table).

The one chip table of the library: the analytic cost model (`costs.accelerator`), the sampler's
HBM roofline and the learner's MFU read it (`chip(name)` by name, `chip_for_device(kind)` by
`jax.Device.device_kind`). Units: bytes, bytes/s, FLOP/s.

Sources (vendors' data sheets and documentation pages; NVIDIA quotes bf16 Tensor Core rates "with
sparsity", the dense rate is half of that):
  * H200 SXM: NVIDIA H200 Tensor Core GPU datasheet (2024): 141 GB HBM3e, 4.8 TB/s, BF16 1,979
    TFLOPS with sparsity, NVLink 900 GB/s (bidirectional, per GPU).
  * H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (2023): 80 GB HBM3, 3.35 TB/s, BF16 1,979
    TFLOPS with sparsity, NVLink 900 GB/s.
  * H100 PCIe: same datasheet: 80 GB HBM2e, 2.0 TB/s, BF16 1,513 TFLOPS with sparsity, NVLink
    bridge 600 GB/s.
  * A100 SXM4 80GB: NVIDIA A100 Tensor Core GPU datasheet (2021): 2,039 GB/s, BF16 312 TFLOPS
    dense, NVLink 600 GB/s; A100 40GB: 1,555 GB/s.
  * L4: NVIDIA L4 Tensor Core GPU datasheet (2023): 24 GB, 300 GB/s, BF16 242 TFLOPS with sparsity,
    PCIe Gen4 x16 64 GB/s.
  * TPU v4: Google Cloud TPU v4 documentation: 32 GiB HBM2, 1,200 GB/s, 275 TFLOPS bf16.
  * TPU v5e: Google Cloud TPU v5e documentation: 16 GB HBM2, 819 GB/s, 197 TFLOPS bf16,
    400 GB/s bidirectional ICI per chip.
  * TPU v5p: Google Cloud TPU v5p documentation: 95 GB HBM2e, 2,765 GB/s, 459 TFLOPS bf16,
    4,800 Gbps ICI per chip.
  * TPU v6e (Trillium): Google Cloud TPU v6e documentation: 32 GB, 1,640 GB/s, 918 TFLOPS bf16,
    800 GB/s bidirectional ICI per chip.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator's published numbers.

  Attributes:
    name: table key, e.g. "H200".
    device_kinds: substrings of `jax.Device.device_kind` that name this chip (lower case).
    hbm_bytes: HBM capacity, bytes.
    hbm_bandwidth: HBM bandwidth, bytes/s.
    peak_flops_bf16: dense bf16 matmul peak, FLOP/s.
    interconnect_bandwidth: chip-to-chip bandwidth (NVLink / ICI), bytes/s, bidirectional.
    source: where the numbers come from.
  """

  name: str
  device_kinds: tuple[str, ...]
  hbm_bytes: float
  hbm_bandwidth: float
  peak_flops_bf16: float
  interconnect_bandwidth: float
  source: str


_NV_H = "NVIDIA H100 Tensor Core GPU datasheet (2023)"
CHIPS: tuple[Chip, ...] = (
    Chip("H200", ("h200",), 141e9, 4.8e12, 989.5e12, 900e9,
         "NVIDIA H200 Tensor Core GPU datasheet (2024)"),
    Chip("H100-PCIe", ("h100 pcie",), 80e9, 2.0e12, 756.5e12, 600e9, _NV_H),
    Chip("H100", ("h100",), 80e9, 3.35e12, 989.5e12, 900e9, _NV_H),
    Chip("A100-80GB", ("a100-sxm4-80gb", "a100 80gb"), 80e9, 2.039e12, 312e12, 600e9,
         "NVIDIA A100 Tensor Core GPU datasheet (2021)"),
    Chip("A100-40GB", ("a100",), 40e9, 1.555e12, 312e12, 600e9,
         "NVIDIA A100 Tensor Core GPU datasheet (2021)"),
    Chip("L4", ("l4",), 24e9, 300e9, 121e12, 64e9, "NVIDIA L4 Tensor Core GPU datasheet (2023)"),
    Chip("TPU-v4", ("tpu v4",), 32 * 2**30, 1.2e12, 275e12, 300e9,
         "Google Cloud TPU v4 documentation (ICI: 6 links x 50 GB/s)"),
    Chip("TPU-v5e", ("tpu v5 lite", "tpu v5e"), 16e9, 819e9, 197e12, 400e9,
         "Google Cloud TPU v5e documentation"),
    Chip("TPU-v5p", ("tpu v5p", "tpu v5"), 95e9, 2.765e12, 459e12, 600e9,
         "Google Cloud TPU v5p documentation (ICI 4,800 Gbps)"),
    Chip("TPU-v6e", ("tpu v6 lite", "tpu v6e", "tpu v6"), 32e9, 1.64e12, 918e12, 800e9,
         "Google Cloud TPU v6e documentation"),
)
_BY_NAME = {c.name.lower(): c for c in CHIPS}


def chip(name: str) -> Chip:
  """The table entry named `name` (case-insensitive).

  Raises:
    KeyError: naming the known chips.
  """
  try:
    return _BY_NAME[name.lower()]
  except KeyError:
    raise KeyError(f"unknown chip {name!r}; known: {[c.name for c in CHIPS]}.") from None


def chip_for_device(device_kind: str) -> Chip | None:
  """The entry one of whose `device_kinds` occurs in `device_kind` as a whole name (not inside a
  longer one: "l4" does not match "NVIDIA L40S"; first match, the table lists specific names
  before general ones), or None (a CPU, or a chip not in the table)."""
  kind = device_kind.lower()
  for c in CHIPS:
    if any(re.search(rf"(?<![a-z0-9]){re.escape(k)}(?![a-z0-9])", kind) for k in c.device_kinds):
      return c
  return None
