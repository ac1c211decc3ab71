"""Rotary position embeddings with the context-extension scalings of Llama 3.1+ and Qwen.

`inverse_frequencies` gives the per-pair rotation rates theta^(-2i/D) and, with a `RopeScaling`,
their rescaled versions plus a factor that multiplies cos and sin (so q.k is scaled by its
square); `apply` rotates queries or keys with them (half-split convention, HF `rotate_half`).
`scaling_from_hf` / `scaling_to_hf` map the `rope_scaling` (legacy) / `rope_parameters`
(transformers v5) dictionaries of a config.json.

Scalings, with f = factor, L0 = original_max_position_embeddings, w_i = 2 pi / inv_freq_i:
  * linear (Chen et al. 2023, "Extending context window ... via positional interpolation",
    eq. 2): inv_freq_i / f, i.e. positions divided by f.
  * llama3 (Meta, Llama 3.1 release, `apply_scaling` of the reference code; Dubey et al. 2024
    Sec. 3.4 context extension): with low / high frequency factors a, b: w_i < L0 / b keeps
    inv_freq_i; w_i > L0 / a uses inv_freq_i / f; in between, s = (L0 / w_i - a) / (b - a)
    blends (1 - s) inv_freq_i / f + s inv_freq_i.
  * yarn (Peng et al. 2023, "YaRN", Sec. 3.2 "NTK-by-parts" eq. 18-19 and Sec. 3.4 eq. 22):
    a ramp over dimensions between the correction dims of beta_fast and beta_slow rotations
    blends interpolated (inv_freq / f) and extrapolated (inv_freq) rates; cos and sin are
    multiplied by attention_factor = 0.1 ln f + 1 (or the mscale / mscale_all_dim ratio).

Frequencies are computed on the host in float64 and used as float32 constants.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe.config import ROPE_TYPES, RopeScaling


def _yarn_attention_factor(s: RopeScaling) -> float:
  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
  if s.attention_factor is not None:
    return float(s.attention_factor)
  if s.mscale and s.mscale_all_dim:
    return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
  return mscale(s.factor)


def _yarn(inv_freq: np.ndarray, dim: int, theta: float, s: RopeScaling) -> np.ndarray:
  def correction_dim(rotations):  # dimension whose wavelength fits `rotations` times in L0
    return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
        2 * math.log(theta))
  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # avoid a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
  extrapolate = 1.0 - ramp  # 1 where the original rate is kept
  return inv_freq / s.factor * (1.0 - extrapolate) + inv_freq * extrapolate


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
  old = float(s.original_max_position_embeddings)
  a, b = s.low_freq_factor, s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old / a, inv_freq / s.factor, inv_freq)
  smooth = (old / wavelen - a) / (b - a)
  blended = (1.0 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= old / b) & (wavelen <= old / a)
  return np.where(medium, blended, scaled)


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: RopeScaling | None = None) -> tuple[np.ndarray, float]:
  """(inv_freq float32 [head_dim / 2], attention_factor) of RoPE with an optional scaling.

  Args:
    head_dim: D (even).
    theta: rotary base.
    scaling: None (plain RoPE, Su et al. 2021 eq. 34) or a RopeScaling.

  Returns:
    (rotation rate per dimension pair, radians per position; multiplier of cos and sin).
  """
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  factor = 1.0
  if scaling is not None:
    if scaling.rope_type == "linear":
      inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
      inv_freq = _llama3(inv_freq, scaling)
    else:
      inv_freq = _yarn(inv_freq, head_dim, theta, scaling)
      factor = _yarn_attention_factor(scaling)
  return inv_freq.astype(np.float32), float(factor)


def apply(x_BTND: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray,
          attention_factor: float = 1.0) -> jax.Array:
  """Rotates [B, T, N, D] queries or keys by position (half-split convention; angles fp32).

  x' = [x1 cos - x2 sin, x2 cos + x1 sin] * attention_factor, angle = position * inv_freq.
  """
  d = x_BTND.shape[-1]
  angles = positions_BT.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
  cos = (jnp.cos(angles) * attention_factor)[:, :, None, :]
  sin = (jnp.sin(angles) * attention_factor)[:, :, None, :]
  x = x_BTND.astype(jnp.float32)
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTND.dtype)


_HF_FIELDS = ("factor", "original_max_position_embeddings", "low_freq_factor",
              "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "mscale",
              "mscale_all_dim", "truncate")


def scaling_from_hf(params: Mapping[str, Any], max_position_embeddings: int | None,
                    field: str) -> RopeScaling | None:
  """The RopeScaling of a config.json `rope_scaling` / `rope_parameters` dict (None if unscaled).

  Args:
    params: the dict (keys rope_type or legacy type, factor, ...).
    max_position_embeddings: the config's context, the default of
      original_max_position_embeddings for llama3 / yarn (as in transformers).
    field: the dict's config.json name, for error messages.

  Raises:
    ValueError: on a rope type other than default / linear / llama3 / yarn, or an option this
      implementation does not read (both named with the field).
  """
  rope_type = params.get("rope_type", params.get("type", "default"))
  known = {"rope_type", "type", "rope_theta"} | set(_HF_FIELDS)
  extra = [k for k, v in params.items() if k not in known and v is not None
           and (k, v) != ("partial_rotary_factor", 1.0)]
  if rope_type not in ("default",) + ROPE_TYPES or extra:
    raise ValueError(f"config.json field {field!r}={dict(params)}: rope_type={rope_type!r} and "
                     f"options {extra}; supported: default, {', '.join(ROPE_TYPES)} with the "
                     f"options {list(_HF_FIELDS)}.")
  if rope_type == "default":
    return None
  kwargs = {k: params[k] for k in _HF_FIELDS if params.get(k) is not None}
  if rope_type in ("llama3", "yarn"):
    kwargs.setdefault("original_max_position_embeddings", max_position_embeddings)
  if kwargs.get("factor") is None and rope_type == "yarn" and max_position_embeddings:
    kwargs["factor"] = max_position_embeddings / kwargs["original_max_position_embeddings"]
  if "original_max_position_embeddings" in kwargs:
    kwargs["original_max_position_embeddings"] = int(kwargs["original_max_position_embeddings"])
  try:
    return RopeScaling(rope_type=rope_type, **kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f"config.json field {field!r}={dict(params)}: {e}") from None


def scaling_to_hf(scaling: RopeScaling) -> dict[str, Any]:
  """The config.json dict of a RopeScaling (inverse of `scaling_from_hf`)."""
  out = {"rope_type": scaling.rope_type, "factor": scaling.factor}
  keep = {"linear": (), "llama3": ("original_max_position_embeddings", "low_freq_factor",
                                   "high_freq_factor"),
          "yarn": ("original_max_position_embeddings", "beta_fast", "beta_slow",
                   "attention_factor", "mscale", "mscale_all_dim", "truncate")}
  out.update({k: getattr(scaling, k) for k in keep[scaling.rope_type]
              if getattr(scaling, k) is not None})
  return out
