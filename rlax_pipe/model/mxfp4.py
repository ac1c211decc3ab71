"""MXFP4 (OCP Microscaling FP4) dequantization, for the expert weights of GPT-OSS checkpoints.

Format (OCP "Microscaling Formats (MX) v1.0" specification, Sec. 5.3 and 6.3): a block of 32
elements shares one scale X in E8M0 (an 8-bit biased exponent, X = 2^(e - 127); e = 255 is NaN);
each element is an FP4 E2M1 number (1 sign bit, 2 exponent bits with bias 1, 1 mantissa bit; no
inf or NaN): value = (-1)^s * 2^(E - 1) * (1 + m / 2) for E > 0, (-1)^s * m / 2 for E = 0, i.e.
the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. The dequantized element is X * value.

Storage in the published gpt-oss checkpoints (`*_blocks` + `*_scales` tensors, both uint8): the
blocks tensor is [..., G, 16] (16 bytes = 32 FP4 codes per block; element 2j is the LOW nibble
of byte j, element 2j + 1 the high nibble) and the scales tensor [..., G], one E8M0 byte per
block; the G blocks of a row are its G * 32 elements in order. For the experts the rows are the
output features of an HF Linear-like [out, in] matrix: `gate_up_proj_blocks` [X, 2F, E/32, 16]
dequantizes to [X, 2F, E], the transpose of transformers' `gate_up_proj` [X, E, 2F] (and
`down_proj_blocks` [X, E, F/32, 16] to the transpose of `down_proj` [X, F, E]).
"""

from __future__ import annotations

import numpy as np

_E8M0_BIAS = 127
_E8M0_NAN = 255


def fp4_e2m1_values() -> np.ndarray:
  """float32 [16]: the value of each 4-bit E2M1 code (bit 3 sign, bits 2-1 exponent, bit 0
  mantissa), derived from the bit fields as the OCP MX spec defines them."""
  codes = np.arange(16)
  sign = np.where(codes & 8, -1.0, 1.0)
  exponent, mantissa = (codes >> 1) & 3, codes & 1
  magnitude = np.where(exponent == 0, mantissa * 0.5,
                       np.ldexp(1.0 + mantissa / 2.0, exponent - 1))
  return (sign * magnitude).astype(np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray, *, name: str = "tensor") -> np.ndarray:
  """MXFP4 blocks and E8M0 scales -> float32 values (exact: every MXFP4 value is a float32).

  Args:
    blocks: uint8 [..., G, 16]: 32 FP4 codes per block, two per byte, low nibble first.
    scales: uint8 [..., G]: one E8M0 exponent per block (value 2^(scale - 127)).
    name: the tensor's name, for error messages.

  Returns:
    float32 [..., G * 32]: row-major, block g holding elements 32 g .. 32 g + 31.

  Raises:
    ValueError: wrong dtypes or shapes, or a NaN scale (255) in the tensor.
  """
  blocks, scales = np.asarray(blocks), np.asarray(scales)
  if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
    raise ValueError(f"MXFP4 {name}: blocks and scales must be uint8; got {blocks.dtype} and "
                     f"{scales.dtype}.")
  if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
    raise ValueError(f"MXFP4 {name}: blocks {blocks.shape} must be [..., G, 16] with scales "
                     f"[..., G]; got scales {scales.shape}.")
  if np.any(scales == _E8M0_NAN):
    raise ValueError(f"MXFP4 {name}: a scale byte is 255, which E8M0 defines as NaN; the "
                     "checkpoint is corrupt or not MXFP4.")
  lut = fp4_e2m1_values()
  codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]: low, high
  values = lut[codes].reshape(*blocks.shape[:-1], 32)  # [..., G, 32]
  out = np.ldexp(values, scales.astype(np.int32)[..., None] - _E8M0_BIAS).astype(np.float32)
  return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def quantize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """float [..., N] (N a multiple of 32) -> MXFP4 (blocks uint8 [..., N/32, 16], scales uint8
  [..., N/32]), round-to-nearest onto the E2M1 grid; the scale of a block is the smallest power
  of two that puts its largest magnitude within 6 (the largest E2M1 value). For export of
  dequantized weights in the checkpoint layout and for tests; `dequantize` inverts it exactly on
  values that lie on the grid.

  Raises:
    ValueError: if N is not a multiple of 32 or a value is not finite.
  """
  values = np.asarray(values, np.float64)
  if values.shape[-1] % 32 or not np.all(np.isfinite(values)):
    raise ValueError(f"MXFP4 quantize: last axis {values.shape[-1]} must be a multiple of 32 and "
                     "all values finite.")
  v = values.reshape(*values.shape[:-1], -1, 32)
  amax = np.max(np.abs(v), axis=-1)
  exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-300) / 6.0)), 0)
  exp = np.clip(exp, -_E8M0_BIAS, _E8M0_BIAS).astype(np.int32)
  scaled = v / np.ldexp(1.0, exp)[..., None]
  lut = fp4_e2m1_values().astype(np.float64)
  codes = np.argmin(np.abs(scaled[..., None] - lut), axis=-1).astype(np.uint8)
  blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
  return blocks, (exp + _E8M0_BIAS).astype(np.uint8)
