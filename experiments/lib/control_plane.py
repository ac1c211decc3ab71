"""Host-side control-plane costs at scale: `bench_pipeline.py --suite=control_plane` (#13 point 5).

With `live_groups` groups admitted and not yet trained, the real `RolloutQueue` (admission
ledger, ready heap) and the learner's host path (`trainer.build_batch`: advantages and packing,
the running timeline summary, the step's lag statistics) are timed event by event, measured
wall-clock on this machine. The learner step they are compared with is predicted for the same
batch by the analytic cost model of a named model and chip (this CPU cannot run one).

Keys: admission_us_per_event (mean of try_admit calls at >= live_groups live groups, the worst
policy), put_us_per_sample, retirement_us_per_group (the queue's part of handing a batch out),
learner_host_s_per_step, learner_step_s (predicted), learner_host_overhead_fraction (their
ratio), timeline_summary_us (running summary at `timeline_spans` spans) beside
timeline_summarize_full_s (the per-step walk it replaces).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from rlax_pipe import costs as costs_lib
from rlax_pipe import timeline as timeline_lib
from rlax_pipe.pipeline import config as pconfig
from rlax_pipe.pipeline import staleness, trainer
from rlax_pipe.pipeline.rollout_queue import RolloutQueue
from rlax_pipe.types import Rollout


def _rollouts(rng, gid: int, sid0: int, size: int, version: int, prompt: int,
              completion: tuple[int, int]) -> list[Rollout]:
  out = []
  for i in range(size):
    n = int(rng.integers(*completion))
    out.append(Rollout(sample_id=sid0 + i, group_id=gid,
                       prompt_tokens=np.ones(prompt, np.int32),
                       completion_tokens=np.ones(n, np.int32),
                       behavior_logprobs=np.zeros(n, np.float32),
                       policy_versions=np.full(n, version, np.int32), finish_reason="eos",
                       reward=float(rng.integers(0, 2))))
  return out


def _policy_run(policy: str, live_groups: int, group_size: int, groups_per_step: int,
                max_lag: int, steps: int, seq_len: int, prompt: int,
                completion: tuple[int, int], seed: int) -> dict:
  rng = np.random.default_rng(seed)
  q = RolloutQueue(staleness.StalenessConfig(policy, max_lag, groups_per_step), group_size)
  pcfg = pconfig.PipelineConfig(group_size=group_size, seq_len=seq_len,
                                staleness=q.config)
  admit_s, admits, next_gid, v = 0.0, 0, 0, 0

  def admit(n: int) -> None:
    nonlocal admit_s, admits, next_gid
    for _ in range(n):
      ids = range(next_gid * group_size, (next_gid + 1) * group_size)
      t0 = time.perf_counter()
      ok = q.try_admit(next_gid, v, sample_ids=ids)
      admit_s += time.perf_counter() - t0
      admits += 1
      if ok:
        next_gid += 1

  admit(live_groups)
  live_at_start = q.stats().in_flight_groups
  admit_s, admits = 0.0, 0  # the fill is not steady state: time events at >= live_groups
  put_s = puts = retire_s = host_s = 0.0
  completed = 0
  rows = []
  for _ in range(steps):
    batch = []
    for _ in range(groups_per_step):  # the oldest admitted groups finish
      batch += _rollouts(rng, completed, completed * group_size, group_size, v, prompt,
                         completion)
      completed += 1
    t0 = time.perf_counter()
    for r in batch:
      q.put(r)
    put_s += time.perf_counter() - t0
    puts += len(batch)
    t0 = time.perf_counter()
    groups = q.try_get_batch(groups_per_step, v)
    t1 = time.perf_counter()
    tb, trained = trainer.build_batch(groups, pcfg)
    lags = np.concatenate([r.policy_versions for r in trained])
    np.bincount(v - lags)
    t2 = time.perf_counter()
    retire_s += t1 - t0
    host_s += t2 - t0
    rows.append(int(tb.tokens.shape[0]))
    v += 1
    q.set_learner_version(v)
    admit(groups_per_step)
  return {"admission_us_per_event": 1e6 * admit_s / max(admits, 1), "admissions": admits,
          "live_groups": live_at_start, "put_us_per_sample": 1e6 * put_s / max(puts, 1),
          "retirement_us_per_group": 1e6 * retire_s / (steps * groups_per_step),
          "learner_host_s_per_step": host_s / steps, "batch_rows": int(np.mean(rows))}


def _timeline_costs(num_spans: int) -> dict:
  tl = timeline_lib.Timeline(clock=timeline_lib.VirtualClock())
  t = 0.0
  for i in range(num_spans):
    tl.record("sampler" if i % 3 else "learner", "decode" if i % 3 else "train_step", t,
              t + 1e-3, *((4, 8) if i % 3 else (None, None)))
    t += 1e-3
  t0 = time.perf_counter()
  for _ in range(100):
    tl.summary()
  running = (time.perf_counter() - t0) / 100
  t0 = time.perf_counter()
  timeline_lib.summarize(tl.spans())
  full = time.perf_counter() - t0
  return {"timeline_spans": num_spans, "timeline_summary_us": 1e6 * running,
          "timeline_summarize_full_s": full}


def control_plane(live_groups: int = 10_000, group_size: int = 16, groups_per_step: int = 1024,
                  max_lag: int = 9, steps: int = 4, seq_len: int = 512, prompt: int = 64,
                  completion: tuple[int, int] | None = None, timeline_spans: int = 1_000_000,
                  chip: str = "H200", learner_devices: int = 4, seed: int = 0) -> dict:
  """The control-plane costs (module docstring) for `block` and `learner-wait`.

  Args:
    live_groups: groups admitted and not trained while events are timed (needs
      groups_per_step * (max_lag + 1) >= live_groups for the admission bound to allow them).
    group_size, groups_per_step, max_lag: the batch and the bound.
    steps: learner steps timed.
    seq_len, prompt, completion: packed row length, prompt tokens, completion length range
      (default 32 .. seq_len - prompt, uniform).
    timeline_spans: spans in the timeline whose summary is timed.
    chip, learner_devices: the named learner the host time is compared with (Llama-3-8B).
    seed: synthetic lengths and rewards.

  Raises:
    ValueError: if the bound cannot hold `live_groups` live groups.
  """
  completion = completion or (32, seq_len - prompt + 1)
  if groups_per_step * (max_lag + 1) < live_groups:
    raise ValueError(f"control_plane: groups_per_step * (max_lag + 1) = "
                     f"{groups_per_step * (max_lag + 1)} < live_groups={live_groups}.")
  per_policy = {p: _policy_run(p, live_groups, group_size, groups_per_step, max_lag, steps,
                               seq_len, prompt, completion, seed)
                for p in ("block", "learner-wait")}
  shape = costs_lib.ModelShape.of(costs_lib.LLAMA_3_8B, "llama-3-8b")
  model = costs_lib.analytic_cost_model(shape, chip, sampler_tp=1,
                                        learner_devices=learner_devices, train_row_len=seq_len)
  model = dataclasses.replace(model, learner_host_s=0.0)
  out: dict = {"live_groups": live_groups, "groups_per_step": groups_per_step,
               "group_size": group_size, "max_lag": max_lag,
               "learner_model": f"Llama-3-8B on {learner_devices} x {chip} (analytic)"}
  for p, r in per_policy.items():
    k = p.replace("-", "_")
    step_s = model.train(r["batch_rows"] * seq_len, 1)
    r["learner_step_s"] = step_s
    r["learner_host_overhead_fraction"] = r["learner_host_s_per_step"] / step_s
    out.update({f"{key}_{k}": val for key, val in r.items()})
  for key in ("admission_us_per_event", "put_us_per_sample", "retirement_us_per_group",
              "learner_host_s_per_step", "learner_host_overhead_fraction"):
    out[key] = max(r[key] for r in per_policy.values())
  out["learner_step_s"] = min(r["learner_step_s"] for r in per_policy.values())
  out.update(_timeline_costs(timeline_spans))
  return out
