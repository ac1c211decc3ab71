"""Learner benchmarks (`experiments/bench_learner.py`): synthetic packed batches, throughput and
MFU, compile counts, temporary memory (chunked vs full logits) and collectives, each read from a
measurement or the compiled program.

Experiment code, not library: the learner's tests import `synthetic_batch` and `count_compiles`
from here (`from experiments.lib.learner_bench import ...`, the repository root on sys.path as
`python3 -m pytest` puts it)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from jax.sharding import Mesh

from rlax_pipe import hlo_collectives
from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe import objectives
from rlax_pipe.learner import flops
from rlax_pipe.learner.config import LearnerConfig
from rlax_pipe.learner.learner import Learner, lower_accumulate
from rlax_pipe.learner.reference import reference_bytes
from rlax_pipe.model import ModelLike, as_model
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
  active = [True]

  def listener(event: str, duration: float, **_):
    if active[0] and event == BACKEND_COMPILE_EVENT:
      seen.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    active[0] = False
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    if unregister is not None:
      unregister(listener)


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


def _probe_sizes(batch_size: int, micro_batch_rows: int) -> list[int]:
  """Batch sizes other than the timed one (fewer rows, and one more micro-batch)."""
  return sorted({max(1, batch_size // 2), batch_size + max(1, micro_batch_rows // 2)} -
                {batch_size})


def run_benchmark(model: ModelLike, learner_cfg: LearnerConfig,
                  objective_cfg: objectives.ObjectiveConfig,
                  sampling_cfg: logprobs_lib.SamplingConfig, *, batch_size: int, seq_len: int,
                  steps: int, warmup: int = 2, samples_per_row: int = 2,
                  devices: Sequence[Any] | None = None, seed: int = 0,
                  peak_tflops: float | None = None) -> dict[str, Any]:
  """Times `steps` learner steps on synthetic packed batches after `warmup` (compile) steps.

  Throughput counts non-padding tokens (prompt + completion) processed per second of wall
  time, host-to-device batch transfer included, compile excluded. After the timed steps, one
  step per size of `_probe_sizes` checks that other batch sizes reuse the compiled programs.
  MFU = model FLOPs per token (`flops.model_flops_per_token`) x tokens per second / (peak per
  chip x chips); the peak comes from `peak_tflops` or, by device kind, from the chip table
  `rlax_pipe.costs.chips`.

  Returns:
    JSON-able dict: tokens_per_s, completion_tokens_per_s, step_s (mean seconds per step),
    compile_s (first step, compile included), compiles_in_step_1, compiles_after_step_1 (XLA
    backend compiles in every later step, probes included; goal 0; None if the counter saw no
    compile in step 1, i.e. it does not work on this JAX), model_flops_per_token,
    achieved_tflops (model FLOP/s over all chips, 1e12), peak_tflops_per_chip and its source,
    mfu (None without a peak), steps, push_bytes (bytes of one pushed version: the trained params,
    with LoRA the adapters only), opt_state_bytes, device info and the configs used.
  """
  model = as_model(model)
  model_cfg = getattr(model, "cfg", None)  # the built-in family: FLOPs by formula
  learner = Learner(model, learner_cfg, objective_cfg, sampling_cfg, devices=devices)
  rng = np.random.default_rng(seed)
  make = lambda rows: synthetic_batch(rng, rows, seq_len, model.vocab_size,
                                      samples_per_row=samples_per_row, max_lag=2)
  batches = [make(batch_size) for _ in range(4)]
  probes = [make(rows) for rows in _probe_sizes(batch_size, learner_cfg.micro_batch_rows)]
  t0 = time.perf_counter()
  with count_compiles() as first:
    learner.train_step(batches[0])
    learner.flush()
  compile_s = time.perf_counter() - t0
  with count_compiles() as later:
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
    for batch in probes:
      learner.train_step(batch)
    learner.flush()
  tokens_per_s = tokens / elapsed if steps else None
  per_token = None if model_cfg is None else flops.model_flops_per_token(model_cfg, seq_len)
  chips = learner.mesh.devices.size
  kind = learner.mesh.devices.flat[0].device_kind
  peak, source = ((peak_tflops, "--peak_tflops") if peak_tflops else flops.peak_tflops(kind))
  achieved = (None if tokens_per_s is None or per_token is None
              else per_token * tokens_per_s / 1e12)
  return {
      "tokens_per_s": tokens_per_s,
      "completion_tokens_per_s": completion / elapsed if steps else None,
      "step_s": elapsed / steps if steps else None,
      "compile_s": compile_s,
      # A counter that saw no compile in step 1 is not counting (e.g. a renamed JAX event).
      "compiles_in_step_1": len(first),
      "compiles_after_step_1": len(later) if first else None,
      "probe_batch_sizes": [int(b.tokens.shape[0]) for b in probes],
      "model_flops_per_token": per_token,
      "matmul_params": None if model_cfg is None else flops.matmul_params(model_cfg),
      "achieved_tflops": achieved,
      "peak_tflops_per_chip": peak,
      "peak_source": source,
      "mfu": None if (peak is None or achieved is None) else achieved / (peak * chips),
      "steps": steps,
      # What one pushed version weighs (the trained tree: with LoRA the adapters only) and the
      # optimizer state held for it.
      "push_bytes": int(sum(x.nbytes for x in jax.tree.leaves(learner.params))),
      "opt_state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(learner.state.opt_state))),
      "final_loss": float(last["loss"]) if last is not None and "loss" in last else None,
      "device_kind": kind,
      "devices": [str(d) for d in learner.mesh.devices.flat],
      "batch_size": batch_size,
      "seq_len": seq_len,
      "samples_per_row": samples_per_row,
      "model": repr(model) if model_cfg is None else dataclasses.asdict(model_cfg),
      "learner": dataclasses.asdict(learner_cfg),
      "objective": dataclasses.asdict(objective_cfg),
      "sampling": dataclasses.asdict(sampling_cfg),
  }


def memory_report(model: ModelLike, learner_cfg: LearnerConfig,
                  objective_cfg: objectives.ObjectiveConfig,
                  sampling_cfg: logprobs_lib.SamplingConfig, mesh: Mesh,
                  seq_len: int) -> dict[str, Any]:
  """Temporary memory of the micro-batch program, chunked vs full logits, read from XLA.

  Both programs are compiled (never run) for [micro_batch_rows, seq_len] micro-batches on
  `mesh`: the configured one and the same with `logits_chunk_len=None` (the naive step that
  holds [rows, L, V] fp32 logits). Values are per device, from `memory_analysis()`.

  Returns:
    temp_bytes, naive_temp_bytes, logits_temp_ratio (= temp_bytes / naive_temp_bytes),
    argument_bytes, output_bytes, logits_chunk_len, attention_block_len, remat; with
    `objective_cfg.kl` != "off" also kl, reference_bytes and reference_bytes_per_device (the
    reference params of the KL term in the compute dtype, from their shapes and shardings;
    they are part of argument_bytes) and reference_dtype.
  """
  chunked = lower_accumulate(model, learner_cfg, objective_cfg, sampling_cfg, mesh,
                             seq_len).compile()
  naive = lower_accumulate(model, dataclasses.replace(learner_cfg, logits_chunk_len=None),
                           objective_cfg, sampling_cfg, mesh, seq_len).compile()
  mem, naive_mem = chunked.memory_analysis(), naive.memory_analysis()
  return {
      "temp_bytes": int(mem.temp_size_in_bytes),
      "naive_temp_bytes": int(naive_mem.temp_size_in_bytes),
      "logits_temp_ratio": mem.temp_size_in_bytes / max(naive_mem.temp_size_in_bytes, 1),
      "argument_bytes": int(mem.argument_size_in_bytes),
      "output_bytes": int(mem.output_size_in_bytes),
      "logits_chunk_len": learner_cfg.logits_chunk_len,
      "attention_block_len": learner_cfg.attention_block_len,
      "remat": learner_cfg.remat,
      "micro_batch_rows": learner_cfg.micro_batch_rows,
      "seq_len": seq_len,
      **({} if objective_cfg.kl == "off" else {
          "kl": objective_cfg.kl, **reference_bytes(model, mesh),
          "reference_dtype": str(getattr(as_model(model), "compute_dtype", "param dtype"))}),
  }


def collective_report(model: ModelLike, learner_cfg: LearnerConfig,
                      objective_cfg: objectives.ObjectiveConfig,
                      sampling_cfg: logprobs_lib.SamplingConfig, mesh: Mesh,
                      seq_len: int) -> dict[str, Any]:
  """The micro-batch program's collectives on `mesh`, read from its compiled HLO.

  Returns:
    `hlo_collectives.collective_findings`: mesh, summary (count / bytes / in-loop per op and
    mesh axes), weight all-gathers and gradient reduce-scatters over fsdp, activation
    collectives over fsdp (goal 0), how many of them run inside a loop, and their detail.
  """
  hlo = lower_accumulate(model, learner_cfg, objective_cfg, sampling_cfg, mesh,
                         seq_len).compile().as_text()
  shapes = [x.shape for x in jax.tree.leaves(as_model(model).abstract_params())]
  return hlo_collectives.collective_findings(hlo, shapes, mesh)
