"""Router replay: the experts the sampler routed each generated token to, recorded, packed and
handed to the learner so that it routes those tokens the same way.

A mixture-of-experts sampler (bf16, paged KV, a decode step at a time) and learner (fp32, packed
full sequences) can pick different top-k experts for the same token at the same policy version
(a near tie in the router's logits flips under rounding), and then their log-probs differ by far
more than rounding. Replaying the sampler's choices in the learner removes that source of
mismatch (R3, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers", Ma et al. 2025; routing replay in Megatron-LM, slime, verl). The routing *weights* are
still the learner's own router's, gathered at the replayed experts (`model.moe.route`), so the
router keeps its gradient.

Layout and cost. Per generated token and MoE layer, the k selected expert ids: [T, L_moe, k] per
sample, stored in the smallest signed integer type that holds every id and the `NO_ROUTE`
marker: int8 when n_experts <= 127, else int16 (`routes_dtype`). Memory per token:
L_moe * k * itemsize bytes (`route_bytes_per_token`): 96 B for gpt-oss-20b (24 x 4 x int8),
768 B for Qwen3-30B-A3B (48 x 8 x int16), against 12 bytes for the token, log-prob and version.

Which tokens are replayed. A decode step feeds the pending token at position p and samples the
token at p + 1, so the routes it records, stored as routes[t] beside completion token t's
log-prob and version, are those of the token *before* t (position P - 1 + t for a P-token
prompt): the routing that produced token t. The packed batch puts them at those positions, so
the learner replays every decode step exactly: the last prompt token and every completion token
but the last (which is never fed, and scores nothing). The other prompt tokens were prefilled;
their routes are not recorded and the learner routes them with its own router (`NO_ROUTE` in
the packed batch), so their K/V (which later tokens attend to) may come from other experts than
in the sampler. Padding is `NO_ROUTE` too.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

ROUTER_REPLAY_MODES: tuple[str, ...] = ("off", "replay")
NO_ROUTE = -1  # a token the learner routes itself (prompt, padding, a dense model's token)


def routes_dtype(n_experts: int) -> np.dtype:
  """int8 when every expert id and `NO_ROUTE` fit (n_experts <= 127), else int16.

  Raises:
    ValueError: if n_experts is not in [1, 32767].
  """
  if not 1 <= n_experts <= np.iinfo(np.int16).max:
    raise ValueError(f"routes_dtype: n_experts={n_experts} must be in [1, 32767].")
  return np.dtype(np.int8 if n_experts <= np.iinfo(np.int8).max else np.int16)


def route_bytes_per_token(n_moe_layers: int, experts_per_tok: int, n_experts: int) -> int:
  """Bytes one generated token's routes take: L_moe * k * itemsize(`routes_dtype`)."""
  return n_moe_layers * experts_per_tok * routes_dtype(n_experts).itemsize


def pack_routes(routes_TLk, n_experts: int) -> np.ndarray:
  """Host routes [T, L_moe, k] in the compact dtype (`routes_dtype`), checked.

  Args:
    routes_TLk: integer array-like [T, L_moe, k] of expert ids in [0, n_experts).
    n_experts: X.

  Returns:
    np.ndarray [T, L_moe, k] of int8 / int16.

  Raises:
    ValueError: on a rank other than 3, a non-integer dtype or an id out of range.
  """
  r = np.asarray(routes_TLk)
  if r.ndim != 3 or not np.issubdtype(r.dtype, np.integer):
    raise ValueError(f"pack_routes: routes must be an integer array [T, L_moe, k]; got "
                     f"{r.dtype} of shape {r.shape}.")
  if r.size and (r.min() < 0 or r.max() >= n_experts):
    raise ValueError(f"pack_routes: expert ids must be in [0, {n_experts}); got "
                     f"[{r.min()}, {r.max()}].")
  return r.astype(routes_dtype(n_experts))


def batch_routes(completion_routes: Sequence[np.ndarray | None], placements, num_rows: int,
                 seq_len: int) -> np.ndarray | None:
  """The packed batch's routes [B, L, L_moe, k]: each sample's recorded routes at the positions
  of the tokens fed to produce its completion (module docstring), `NO_ROUTE` everywhere else;
  None when no sample has routes (a dense model, or recording off).

  Args:
    completion_routes: per sample, [T_i, L_moe, k] or None.
    placements: per sample, (row, column of its last prompt token).
    num_rows, seq_len: B, L.

  Returns:
    [B, L, L_moe, k] in the widest of the samples' dtypes, or None.

  Raises:
    ValueError: if some samples have routes and others do not, or their [L_moe, k] differ.
  """
  have = [r is not None for r in completion_routes]
  if not any(have):
    return None
  if not all(have):
    missing = [i for i, h in enumerate(have) if not h]
    raise ValueError(f"batch_routes: samples {missing[:5]} have no routes while others do; "
                     "every sample of an MoE run with router replay must carry them.")
  tails = {tuple(r.shape[1:]) for r in completion_routes}
  if len(tails) != 1:
    raise ValueError(f"batch_routes: samples disagree on routes [L_moe, k]: {sorted(tails)}.")
  dtype = np.result_type(np.int8, *[r.dtype for r in completion_routes])  # the widest
  out = np.full((num_rows, seq_len) + tails.pop(), NO_ROUTE, dtype)
  for r, (row, col) in zip(completion_routes, placements):
    out[row, col:col + r.shape[0]] = r
  return out
