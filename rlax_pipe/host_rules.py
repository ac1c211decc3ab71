"""Host rules shared by the sampler, the learner and the simulator (numpy only, no JAX).

Each rule is written once, here, at the bottom layer, so that the sampler and the learner (layer 2)
and the pipeline's host rules and the simulator (layers 4-5, through `pipeline.rules`, which
re-exports them) call the same function, and the simulator imports no JAX:
  * `refill_at`: when the engine ends a decode dispatch early to refill freed slots;
  * `plan_micro_batches`: the learner's split of a batch's rows into minibatches and fixed-shape
    micro-batches, and `micro_batch_plan`, its size (micro-batches, rows processed).
"""

from __future__ import annotations

import numpy as np


def refill_at(waiting: int, num_slots: int) -> int:
  """Finishes that end a decode dispatch early: min(waiting requests, ceil(num_slots / 8)), so
  freed slots are refilled in batches and a dispatch is not cut short by every single finish
  (0 when nothing waits: the dispatch runs its K steps or until every slot is done).

  Args:
    waiting: requests waiting for a slot (>= 0).
    num_slots: decode slots of the replica (>= 1).

  Returns:
    int in [0, ceil(num_slots / 8)].
  """
  return min(waiting, -(-num_slots // 8))


def plan_micro_batches(num_rows: int, micro_batch_rows: int,
                       num_minibatches: int) -> list[list[np.ndarray]]:
  """Row indices of every micro-batch of every minibatch (host-side batch split).

  Row r goes to minibatch r mod m (m = `num_minibatches`); a minibatch's rows are cut into
  micro-batches of exactly `micro_batch_rows` rows, the last one padded with -1 (an empty row). A
  minibatch with no row gets no micro-batch (its update is skipped as having no data).

  Returns:
    m lists of int64 [micro_batch_rows] index arrays.
  """
  plan = []
  for j in range(num_minibatches):
    rows = np.arange(j, num_rows, num_minibatches)
    n = -(-len(rows) // micro_batch_rows)
    padded = np.full(n * micro_batch_rows, -1, np.int64)
    padded[:len(rows)] = rows
    plan.append([padded[i * micro_batch_rows:(i + 1) * micro_batch_rows] for i in range(n)])
  return plan


def micro_batch_plan(rows: int, micro_batch_rows: int | None = None, num_minibatches: int = 1
                     ) -> tuple[int, int]:
  """(micro-batches, rows processed) of a learner step on `rows` rows: the size of
  `plan_micro_batches(rows, micro_batch_rows, num_minibatches)` (each micro-batch processes
  micro_batch_rows rows, padding included). Without `micro_batch_rows`: one micro-batch per
  minibatch, `rows` rows processed."""
  if not micro_batch_rows:
    return num_minibatches, rows
  micro = sum(len(m) for m in plan_micro_batches(rows, micro_batch_rows, num_minibatches))
  return micro, micro * micro_batch_rows
