"""The pure learner step: recompute log-probs, objective, accumulate gradients, apply or skip.

One call = one optimizer step (policy version v -> v + 1). The [B, L] batch is split into k
micro-batches (row r -> micro-batch r mod k) scanned with `jax.lax.scan`, so the compiled program
does not depend on k beyond the scan length. Each micro-batch loss is rescaled so that the sum
over micro-batches equals the objective of the whole batch:

  token_mean:    L = sum_m (N_m / N) L_m,  N_m valid tokens of micro-batch m, N = sum_m N_m;
  sequence_mean: L = sum_m (S_m / S) L_m,  S_m samples with a valid token (rows are never split,
                 so a sample lies in one micro-batch);
  constant:      L = sum_m L_m            (each L_m is already divided by the fixed constant).

Diagnostics are those of the objective evaluated once on the whole batch (from the per-token
log-probs and entropies the scan returns), so they do not depend on k either.

Letters: B batch rows, L tokens per row, V vocab, k micro-batches.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
import optax

from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe import objectives
from rlax_pipe import offpolicy
from rlax_pipe.learner import optimizer
from rlax_pipe.learner.config import LearnerConfig
from rlax_pipe.learner.train_state import TrainState
from rlax_pipe.model import ModelLike, as_model

Batch = dict[str, jax.Array]

BATCH_FIELDS: tuple[str, ...] = (
    "tokens", "positions", "segment_ids", "loss_mask", "behavior_logprobs", "policy_versions",
    "advantages")
INT_FIELDS: tuple[str, ...] = ("tokens", "positions", "segment_ids", "policy_versions")
# Contract dtypes of the batch fields (DESIGN.md, TrainBatch).
BATCH_DTYPES = {name: (jnp.int32 if name in INT_FIELDS else jnp.float32) for name in BATCH_FIELDS}


def check_batch(batch: Batch) -> tuple[int, int]:
  """Checks names, ranks, shapes and dtype kinds of a batch dict; returns (B, L).

  Raises:
    ValueError: on a missing or extra field, or an array that is not [B, L] like the tokens.
    TypeError: on an integer field that is not integer, or a float field that is not floating.
  """
  if set(batch) != set(BATCH_FIELDS):
    raise ValueError(f"batch fields {sorted(batch)} != expected {sorted(BATCH_FIELDS)}.")
  shape = tuple(batch["tokens"].shape)
  if len(shape) != 2:
    raise ValueError(f"batch tokens must be [B, L]; got shape {shape}.")
  for name in BATCH_FIELDS:
    x = batch[name]
    if tuple(x.shape) != shape:
      raise ValueError(f"batch {name} has shape {tuple(x.shape)}; tokens are {shape}.")
    want = jnp.integer if name in INT_FIELDS else jnp.floating
    if not jnp.issubdtype(x.dtype, want):
      raise TypeError(f"batch {name} has dtype {x.dtype}; expected {want.__name__}.")
  return shape


def shifted_token_logprobs(logits_BLV: jax.Array, tokens_BL: jax.Array,
                           sampling_cfg: logprobs_lib.SamplingConfig):
  """Log-prob and entropy of token t under the processed distribution of the logits at t - 1.

  Uses `logprobs.processed_logprobs` (the sampler's processing: temperature, top-k, top-p),
  gathered exactly as `logprobs.token_logprobs` does. Position 0 has no predecessor and gets 0.

  Args:
    logits_BLV: float32 [B, L, V] model logits (position t predicts token t + 1).
    tokens_BL: int32 [B, L] token ids.
    sampling_cfg: the sampler's SamplingConfig.

  Returns:
    (logp_BL float32, differentiable; entropy_BL float32 in nats, gradient stopped).
  """
  if logits_BLV.ndim != 3 or tokens_BL.shape != logits_BLV.shape[:2]:
    raise ValueError(f"logits {logits_BLV.shape} vs tokens {tokens_BL.shape}: need [B, L, V], "
                     "[B, L].")
  logp_all = logprobs_lib.processed_logprobs(logits_BLV[:, :-1], sampling_cfg)
  logp = jnp.take_along_axis(logp_all, tokens_BL[:, 1:, None], axis=-1)[..., 0]
  ent = logprobs_lib.entropy(jax.lax.stop_gradient(logp_all))
  pad = jnp.zeros((tokens_BL.shape[0], 1), jnp.float32)
  return jnp.concatenate([pad, logp], axis=1), jnp.concatenate([pad, ent], axis=1)


def completion_mask(loss_mask_BL: jax.Array, segment_ids_BL: jax.Array) -> jax.Array:
  """Loss mask restricted to tokens scored within their own (non-padding) segment.

  Token t is scored by the logits at t - 1, so it must have a predecessor of the same segment
  id, and padding (segment 0) never counts. float32 [B, L] in {0, 1}.
  """
  same_prev = jnp.concatenate(
      [jnp.zeros((segment_ids_BL.shape[0], 1), bool),
       segment_ids_BL[:, 1:] == segment_ids_BL[:, :-1]], axis=1)
  keep = (loss_mask_BL > 0) & same_prev & (segment_ids_BL > 0)
  return keep.astype(jnp.float32)


def num_samples(valid_BL: jax.Array, segment_ids_BL: jax.Array) -> jax.Array:
  """Number of (row, segment id) samples that hold at least one valid token (int32 scalar)."""
  b, l = valid_BL.shape
  ids = jnp.arange(b, dtype=jnp.int32)[:, None] * (l + 1) + jnp.clip(segment_ids_BL, 0, l)
  counts = jax.ops.segment_sum(valid_BL.astype(jnp.int32).reshape(-1), ids.reshape(-1),
                               num_segments=b * (l + 1))
  return jnp.sum(counts > 0).astype(jnp.int32)


def normalizer_count(mask_BL: jax.Array, lag_BL: jax.Array, segment_ids_BL: jax.Array,
                     cfg: objectives.ObjectiveConfig) -> jax.Array:
  """The count the objective divides by (float32 scalar): see the module docstring.

  token_mean: valid tokens; sequence_mean: samples with a valid token; constant: 1 (each
  micro-batch loss is already absolute, so micro-batch losses simply add up).
  """
  valid = offpolicy.lag_keep_mask(mask_BL, lag_BL, cfg.max_lag)
  if cfg.aggregation == "token_mean":
    return jnp.sum(valid).astype(jnp.float32)
  if cfg.aggregation == "sequence_mean":
    return num_samples(valid, segment_ids_BL).astype(jnp.float32)
  return jnp.float32(1.0)


def _split(x_BL: jax.Array, k: int) -> jax.Array:
  """[B, L] -> [k, B/k, L] with row r in micro-batch r mod k (keeps row sharding local)."""
  b = x_BL.shape[0]
  return jnp.swapaxes(x_BL.reshape((b // k, k) + x_BL.shape[1:]), 0, 1)


def _merge(x_kML: jax.Array) -> jax.Array:
  """Inverse of `_split`: [k, B/k, L] -> [B, L]."""
  k, m = x_kML.shape[:2]
  return jnp.swapaxes(x_kML, 0, 1).reshape((k * m,) + x_kML.shape[2:])


def _inputs(batch: Batch, version: jax.Array):
  """(mask, lag) for the objective: completion tokens and lag = version - policy version."""
  mask = completion_mask(batch["loss_mask"], batch["segment_ids"])
  lag = (version - batch["policy_versions"]).astype(jnp.int32)
  return mask, lag


def make_train_step(model: ModelLike, learner_cfg: LearnerConfig,
                    objective_cfg: objectives.ObjectiveConfig,
                    sampling_cfg: logprobs_lib.SamplingConfig, tx: optax.GradientTransformation,
                    microbatch_sharding: NamedSharding | None = None,
                    params_sharding: Any = None) -> Callable[[TrainState, Batch], Any]:
  """Builds `step(state, batch) -> (state, metrics)`, a pure function to jit (and donate state).

  The step (policy version v = state.version):
    1. splits the batch into `learner_cfg.micro_batches` micro-batches and, for each, runs the
       forward pass, recomputes log pi of every token with the sampler's logit processing,
       lag = v - policy_versions, and differentiates the rescaled objective (see module doc).
       The proximal policy of decoupled PPO is the policy at the start of this optimizer step;
       every micro-batch is evaluated with those same params, so prox log-probs are the
       stop-gradient of the recomputed log-probs (no second forward pass is needed);
    2. evaluates the objective's diagnostics on the whole batch;
    3. if the loss and the gradient global norm are finite, applies clip + AdamW and sets
       version v + 1; otherwise keeps params, optimizer state and version unchanged (skip),
       and counts the skip.

  Args:
    model: the model (`rlax_pipe.model.Model` or a `ModelConfig` of the built-in one; its
      cache-free forward is used).
    learner_cfg: learner configuration (micro_batches, remat, schedule).
    objective_cfg: objective configuration; `objective_cfg.name` picks the objective.
    sampling_cfg: the sampler's logit processing (temperature, top-k, top-p).
    tx: optimizer from `optimizer.make_optimizer(learner_cfg.optimizer)`.
    microbatch_sharding: optional sharding constraint for [B/k, L] micro-batch arrays.
    params_sharding: optional sharding tree of the params (constrains the gradient sum).

  Returns:
    step(state: TrainState, batch: dict of [B, L] arrays with `BATCH_FIELDS`) ->
    (TrainState, metrics dict of device scalars and `lag_hist` int32[hist_bins]). Metric
    names: the `ObjectiveDiagnostics` fields, plus loss, grad_norm (before clipping),
    update_norm, param_norm, learning_rate, tokens_processed (non-padding tokens),
    negative_lag_tokens (completion tokens stamped with a version newer than the learner's:
    a pipeline bug, treated as lag 0 by the objectives),
    is_finite, loss_finite, grad_finite, inputs_finite (advantages and behavior log-probs at
    completion tokens), logp_finite (recomputed log-probs at completion tokens), version and
    step (after the step), nonfinite_consecutive, nonfinite_total.
  """
  objective = objectives.get_objective(objective_cfg.name)
  model = as_model(model)
  k = learner_cfg.micro_batches

  def constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)

  def microbatch_loss(params, mb, version, total):
    mb = {name: constrain(x, microbatch_sharding) for name, x in mb.items()}
    logits, _ = model.forward(params, mb["tokens"], mb["positions"],
                              segment_ids_BT=mb["segment_ids"], remat=learner_cfg.remat)
    logp, ent = shifted_token_logprobs(logits, mb["tokens"], sampling_cfg)
    mask, lag = _inputs(mb, version)
    loss, _ = objective(logp, mb["behavior_logprobs"], mb["advantages"], mask, lag,
                        objective_cfg, prox_logp_BT=jax.lax.stop_gradient(logp),
                        segment_ids_BT=mb["segment_ids"], entropy_BT=ent)
    weight = normalizer_count(mask, lag, mb["segment_ids"], objective_cfg)
    if objective_cfg.aggregation != "constant":
      weight = weight / jnp.maximum(total, 1.0)
    return loss * weight, (logp, ent)

  grad_fn = jax.value_and_grad(microbatch_loss, has_aux=True)

  def step(state: TrainState, batch: Batch):
    b, _ = check_batch(batch)
    if b % k:
      raise ValueError(f"batch rows B={b} are not a multiple of micro_batches={k}.")
    version = state.version
    mask, lag = _inputs(batch, version)
    total = normalizer_count(mask, lag, batch["segment_ids"], objective_cfg)
    params = state.params

    def body(carry, mb):
      grad_acc, loss_acc = carry
      (loss, aux), grads = grad_fn(params, mb, version, total)
      grad_acc = jax.tree.map(jnp.add, grad_acc, grads)
      grad_acc = grad_acc if params_sharding is None else jax.tree.map(
          jax.lax.with_sharding_constraint, grad_acc, params_sharding)
      return (grad_acc, loss_acc + loss), aux

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, loss), (logp_k, ent_k) = jax.lax.scan(
        body, (zeros, jnp.float32(0.0)), {n: _split(x, k) for n, x in batch.items()})
    logp, ent = _merge(logp_k), _merge(ent_k)

    _, diag = objective(logp, batch["behavior_logprobs"], batch["advantages"], mask, lag,
                        objective_cfg, prox_logp_BT=logp, segment_ids_BT=batch["segment_ids"],
                        entropy_BT=ent)

    grad_norm = optax.tree.norm(grads)
    loss_finite = jnp.isfinite(loss)
    grad_finite = jnp.isfinite(grad_norm)
    ok = loss_finite & grad_finite
    updates, new_opt_state = tx.update(grads, state.opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(ok, new, old)
    bad = jnp.logical_not(ok).astype(jnp.int32)
    new_state = TrainState(
        params=jax.tree.map(keep, new_params, params),
        opt_state=jax.tree.map(keep, new_opt_state, state.opt_state),
        version=version + (1 - bad),
        rng=jax.random.split(jax.random.wrap_key_data(state.rng))[0],
        step=state.step + 1,
        nonfinite_consecutive=(state.nonfinite_consecutive + 1) * bad,
        nonfinite_total=state.nonfinite_total + bad,
    )
    new_state = new_state._replace(rng=jax.random.key_data(new_state.rng))

    completion = mask > 0
    finite_at = lambda x: jnp.all(jnp.where(completion, jnp.isfinite(x), True))
    metrics = dict(diag._asdict())
    metrics.update(
        loss=loss,
        grad_norm=grad_norm,
        update_norm=jnp.where(ok, optax.tree.norm(updates), 0.0),
        param_norm=optax.tree.norm(new_state.params),
        learning_rate=optimizer.learning_rate(learner_cfg.optimizer, version),
        tokens_processed=jnp.sum(batch["segment_ids"] > 0).astype(jnp.int32),
        negative_lag_tokens=jnp.sum(completion & (lag < 0)).astype(jnp.int32),
        is_finite=ok,
        loss_finite=loss_finite,
        grad_finite=grad_finite,
        inputs_finite=finite_at(batch["advantages"]) & finite_at(batch["behavior_logprobs"]),
        logp_finite=finite_at(logp),
        version=new_state.version,
        step=new_state.step,
        nonfinite_consecutive=new_state.nonfinite_consecutive,
        nonfinite_total=new_state.nonfinite_total,
    )
    return new_state, metrics

  return step
