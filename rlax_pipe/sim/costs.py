"""Modelled durations of the simulator: one engine's decode-latency curve and the other costs.

Units: seconds. `calibration.py` fits them from a run; `whatif.py` derives them from accelerator
specifications.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeCurve:
  """Seconds of one decode step of ONE sampler engine with b active slots (a roofline shape).

  latency(b) = max(base_s + per_slot_s * b, compute_s_per_slot * b): flat-ish while decoding is
  memory-bound (weights and KV read once per step), linear once it is compute-bound.

  Attributes:
    base_s: fixed part (>= 0), e.g. weight bytes / HBM bandwidth.
    per_slot_s: memory-bound cost per active slot (>= 0), e.g. its KV bytes / HBM bandwidth.
    compute_s_per_slot: compute-bound cost per slot (>= 0), 2 * params FLOPs / peak FLOP/s.
  """

  base_s: float
  per_slot_s: float = 0.0
  compute_s_per_slot: float = 0.0

  def __post_init__(self):
    if min(self.base_s, self.per_slot_s, self.compute_s_per_slot) < 0:
      raise ValueError(f"DecodeCurve: every coefficient must be >= 0, got {self}.")

  def latency(self, active: int) -> float:
    """Seconds of one decode step with `active` slots on the engine."""
    return max(self.base_s + self.per_slot_s * active, self.compute_s_per_slot * active)


@dataclasses.dataclass(frozen=True)
class SimCosts:
  """Modelled durations (seconds).

  Attributes:
    decode: one engine's decode-step latency curve.
    prefill_per_sample_s: prefill of one started sample (its prompt) (>= 0).
    train_base_s: learner step, fixed part (>= 0).
    train_per_token_s: learner step, per trained completion token (>= 0).
    push_s: one weight push, learner to sampler (>= 0).
  """

  decode: DecodeCurve
  prefill_per_sample_s: float = 0.0
  train_base_s: float = 0.0
  train_per_token_s: float = 0.0
  push_s: float = 0.0

  def __post_init__(self):
    if min(self.prefill_per_sample_s, self.train_base_s, self.train_per_token_s,
           self.push_s) < 0:
      raise ValueError(f"SimCosts: durations must be >= 0, got {self}.")

  def train(self, tokens: int) -> float:
    """Seconds of one learner step on `tokens` completion tokens."""
    return self.train_base_s + self.train_per_token_s * tokens
