"""The sampler's device programs: prefill, the K-step decode dispatch, and slot-state updates.

Scheduler state that changes every token lives on the device (`SlotState`: block tables,
pending tokens, positions, active flags, stop lengths, granted capacity, the sampling PRNG key)
and is advanced there by `decode_dispatch`, a `lax.while_loop` of up to K decode steps. The host
joins once per dispatch: it sends only what it changed (a slot-update matrix and block-table
deltas) and reads back one packed result (tokens, log-probs, per-slot counts).

A dispatch stops early when a slot needs a KV position beyond the pages the host granted, when
every slot is done, or when `refill_at` slots have finished (the host asks for that when
requests wait for a slot: `refill_at` = min(waiting requests, ceil(B / 8)), so freed slots are
refilled in batches and a dispatch is not cut short by every single finish). A slot
stops on a stop id (kept as its last token, nothing sampled after it) or at its stop length.

All programs are jitted with the pool (and slot state) donated and carried through their loops,
so KV writes are in place (verified on the compiled program: `tests/sampler/test_in_place.py`).

Letters: B slots, W block-table width, K decode steps per dispatch, R prefill rows, T prefill
bucket, U table deltas, V vocab.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe.model import HiddenStatesModel, Model
from rlax_pipe.sampler.page_pool import PoolLayout
from rlax_pipe.sampler.paged_cache import PagedKVCache

# Rows of the slot-update matrix int32 [UPDATE_ROWS, B] sent before a dispatch.
UPDATE_FIELDS: tuple[str, ...] = ("changed", "token", "pos", "active", "end", "cap")
UPDATE_ROWS = len(UPDATE_FIELDS)


@struct.dataclass
class SlotState:
  """Per-slot decode state, on the device.

  The block tables int32 [B, W] (pages in [0, P)) travel beside it as their own (donated)
  argument.

  Attributes:
    token: int32 [B] pending token (fed by the next decode step).
    pos: int32 [B] position of the pending token.
    active: bool [B] slot is generating.
    end: int32 [B] sequence length (prompt + completion) at which the slot is done.
    cap: int32 [B] KV positions its granted pages hold; the slot may feed positions < cap.
    rng_data: uint32 key data (`jax.random.key_data`) of the sampler's PRNG key (split once per
      decode step). Raw data, not a typed key: a typed key placed by `jax.device_put` (initial
      state, `load_rng_state`, a restore) has another abstract type than one returned by the
      dispatch's loop, so a dispatch fed one after the other compiled a second variant after
      `warmup` (#27 item 10); plain uint32 arrays have one type however they were made.
  """

  token: jax.Array
  pos: jax.Array
  active: jax.Array
  end: jax.Array
  cap: jax.Array
  rng_data: jax.Array

  @classmethod
  def zeros(cls, num_slots: int, rng: jax.Array) -> SlotState:
    """All slots idle, sampling from typed key `rng`. (Not donated anywhere: XLA may hand back
    one buffer for equal constants.)"""
    z = jnp.zeros(num_slots, jnp.int32)
    return cls(token=z, pos=z, active=jnp.zeros(num_slots, bool), end=z, cap=z,
               rng_data=jax.random.key_data(rng))


def _constrain(tree, sharding):
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def apply_slot_updates(state: SlotState, updates_XB: jax.Array) -> SlotState:
  """Overwrites the slots whose `changed` row is 1 with the host's values (see UPDATE_FIELDS)."""
  changed = updates_XB[0] > 0
  pick = lambda new, old: jnp.where(changed, new.astype(old.dtype), old)
  return state.replace(token=pick(updates_XB[1], state.token), pos=pick(updates_XB[2], state.pos),
                       active=pick(updates_XB[3] > 0, state.active),
                       end=pick(updates_XB[4], state.end), cap=pick(updates_XB[5], state.cap))


@functools.partial(jax.jit, static_argnames=("replicated",), donate_argnums=(0,))
def write_tables(tables_BW, slot_U, col_U, page_U, *, replicated):
  """Block-table deltas, in place: tables[slot, col] = page (slot >= B marks padding)."""
  tables = tables_BW.at[slot_U, col_U].set(page_U, mode="drop")
  return jax.lax.with_sharding_constraint(tables, replicated)


@functools.partial(jax.jit, static_argnames=("layout", "sharding"), donate_argnums=(0,))
def zero_pages(pools, pages_N, *, layout: PoolLayout, sharding):
  """Zeroes pages (all layers; page >= P: skipped) so that no stale value sits in a page a
  kernel reads (kernels multiply masked probabilities by values)."""
  out = []
  for p in pools:
    if layout.combined:
      view = p.reshape((layout.num_layers, layout.num_pages) + p.shape[1:])
      view = view.at[:, pages_N].set(0, mode="drop")
    else:
      view = p.reshape((p.shape[0], layout.num_layers, layout.num_pages) + p.shape[2:])
      view = view.at[:, :, pages_N].set(0, mode="drop")
    out.append(jax.lax.with_sharding_constraint(view.reshape(p.shape), sharding))
  return tuple(out)


def _cache(pools, tables, layout, impl, chunk_pages, mesh, interpret):
  return PagedKVCache(pools=pools, block_tables=tables, layout=layout, impl=impl,
                      chunk_pages=chunk_pages, mesh=mesh, interpret=interpret)


@functools.partial(jax.jit, static_argnames=(
    "model", "layout", "impl", "chunk_pages", "mesh", "interpret", "sharding"),
                   donate_argnums=(1,))
def prefill_step(params, pools, tables_RW, tokens_RT, starts_R, lengths_R, *,
                 model: Model, layout: PoolLayout, impl: str, chunk_pages: int, mesh,
                 interpret: bool, sharding):
  """Writes the KV of positions [starts[r], starts[r] + lengths[r]) of each row into its pages.

  Positions below starts[r] must already be cached (a shared prompt prefix, or the part kept
  before a recompute); the new tokens attend to them.

  Args:
    params: model parameters.
    pools: the pool arrays (donated).
    tables_RW: int32 [R, W] pages of each row.
    tokens_RT: int32 [R, T] tokens at positions starts[r] + t (padding beyond lengths[r]).
    starts_R, lengths_R: int32 [R] first position and number of real tokens (0 = padding row).
    model, layout, impl, chunk_pages, mesh, interpret, sharding: static.

  Returns:
    The updated pools. The logits are not computed (dead code).
  """
  r, t = tokens_RT.shape
  offsets = jnp.arange(t, dtype=jnp.int32)[None, :]
  positions = starts_R[:, None] + offsets
  valid = offsets < lengths_R[:, None]
  cache = _cache(pools, tables_RW, layout, impl, chunk_pages, mesh, interpret)
  _, cache = model.forward(params, tokens_RT, positions, cache=cache, valid_BT=valid)
  return _constrain(cache.pools, sharding)


def head_nonfinite_ids(model: Model, params) -> jax.Array | None:
  """bool [V]: ids whose output-head column holds a NaN or an inf (never sampled; #27 item 1),
  or None for a model without `output_head` (a forward-only model: its logits are used as they
  are). An E x V test and reduction, no matmul; `head_mask_program` runs it once per version."""
  if not isinstance(model, HiddenStatesModel):
    return None
  return logprobs_lib.nonfinite_columns(model.output_head(params))


@functools.partial(jax.jit, static_argnames=("model", "replicated"))
def _head_mask(params, *, model, replicated):
  return jax.lax.with_sharding_constraint(head_nonfinite_ids(model, params), replicated)


def head_mask_program(model: Model, replicated) -> Callable[[Any], jax.Array] | None:
  """`params -> bool [V]` (jitted, result replicated over the replica's mesh) computing
  `head_nonfinite_ids`, or None for a model without `output_head`."""
  if not isinstance(model, HiddenStatesModel):
    return None
  return lambda params: _head_mask(params, model=model, replicated=replicated)


def _decode_one(params, pools, tables, state: SlotState, nonfinite_V, *, model, sampling, layout,
                impl, chunk_pages, mesh, interpret, stop_ids):
  """One decode step of every active slot: (pools, state, tokens [B], logps [B], done [B],
  routes int32 [B, L_moe, k] of the fed tokens for an MoE model, else None).
  `nonfinite_V`: bool [V] ids never drawn (`head_nonfinite_ids`), or None."""
  cache = _cache(pools, tables, layout, impl, chunk_pages, mesh, interpret)
  routes = None
  if getattr(model, "n_moe_layers", 0):  # record the experts each fed token was routed to
    logits, cache, moe = model.forward(params, state.token[:, None], state.pos[:, None],
                                       cache=cache, valid_BT=state.active[:, None],
                                       return_moe=True)
    routes = moe.routes_BTLk[:, 0]
  else:
    logits, cache = model.forward(params, state.token[:, None], state.pos[:, None], cache=cache,
                                  valid_BT=state.active[:, None])
  rng, draw = jax.random.split(jax.random.wrap_key_data(state.rng_data))
  tokens, logps = logprobs_lib.sample(draw, logits[:, 0], sampling, nonfinite_V)
  live = state.active
  stop = jnp.zeros_like(live)
  for sid in stop_ids:
    stop = stop | (tokens == sid)
  done = live & (stop | (state.pos + 2 >= state.end))
  state = state.replace(token=jnp.where(live, tokens, state.token),
                        pos=jnp.where(live, state.pos + 1, state.pos),
                        active=live & ~done, rng_data=jax.random.key_data(rng))
  return cache.pools, state, tokens, logps, done, routes


@functools.partial(jax.jit, static_argnames=(
    "model", "sampling", "layout", "impl", "chunk_pages", "mesh", "interpret", "stop_ids",
    "steps", "sharding", "replicated"), donate_argnums=(1,))
def decode_dispatch(params, pools, tables_BW, state: SlotState, updates_XB, refill_at,
                    nonfinite_V=None, *,
                    model: Model, sampling: logprobs_lib.SamplingConfig,
                    layout: PoolLayout, impl: str, chunk_pages: int, mesh, interpret: bool,
                    stop_ids: tuple[int, ...], steps: int, sharding, replicated):
  """Up to `steps` decode steps of every active slot, on the device (a `lax.while_loop`).

  Args:
    params: model parameters (one version for the whole dispatch).
    pools: the pool arrays (donated).
    tables_BW: int32 [B, W] block tables (read only).
    state: `SlotState`.
    updates_XB: int32 [UPDATE_ROWS, B] host changes applied first (`apply_slot_updates`).
    refill_at: int32 scalar; end the dispatch once this many slots finished in it (0 = never).
    nonfinite_V: bool [V], the ids whose output-head column is non-finite in these params
      (`head_nonfinite_ids`, computed once per installed version by the engine); never
      sampled. None = computed here, once per dispatch (outside the decode loop).
    model, sampling, layout, impl, chunk_pages, mesh, interpret, stop_ids, steps,
      sharding (pool), replicated: static.

  Returns:
    (pools, state, ints int32 [steps + 2, B], logps float32 [steps, B], routes): ints rows
    0..steps-1 are the tokens drawn at each step (valid for the first count[b] steps of slot b),
    row steps is count [B] (tokens slot b generated), row steps + 1 holds the number of steps
    run (every entry); logps are the behaviour log-probs of those tokens; routes (MoE models;
    None otherwise) int16 [steps, B, L_moe, k] the experts of the token each step fed, i.e.
    the routing that produced that step's token (`rlax_pipe.router_replay`).
  """
  state = apply_slot_updates(state, updates_XB)
  b = state.token.shape[0]
  nonfinite = head_nonfinite_ids(model, params) if nonfinite_V is None else nonfinite_V
  one = functools.partial(_decode_one, nonfinite_V=nonfinite, model=model, sampling=sampling,
                          layout=layout,
                          impl=impl, chunk_pages=chunk_pages, mesh=mesh, interpret=interpret,
                          stop_ids=stop_ids)

  def can_continue(state):
    blocked = jnp.any(state.active & (state.pos >= state.cap))
    return jnp.any(state.active) & ~blocked

  def cond(carry):
    step, go = carry[0], carry[1]
    return (step < steps) & go

  def body(carry):
    step, _, pools, state, toks, logps, count, finished, routes = carry
    live = state.active
    pools, state, t, lp, done, r = one(params, pools, tables_BW, state)
    toks = toks.at[step].set(jnp.where(live, t, 0))
    logps = logps.at[step].set(jnp.where(live, lp, 0.0))
    if routes is not None:
      routes = routes.at[step].set(r.astype(routes.dtype))
    count = count + live.astype(jnp.int32)
    finished = finished + jnp.sum(done, dtype=jnp.int32)
    go = can_continue(state) & ((refill_at <= 0) | (finished < refill_at))
    return step + 1, go, pools, state, toks, logps, count, finished, routes

  n_moe = getattr(model, "n_moe_layers", 0)
  routes0 = None if not n_moe else jnp.zeros(
      (steps, b, n_moe, model.cfg.n_experts_per_tok), jnp.int16)
  init = (jnp.int32(0), can_continue(state), pools, state, jnp.zeros((steps, b), jnp.int32),
          jnp.zeros((steps, b), jnp.float32), jnp.zeros(b, jnp.int32), jnp.int32(0), routes0)
  n, _, pools, state, toks, logps, count, _, routes = jax.lax.while_loop(cond, body, init)
  ints = jnp.concatenate([toks, count[None], jnp.broadcast_to(n, (1, b))], axis=0)
  if routes is not None:
    routes = jax.lax.with_sharding_constraint(routes, replicated)
  return (_constrain(pools, sharding), _constrain(state, replicated),
          jax.lax.with_sharding_constraint(ints, replicated),
          jax.lax.with_sharding_constraint(logps, replicated), routes)
