"""The cost model: seconds of every operation a run is made of, linear in what the operation does.

One model serves three users: the reproducible driver's virtual clock, the discrete-event
simulator (`rlax_pipe.sim`) and the what-ifs. Its coefficients come from one of three places,
named in `source`: a fit of a calibration run measured on the machine (`costs.fit`), an analytic
model of a named accelerator (`costs.accelerator`), or a hand-set default (never a measurement).

Operations and their features (all counts are integers):

  sampler engine step (one call of the engine's step from the sampler loop):
    s = engine_step_s                                  host work of one sampler-loop iteration
      + install_s * installs                           weight swaps applied
      + prefill_call_s * prefill_calls + prefill_token_s * prefill_tokens
      + dispatch_s * dispatches                        decode dispatches (launch + read-back)
      + max(decode_step_s * decode_steps               weights read once per decode step
            + slot_step_s * slot_steps                 per active slot per step
            + token_step_s * live_token_steps          KV read: live tokens per step
            + expert_step_s * decode_steps * hit(b),   MoE: the experts the step routes to
            flop_slot_step_s * slot_steps)             compute-bound floor (roofline)
    A dispatch runs K >= 1 decode steps; slot_steps = generated tokens; live_token_steps = sum
    over steps of the tokens held in KV by the active slots. The fit never looks at K.
    Mixture of experts (`expert_step_s` > 0): a step of b active slots reads the fraction
    hit(b) = 1 - (1 - k/X)^b of the X experts (k per token; `costs.accelerator.
    expected_experts_hit` / X, uniform routing), with b = slot_steps / decode_steps, the
    dispatch's mean (exact when no slot finishes inside it; otherwise hit is concave, so the
    mean over-estimates, by Jensen's inequality, never under-estimates).
  learner step:  train_step_s + train_token_s * tokens + micro_batch_s * micro_batches
                 + learner_host_s   (tokens = rows x row length processed, padding included)
  weight push:   push_s + push_byte_s * bytes
  tool calls:    tool_wave_s * waves + tool_call_s * calls   (multi-turn episodes, `rlax_pipe.envs`:
                 a wave is one batch of tool calls run together in the worker processes, during
                 which the reproducible sampler waits; shown as "env"/"tool" timeline spans)

Virtual time is exact: every duration is rounded to a multiple of `QUANTUM` = 2^-30 s
(0.93 ns), so every sum of durations below ~2^22 s is exact in float64, whatever the order of
the additions. The driver, which adds one step at a time, and the simulator, which adds runs of
steps at once (`decode_run`, the same expression on arrays), therefore reach bit-identical times
and make identical decisions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import numpy as np

QUANTUM = 2.0 ** -30  # seconds


def quantize(x):
  """`x` (seconds, float or array) rounded to a multiple of `QUANTUM` (half to even)."""
  return np.rint(np.asarray(x, np.float64) / QUANTUM) * QUANTUM


@dataclasses.dataclass(frozen=True)
class EngineStep:
  """What one sampler engine step did (integer counts; see the module docstring)."""

  installs: int = 0
  prefill_calls: int = 0
  prefill_tokens: int = 0
  dispatches: int = 0
  decode_steps: int = 0
  slot_steps: int = 0
  live_token_steps: int = 0


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Seconds per operation (module docstring). Every coefficient is >= 0; every duration it
  returns is quantized.

  Attributes:
    engine_step_s: per sampler-loop iteration that runs the engine (host scheduling, uploads).
    install_s: per weight swap applied on the sampler.
    prefill_call_s: per prefill call.
    prefill_token_s: per prefilled token.
    dispatch_s: per decode dispatch (launch + one read-back), whatever its K.
    decode_step_s: per decode step (memory-bound: weights read once per step).
    slot_step_s: per active slot per decode step.
    token_step_s: per live KV token per decode step.
    flop_slot_step_s: compute-bound time per active slot per decode step (2 N FLOPs / peak);
      0 when decoding never becomes compute-bound (a measured CPU fit).
    train_step_s: learner step, fixed part.
    train_token_s: per token processed by the learner step (rows x row length).
    micro_batch_s: per micro-batch of the learner step.
    learner_host_s: host work per learner step outside the train step and the push (batch
      building, step hooks).
    push_s: weight push, fixed part.
    push_byte_s: per byte pushed.
    expert_step_s: mixture of experts: per decode step that reads every routed expert of every
      MoE layer once (0 = a dense model; the module docstring's hit(b) scales it).
    moe_experts: X, routed experts per MoE layer (0 = dense; else >= moe_top_k).
    moe_top_k: k, experts each token is routed to (0 = dense; else >= 1).
    tool_wave_s: per wave of tool calls of multi-turn episodes (process round trip); 0 = tool
      time not modelled.
    tool_call_s: per tool call in a wave.
    source: where the numbers come from ("measured: <run>", "analytic: <chip> ...", "default:
      hand-set, not a measurement").
  """

  engine_step_s: float = 0.0
  install_s: float = 0.0
  prefill_call_s: float = 0.0
  prefill_token_s: float = 2e-5
  dispatch_s: float = 0.0
  decode_step_s: float = 0.010
  slot_step_s: float = 2e-4
  token_step_s: float = 0.0
  flop_slot_step_s: float = 0.0
  train_step_s: float = 0.05
  train_token_s: float = 0.0
  micro_batch_s: float = 0.0
  learner_host_s: float = 0.0
  push_s: float = 0.005
  push_byte_s: float = 0.0
  expert_step_s: float = 0.0
  moe_experts: float = 0.0
  moe_top_k: float = 0.0
  tool_wave_s: float = 0.0
  tool_call_s: float = 0.0
  source: str = "default: hand-set, not a measurement"

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if f.name == "source":
        continue
      v = getattr(self, f.name)
      if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
        raise ValueError(f"CostModel.{f.name}={v!r} must be a finite number >= 0 (seconds).")
      object.__setattr__(self, f.name, float(v))
    if self.expert_step_s and not 1 <= self.moe_top_k <= self.moe_experts:
      raise ValueError(f"CostModel: expert_step_s={self.expert_step_s} needs 1 <= moe_top_k "
                       f"({self.moe_top_k}) <= moe_experts ({self.moe_experts}).")

  # ---- operations ---------------------------------------------------------------------------
  def prefill(self, calls: int, tokens: int) -> float:
    """Seconds of `calls` prefill calls over `tokens` prompt tokens (quantized)."""
    return float(quantize(self.prefill_call_s * calls + self.prefill_token_s * tokens))

  def _rest(self, installs, dispatches, steps, slot_steps, live_token_steps):
    """Unquantized non-prefill seconds of an engine step; the same expression (same operation
    order) for Python numbers and numpy arrays, so both round identically."""
    memory = (self.decode_step_s * steps + self.slot_step_s * slot_steps
              + self.token_step_s * live_token_steps)
    if self.expert_step_s:  # MoE: the fraction of experts the step's tokens route to
      per_step = np.divide(slot_steps, np.maximum(steps, 1), dtype=np.float64)
      hit = 1.0 - (1.0 - self.moe_top_k / self.moe_experts) ** per_step
      memory = memory + self.expert_step_s * steps * hit
    return (self.engine_step_s + self.install_s * installs + self.dispatch_s * dispatches
            + np.maximum(memory, self.flop_slot_step_s * slot_steps))

  def engine_step(self, step: EngineStep) -> tuple[float, float]:
    """(prefill seconds, the rest) of one sampler engine step, each quantized; their sum is its
    duration."""
    rest = self._rest(step.installs, step.dispatches, step.decode_steps, step.slot_steps,
                      step.live_token_steps)
    return self.prefill(step.prefill_calls, step.prefill_tokens), float(quantize(rest))

  def decode_run(self, n: int, active: int, live0: int, installs_first: int = 0,
                 steps: int = 1) -> np.ndarray:
    """float64[n] non-prefill seconds of `n` consecutive engine steps, each one dispatch of
    `steps` decode steps of `active` slots in which no slot finishes: the live tokens at the
    start of dispatch j are `live0 + active * steps * j` (each slot adds one token per step), so
    its live-token-steps are steps * (that) + active * steps * (steps - 1) / 2; the first has
    `installs_first` weight swaps. Elementwise equal to `engine_step(...)[1]` of each.

    Raises:
      ValueError: if n < 0 or steps < 1.
    """
    if n < 0 or steps < 1:
      raise ValueError(f"decode_run: n={n} must be >= 0 and steps={steps} >= 1.")
    j = np.arange(n, dtype=np.int64)
    installs = np.zeros(n, np.int64)
    if n:
      installs[0] = installs_first
    ones = np.ones(n, np.int64)
    live = steps * (live0 + active * steps * j) + active * steps * (steps - 1) // 2
    return quantize(self._rest(installs, ones, steps * ones, active * steps * ones, live))

  def train(self, tokens: int, micro_batches: int = 1) -> float:
    """Seconds of one learner step on `tokens` processed tokens, host work included
    (quantized)."""
    return float(quantize(self.train_step_s + self.train_token_s * tokens
                          + self.micro_batch_s * micro_batches + self.learner_host_s))

  def push(self, num_bytes: int) -> float:
    """Seconds of one weight push of `num_bytes` bytes (quantized)."""
    return float(quantize(self.push_s + self.push_byte_s * num_bytes))

  def tools(self, waves: int, calls: int) -> float:
    """Seconds of `waves` waves of tool calls holding `calls` calls in all (quantized)."""
    return float(quantize(self.tool_wave_s * waves + self.tool_call_s * calls))

  # ---- storage ------------------------------------------------------------------------------
  def to_dict(self) -> dict[str, Any]:
    """JSON-ready dict (coefficients and source)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> CostModel:
    """Inverse of `to_dict`; unknown keys are an error.

    Raises:
      ValueError: naming unknown keys.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"CostModel.from_dict: unknown keys {unknown}; known: {sorted(names)}.")
    return cls(**d)


def load_cost_model(path: str | pathlib.Path) -> CostModel:
  """The cost model stored in a JSON file: a `CostFit` file (`costs.fit.CostFit.save`, its
  "cost_model" entry) or a bare `CostModel.to_dict`.

  Raises:
    FileNotFoundError / ValueError: naming the file and what is wrong.
  """
  p = pathlib.Path(path)
  if not p.exists():
    raise FileNotFoundError(f"no cost model at {p}: run a calibration first (experiments/"
                            "bench_pipeline.py writes cost_fit.json into its --out_dir).")
  d = json.loads(p.read_text())
  return CostModel.from_dict(d["cost_model"] if "cost_model" in d else d)
