"""Synthetic packed batches and a learner throughput benchmark (tokens per second)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe import objectives
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner.config import LearnerConfig
from rlax_pipe.learner.learner import Learner
from rlax_pipe.types import TrainBatch


# The event JAX records once per XLA backend compilation (jax/_src/dispatch.py).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles() -> Iterator[list[float]]:
  """Counts XLA backend compilations in the block (any program, any function).

  Yields a list that receives the duration (seconds) of every backend compile that happens
  while the block runs; `len()` of it is the number of compiles.
  """
  seen: list[float] = []

  def listener(event: str, duration: float, **_):
    if event == BACKEND_COMPILE_EVENT:
      seen.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def synthetic_batch(rng: np.random.Generator, batch_size: int, seq_len: int, vocab_size: int, *,
                    samples_per_row: int = 2, version: int = 0, max_lag: int = 0) -> TrainBatch:
  """A packed TrainBatch of random samples (for tests and benchmarks).

  Each row holds `samples_per_row` samples (segment ids 1..n) in slots of seq_len // n tokens;
  a sample fills a random 60-100% of its slot (the rest is padding, segment 0) and is a prompt
  of 1..slot/3 tokens followed by its completion. Completion tokens get loss_mask 1, a random
  behavior log-prob in [-4, 0), a policy version in [version - max_lag, version] (>= 0) and the
  sample's advantage (standard normal, broadcast over its tokens).

  Args:
    rng: numpy Generator.
    batch_size: rows B.
    seq_len: tokens per row L (>= 4 * samples_per_row).
    vocab_size: token ids are drawn from [0, vocab_size).
    samples_per_row: samples packed per row (>= 1).
    version: learner version the batch is meant for.
    max_lag: largest lag of a completion token.

  Returns:
    TrainBatch of host numpy arrays.
  """
  slot = seq_len // samples_per_row
  if slot < 4:
    raise ValueError(f"seq_len={seq_len} too short for {samples_per_row} samples per row.")
  shape = (batch_size, seq_len)
  tokens = rng.integers(0, vocab_size, shape).astype(np.int32)
  positions = np.zeros(shape, np.int32)
  segment_ids = np.zeros(shape, np.int32)
  loss_mask = np.zeros(shape, np.float32)
  behavior = np.zeros(shape, np.float32)
  versions = np.zeros(shape, np.int32)
  advantages = np.zeros(shape, np.float32)
  for b in range(batch_size):
    for s in range(samples_per_row):
      start = s * slot
      length = int(rng.integers(max(2, int(0.6 * slot)), slot + 1))
      prompt = int(rng.integers(1, max(2, slot // 3) + 1))
      prompt = min(prompt, length - 1)
      span = slice(start, start + length)
      comp = slice(start + prompt, start + length)
      n = length - prompt
      positions[b, span] = np.arange(length)
      segment_ids[b, span] = s + 1
      loss_mask[b, comp] = 1.0
      behavior[b, comp] = rng.uniform(-4.0, 0.0, n)
      versions[b, comp] = np.maximum(version - rng.integers(0, max_lag + 1, n), 0)
      advantages[b, comp] = rng.normal()
  return TrainBatch(tokens=tokens, positions=positions, segment_ids=segment_ids,
                    loss_mask=loss_mask, behavior_logprobs=behavior, policy_versions=versions,
                    advantages=advantages)


def run_benchmark(model_cfg: ModelConfig, learner_cfg: LearnerConfig,
                  objective_cfg: objectives.ObjectiveConfig,
                  sampling_cfg: logprobs_lib.SamplingConfig, *, batch_size: int, seq_len: int,
                  steps: int, warmup: int = 2, samples_per_row: int = 2,
                  devices: Sequence[Any] | None = None, seed: int = 0) -> dict[str, Any]:
  """Times `steps` learner steps on synthetic packed batches after `warmup` (compile) steps.

  Throughput counts non-padding tokens (prompt + completion) processed per second of wall
  time, host-to-device batch transfer included, compile excluded.

  Returns:
    JSON-able dict: tokens_per_s, completion_tokens_per_s, step_s (mean seconds per step),
    compile_s (first step, compile included), steps, device info and the configs used.
  """
  learner = Learner(model_cfg, learner_cfg, objective_cfg, sampling_cfg, devices=devices)
  rng = np.random.default_rng(seed)
  batches = [synthetic_batch(rng, batch_size, seq_len, model_cfg.vocab_size,
                             samples_per_row=samples_per_row, max_lag=2) for _ in range(4)]
  t0 = time.perf_counter()
  learner.train_step(batches[0])
  learner.flush()
  compile_s = time.perf_counter() - t0
  for i in range(1, warmup):
    learner.train_step(batches[i % len(batches)])
  learner.flush()
  tokens = completion = 0
  t0 = time.perf_counter()
  for i in range(steps):
    batch = batches[i % len(batches)]
    learner.train_step(batch)
    tokens += int((batch.segment_ids > 0).sum())
    completion += int(batch.loss_mask.sum())
  last = learner.flush()
  jax.block_until_ready(learner.state)
  elapsed = time.perf_counter() - t0
  return {
      "tokens_per_s": tokens / elapsed,
      "completion_tokens_per_s": completion / elapsed,
      "step_s": elapsed / steps,
      "compile_s": compile_s,
      "steps": steps,
      "final_loss": float(last["loss"]),
      "devices": [str(d) for d in learner.mesh.devices.flat],
      "batch_size": batch_size,
      "seq_len": seq_len,
      "samples_per_row": samples_per_row,
      "model": dataclasses.asdict(model_cfg),
      "learner": dataclasses.asdict(learner_cfg),
      "objective": dataclasses.asdict(objective_cfg),
      "sampling": dataclasses.asdict(sampling_cfg),
  }
