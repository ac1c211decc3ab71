"""MXFP4 dequantization: against transformers' own GPT-OSS dequantizer and a bit-level numpy
reading of the OCP MX spec, on a small tensor laid out as the published gpt-oss checkpoints."""

import numpy as np
import pytest

from rlax_pipe.model import mxfp4


def _spec_decode(byte_codes, scale_bytes):
  """Independent per-element decoding of the OCP MX v1.0 bit fields (float64, loops)."""
  out = []
  for byte, scale in zip(byte_codes, scale_bytes):
    for code in (int(byte) & 0xF, int(byte) >> 4):
      s, e, m = code >> 3, (code >> 1) & 3, code & 1
      mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
      out.append((-1) ** s * mag * 2.0 ** (int(scale) - 127))
  return np.array(out)


def _checkpoint_like(seed):
  """gate_up_proj_blocks-like tensor: [X=2, rows=3, G=2, 16] uint8, scales [2, 3, 2]."""
  rng = np.random.default_rng(seed)
  blocks = rng.integers(0, 256, (2, 3, 2, 16), dtype=np.uint8)
  scales = rng.integers(110, 135, (2, 3, 2), dtype=np.uint8)
  return blocks, scales


def test_lut_matches_the_spec_table():
  np.testing.assert_array_equal(
      mxfp4.fp4_e2m1_values(),
      [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def test_dequantize_matches_spec_decoding_and_transformers():
  blocks, scales = _checkpoint_like(0)
  got = mxfp4.dequantize(blocks, scales)
  assert got.shape == (2, 3, 64) and got.dtype == np.float32
  for x in range(2):
    for r in range(3):
      expected = np.concatenate([_spec_decode(blocks[x, r, g], [scales[x, r, g]] * 16)
                                 for g in range(2)])
      np.testing.assert_array_equal(got[x, r], expected)
  torch = pytest.importorskip("torch")
  from transformers.integrations import mxfp4 as hf_mxfp4
  hf = hf_mxfp4.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                           dtype=torch.float32)
  # transformers returns the [X, in, out] parameter layout: the transpose of ours.
  np.testing.assert_array_equal(hf.numpy(), got.transpose(0, 2, 1))


def test_quantize_round_trips_grid_values_and_rejects_nan_scales():
  blocks, scales = _checkpoint_like(1)
  values = mxfp4.dequantize(blocks, scales)
  b2, s2 = mxfp4.quantize(values)
  np.testing.assert_array_equal(mxfp4.dequantize(b2, s2), values)
  with pytest.raises(ValueError, match="NaN"):
    mxfp4.dequantize(blocks, np.full_like(scales, 255))
  with pytest.raises(ValueError, match=r"\[..., G, 16\]"):
    mxfp4.dequantize(blocks[..., :8], scales)
