"""The pure learner step, as three fixed-shape functions the `Learner` drives batch by batch.

A learner batch of any number of rows is cut on the host into minibatches (row r -> minibatch
r mod m, `LearnerConfig.num_minibatches`) and each minibatch into micro-batches of exactly
R = `micro_batch_rows` rows (the last one padded with empty rows). Three jitted programs, each
compiled once for a given row length L, do the rest:

  `prox(state, mb[, frozen])`: log-probs of the params before the batch's first update (the proximal
      policy of decoupled PPO), for minibatches 2..m only;
  `accumulate(state, acc, stats, mb, prox, use_prox[, frozen, ref_params])`: forward, chunked
      log-probs, the objective's per-token loss, masking and aggregation terms, gradient; adds
      the gradient of the loss numerator and the normaliser counts into `acc` and the
      diagnostics' sufficient statistics into `stats`. With `ObjectiveConfig.kl` != "off" it
      also takes the reference params and computes the reference log-probs in the same program
      (a second forward of the same micro-batch, chunked the same way, no gradient);
  `apply(state, acc, stats, final)`: divides by the minibatch's normaliser (so the result is
      exactly the minibatch's loss gradient, whatever the micro-batching: `token_loss`), clips,
      AdamW; skips the update when the minibatch has no token that contributes to the loss or
      when its loss or gradient is not finite. With `final` it closes the batch: the policy
      version advances once if any update was applied, and the metrics are produced.

Masking, aggregation and diagnostics happen once per token, in `accumulate`, from values it
already has (no second evaluation of the objective). Letters: R rows, L tokens per row, V vocab.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe import offpolicy
from rlax_pipe.learner import token_loss
from rlax_pipe.learner import optimizer
from rlax_pipe.learner.config import LearnerConfig
from rlax_pipe.learner.train_state import TrainState
from rlax_pipe.model import HiddenStatesModel, ModelLike, as_model
from rlax_pipe.model.lora import LoraAdapters
from rlax_pipe.objectives import ObjectiveConfig

Batch = dict[str, jax.Array]

BATCH_FIELDS: tuple[str, ...] = (
    "tokens", "positions", "segment_ids", "loss_mask", "behavior_logprobs", "policy_versions",
    "advantages")
INT_FIELDS: tuple[str, ...] = ("tokens", "positions", "segment_ids", "policy_versions")
# Contract dtypes of the batch fields (DESIGN.md, TrainBatch).
BATCH_DTYPES = {name: (jnp.int32 if name in INT_FIELDS else jnp.float32) for name in BATCH_FIELDS}
# Router replay (`ObjectiveConfig.router_replay="replay"`): one more field, [B, L, L_moe, k]
# expert ids (`router_replay.NO_ROUTE` = the learner routes that token), int16 on the way in.
ROUTES_FIELD = "routes"
ROUTES_DTYPE = jnp.int16


def check_batch(batch: Batch) -> tuple[int, int]:
  """Checks names, ranks, shapes and dtype kinds of a batch dict; returns (B, L).

  Raises:
    ValueError: on a missing or extra field, or an array that is not [B, L] like the tokens.
    TypeError: on an integer field that is not integer, or a float field that is not floating.
  """
  if set(batch) - {ROUTES_FIELD} != set(BATCH_FIELDS):
    raise ValueError(f"batch fields {sorted(batch)} != expected {sorted(BATCH_FIELDS)} (and "
                     f"{ROUTES_FIELD!r} with router replay).")
  shape = tuple(batch["tokens"].shape)
  if ROUTES_FIELD in batch:
    r = batch[ROUTES_FIELD]
    if r.ndim != 4 or tuple(r.shape[:2]) != shape or not jnp.issubdtype(r.dtype, jnp.integer):
      raise ValueError(f"batch routes must be integer [B, L, L_moe, k] with [B, L] = {shape}; "
                       f"got {r.dtype} {tuple(r.shape)}.")
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


class GradAccum(NamedTuple):
  """Sums over the micro-batches of one minibatch (reset by `apply`).

  Attributes:
    grads: float32 tree like the params: sum of d(loss numerator) / d params.
    numerator: float32 scalar, sum of the loss numerators (`token_loss.loss_sums`).
    counts: `token_loss.Counts`, summed.
    used: int32 scalar, tokens that contribute to the loss.
  """

  grads: Any
  numerator: jax.Array
  counts: token_loss.Counts
  used: jax.Array


class BatchStats(NamedTuple):
  """Sums over the whole learner batch (all minibatches; reset by the final `apply`).

  Attributes:
    sums: `offpolicy.DiagnosticSums` of every token of the batch.
    loss_sum / grad_norm_sum: sums over minibatches with data of their loss and pre-clip
      gradient norm; update_norm_sum: over applied updates.
    with_data: minibatches with a token that contributes to the loss.
    updates: applied optimizer updates.
    nonfinite: minibatches with data whose loss or gradient was not finite (skipped).
    loss_finite / grad_finite: all minibatches with data had a finite loss / gradient.
    tokens_processed: non-padding tokens; negative_lag_tokens: completion tokens stamped with a
      version newer than the learner's (a pipeline bug; treated as lag 0 by the objectives).
    inputs_finite: advantages and behaviour log-probs finite at every completion token;
    logp_finite: recomputed log-probs finite at every completion token.
    kl_sum / kl_tokens: sum over valid tokens of the KL estimate towards the reference
      (`token_loss.with_kl`; stays 0 with kl="off") and their count.
    moe_lb_sum / moe_z_sum / moe_weight: MoE models: sums over micro-batches of the router's
      load-balancing loss and z-loss, each weighted by the micro-batch's loss normaliser
      (`token_loss.normalizer` of its own counts), and the sum of those weights (0 if dense).
  """

  sums: offpolicy.DiagnosticSums
  loss_sum: jax.Array
  grad_norm_sum: jax.Array
  update_norm_sum: jax.Array
  with_data: jax.Array
  updates: jax.Array
  nonfinite: jax.Array
  loss_finite: jax.Array
  grad_finite: jax.Array
  tokens_processed: jax.Array
  negative_lag_tokens: jax.Array
  inputs_finite: jax.Array
  logp_finite: jax.Array
  kl_sum: jax.Array
  kl_tokens: jax.Array
  moe_lb_sum: jax.Array
  moe_z_sum: jax.Array
  moe_weight: jax.Array


def init_accum(params: Any) -> GradAccum:
  """Zero gradient accumulator for `params` (float32 leaves)."""
  zero = jnp.zeros((), jnp.float32)
  return GradAccum(grads=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
                   numerator=zero, counts=token_loss.Counts(zero, zero, zero),
                   used=jnp.zeros((), jnp.int32))


def init_stats(hist_bins: int) -> BatchStats:
  """Batch statistics of an empty batch."""
  zero_f, zero_i, true = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32),
                          jnp.ones((), bool))
  return BatchStats(
      sums=offpolicy.empty_sums(hist_bins), loss_sum=zero_f, grad_norm_sum=zero_f,
      update_norm_sum=zero_f, with_data=zero_i, updates=zero_i, nonfinite=zero_i,
      loss_finite=true, grad_finite=true, tokens_processed=zero_i, negative_lag_tokens=zero_i,
      inputs_finite=true, logp_finite=true, kl_sum=zero_f, kl_tokens=zero_i, moe_lb_sum=zero_f,
      moe_z_sum=zero_f, moe_weight=zero_f)


class StepFns(NamedTuple):
  """The three pure functions of a learner step (see the module docstring); jit each once."""

  prox: Callable[[TrainState, Batch], jax.Array]
  accumulate: Callable[..., tuple[GradAccum, BatchStats]]
  apply: Callable[..., tuple[TrainState, GradAccum, BatchStats, dict]]


def _schedule_step(opt_state: Any) -> jax.Array | None:
  """Index of the last applied update, read from the optimizer state's last `count` leaf (the
  learning-rate schedule's, in `optimizer.make_optimizer`), or None if it has none."""
  counts = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]
            if path and getattr(path[-1], "name", None) == "count"]
  return None if not counts else counts[-1] - 1


def make_step_fns(model: ModelLike, learner_cfg: LearnerConfig,
                  objective_cfg: ObjectiveConfig, sampling_cfg: logprobs_lib.SamplingConfig,
                  tx: optax.GradientTransformation, constrain: Any = None,
                  lora: LoraAdapters | None = None,
                  attention_kernel: Any = "blockwise") -> StepFns:
  """Builds the step's pure functions for one configuration.

  Args:
    model: the model (`rlax_pipe.model.Model`, or a `ModelConfig` of the built-in one; there
      param_dtype = master params and optimizer state, compute_dtype = activations and
      matmuls). A `HiddenStatesModel` gets chunked log-probs, the remat policy, blockwise
      attention and the sharding hook; any other model is run through `forward` (full
      logits, remat on unless "none").
    learner_cfg: learner configuration (remat, logits_chunk_len, schedule).
    objective_cfg: objective configuration; `objective_cfg.name` picks the objective.
    sampling_cfg: the sampler's logit processing (temperature, top-k, top-p).
    tx: optimizer from `optimizer.make_optimizer(learner_cfg.optimizer)`.
    constrain: sharding hook `constrain(x, logical_axes, weight=False)` for the forward pass
      (`rlax_pipe.sharding.compute_constraint`: weights gathered per layer, activations split
      over the batch axes); None = no constraints.
    lora: the adapter space (`rlax_pipe.model.lora.LoraAdapters`) when LoRA is on: then
      `state.params` holds the adapters only (the optimizer state, the gradient accumulator
      and the update touch nothing else) and `prox` / `accumulate` take the frozen base params
      as their last argument `frozen`; the forward runs on `lora.merge(frozen, state.params)`
      and the gradient is taken with respect to the adapters only. None = full fine-tuning
      (`frozen` is then None).
    attention_kernel: the training attention of a `HiddenStatesModel`: "blockwise", a fused
      kernel name (`train_attention.KERNELS`) or an attend callable
      (`train_attention.sharded_flash_attention`, what the learner passes when
      `learner_cfg.attention_impl` resolves to a kernel on its mesh's platform).

  Returns:
    StepFns(prox, accumulate, apply):
      prox(state, mb, frozen=None) -> float32 [R, L] log-probs (gradient stopped);
      accumulate(state, acc, stats, mb, prox_logp [R, L], use_prox bool, frozen=None,
        ref_params=None) -> (acc, stats); frozen is the LoRA base (None without LoRA);
        ref_params (the reference policy's full params, any dtype, e.g. the compute dtype) is
        required exactly when objective_cfg.kl != "off";
      apply(state, acc, stats, final bool) -> (state, zeroed acc, stats, metrics). Metrics
      (meaningful when final): the `ObjectiveDiagnostics` fields; loss and grad_norm (mean over
      minibatches with data; NaN if none), update_norm (mean over applied updates; NaN if
      none), param_norm (of state.params: the adapters with LoRA), learning_rate (of the last
      applied update; NaN if none), tokens_processed, negative_lag_tokens, updates_applied,
      minibatches_with_data, is_finite, loss_finite, grad_finite, inputs_finite, logp_finite,
      version and step (after the step), nonfinite_consecutive, nonfinite_total; with kl !=
      "off" also kl_ref (mean KL estimate per valid token towards the reference, nats; NaN
      without valid tokens); for an MoE model also moe_load_balance_loss and moe_z_loss
      (normaliser-weighted means over the batch's micro-batches, `moe_aux_loss`).
  """
  model = as_model(model)
  c = constrain or (lambda x, *_, **__: x)
  moe_coefs = moe_loss_coefs(model)

  def token_logprobs(params, mb):
    """((logp, entropy), MoeOutputs or None)."""
    # router replay: the sampler's experts for the recorded tokens (`rlax_pipe.router_replay`)
    replay = ({} if ROUTES_FIELD not in mb else
              {"routes_BTLk": mb[ROUTES_FIELD].astype(jnp.int32)})
    if not isinstance(model, HiddenStatesModel):  # forward only: full logits
      logits, _ = model.forward(params, mb["tokens"], mb["positions"],
                                segment_ids_BT=mb["segment_ids"],
                                remat=learner_cfg.remat != "none", **replay)
      return logprobs_lib.next_token_logprobs_from_logits(logits, mb["tokens"],
                                                          sampling_cfg), None
    moe_kw = {} if moe_coefs is None else {"return_moe": True}
    fused = ({} if isinstance(attention_kernel, str) and attention_kernel == "blockwise"
             else {"attention_impl": attention_kernel})
    h = model.hidden_states(params, mb["tokens"], mb["positions"],
                            segment_ids_BT=mb["segment_ids"], remat=learner_cfg.remat,
                            constrain=constrain,
                            attention_block_len=learner_cfg.attention_block_len, **replay,
                            **moe_kw, **fused)
    h, moe_out = h if moe_coefs is not None else (h, None)
    head = c(model.output_head(params), ("embed", "vocab"), weight=True)
    return logprobs_lib.next_token_logprobs(h, head, mb["tokens"], sampling_cfg,
                                            chunk_len=learner_cfg.logits_chunk_len,
                                            batch_groups=learner_cfg.batch_shards,
                                            constrain=constrain,
                                            block_nonfinite=False), moe_out

  def model_params(trainable, frozen):
    """What the model runs on: the trainable params, or the base merged with the adapters."""
    return trainable if lora is None else lora.merge(frozen, trainable)

  def micro_loss(params, mb, prox_logp, use_prox, version, frozen, ref_params):
    (logp, ent), moe_out = token_logprobs(model_params(params, frozen), mb)
    seg = mb["segment_ids"]
    mask = completion_mask(mb["loss_mask"], seg)
    lag = (version - mb["policy_versions"]).astype(jnp.int32)
    prox_logp = jnp.where(use_prox, prox_logp, jax.lax.stop_gradient(logp))
    sel = token_loss.select_valid(logp, mb["behavior_logprobs"], mb["advantages"], mask, lag,
                                  objective_cfg, prox_logp)
    ref_logp = None
    if objective_cfg.kl != "off":
      ref_logp = jax.lax.stop_gradient(token_logprobs(ref_params, mb)[0][0])
    sel, kl_reward = token_loss.with_kl(sel, None, ref_logp, seg, objective_cfg)
    used, out = token_loss.per_token_loss(sel, lag, objective_cfg, seg)
    out, kl_loss = token_loss.with_kl(sel, out, ref_logp, seg, objective_cfg)
    kl_BT = kl_reward if kl_loss is None else kl_loss
    numerator, counts = token_loss.loss_sums(out.loss_BT, sel.valid_BT, mask, seg, objective_cfg)
    moe_weight = jnp.zeros((), jnp.float32)
    lb = z = moe_weight
    if moe_out is not None:
      moe_weight = token_loss.normalizer(counts, objective_cfg)
      lb, z = moe_out.load_balance_loss, moe_out.z_loss
      numerator = numerator + moe_weight * moe_aux_loss(lb, z, *moe_coefs)
    sums = token_loss.diagnostic_sums(sel, out, used, mask, lag, seg, objective_cfg, ent)
    completion = mask > 0
    finite_at = lambda x: jnp.all(jnp.where(completion, jnp.isfinite(x), True))
    extra = dict(
        used=jnp.sum(used, dtype=jnp.int32),
        tokens=jnp.sum(seg > 0, dtype=jnp.int32),
        negative_lag=jnp.sum(completion & (lag < 0), dtype=jnp.int32),
        inputs_finite=finite_at(mb["advantages"]) & finite_at(mb["behavior_logprobs"]),
        logp_finite=finite_at(logp),
        kl_sum=jnp.zeros((), jnp.float32) if kl_BT is None else jnp.sum(
            jnp.where(sel.valid_BT, kl_BT, 0.0), dtype=jnp.float32),
        kl_tokens=jnp.sum(sel.valid_BT, dtype=jnp.int32) if kl_BT is not None else
        jnp.zeros((), jnp.int32),
        moe_lb=moe_weight * lb, moe_z=moe_weight * z, moe_weight=moe_weight)
    return numerator, (counts, sums, extra)

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def prox(state: TrainState, mb: Batch, frozen: Any = None) -> jax.Array:
    return jax.lax.stop_gradient(token_logprobs(model_params(state.params, frozen), mb)[0][0])

  def accumulate(state: TrainState, acc: GradAccum, stats: BatchStats, mb: Batch,
                 prox_logp: jax.Array, use_prox: jax.Array, frozen: Any = None,
                 ref_params: Any = None):
    check_batch(mb)
    if (ref_params is None) != (objective_cfg.kl == "off"):
      raise ValueError(f"accumulate: ObjectiveConfig.kl={objective_cfg.kl!r} needs ref_params "
                       "exactly when it is not 'off'.")
    (numerator, (counts, sums, x)), grads = grad_fn(state.params, mb, prox_logp, use_prox,
                                                    state.version, frozen, ref_params)
    acc = GradAccum(
        grads=jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc.grads, grads),
        numerator=acc.numerator + numerator,
        counts=jax.tree.map(jnp.add, acc.counts, counts), used=acc.used + x["used"])
    stats = stats._replace(
        sums=offpolicy.combine_sums(stats.sums, sums),
        tokens_processed=stats.tokens_processed + x["tokens"],
        negative_lag_tokens=stats.negative_lag_tokens + x["negative_lag"],
        inputs_finite=stats.inputs_finite & x["inputs_finite"],
        logp_finite=stats.logp_finite & x["logp_finite"],
        kl_sum=stats.kl_sum + x["kl_sum"], kl_tokens=stats.kl_tokens + x["kl_tokens"],
        moe_lb_sum=stats.moe_lb_sum + x["moe_lb"], moe_z_sum=stats.moe_z_sum + x["moe_z"],
        moe_weight=stats.moe_weight + x["moe_weight"])
    return acc, stats

  def apply(state: TrainState, acc: GradAccum, stats: BatchStats, final: jax.Array):
    state, stats = _update(state, acc, stats, objective_cfg, tx)
    new_state, metrics = _close_batch(state, stats, learner_cfg, objective_cfg.kl != "off")
    if moe_coefs is not None:
      w = jnp.where(stats.moe_weight > 0, stats.moe_weight, jnp.float32(jnp.nan))
      metrics.update(moe_load_balance_loss=stats.moe_lb_sum / w, moe_z_loss=stats.moe_z_sum / w)
    pick = lambda a, b: jax.tree.map(lambda x, y: jnp.where(final, x, y), a, b)
    state = state._replace(**{f: pick(getattr(new_state, f), getattr(state, f)) for f in (
        "version", "rng", "step", "nonfinite_consecutive", "nonfinite_total")})
    stats = pick(init_stats(objective_cfg.hist_bins), stats)
    return state, init_accum(state.params), stats, metrics

  return StepFns(prox=prox, accumulate=accumulate, apply=apply)


def moe_loss_coefs(model: Any) -> tuple[float, float] | None:
  """(router_aux_loss_coef, router_z_loss_coef) of a built-in MoE model's config; None for a
  dense model or a model without a `ModelConfig` (no MoE terms, no MoE metrics)."""
  cfg = getattr(model, "cfg", None)
  if getattr(cfg, "n_experts", 0) and isinstance(model, HiddenStatesModel):
    return float(cfg.router_aux_loss_coef), float(cfg.router_z_loss_coef)
  return None


def moe_aux_loss(load_balance: jax.Array, z: jax.Array, lb_coef: float,
                 z_coef: float) -> jax.Array:
  """The MoE router terms added to the objective: lb_coef * L_balance + z_coef * L_z.

  L_balance is the Switch load-balancing loss (Fedus et al. 2021, eq. 4; 1 when balanced) and
  L_z the router z-loss (Zoph et al. 2022, ST-MoE eq. 5), each averaged over MoE layers
  (`rlax_pipe.model.moe`). In a micro-batched step each micro-batch adds this, times its own
  loss normaliser, to the loss numerator, so the batch loss is the objective plus the
  normaliser-weighted mean of the micro-batches' terms (exactly the terms with one micro-batch).
  A zero coefficient switches its term off (the metric is still reported).

  Args:
    load_balance, z: float32 scalars. lb_coef, z_coef: coefficients >= 0 (dimensionless).

  Returns:
    float32 scalar.
  """
  return lb_coef * load_balance + z_coef * z


def _update(state: TrainState, acc: GradAccum, stats: BatchStats, objective_cfg: ObjectiveConfig,
            tx: optax.GradientTransformation) -> tuple[TrainState, BatchStats]:
  """One optimizer update from a minibatch's sums, or none (no data, or not finite)."""
  denom = token_loss.normalizer(acc.counts, objective_cfg)
  scale = jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)
  params = state.params
  grads = jax.tree.map(lambda g, p: (g * scale).astype(p.dtype), acc.grads, params)
  loss = acc.numerator * scale
  grad_norm = optax.tree.norm(grads)
  has_data = acc.used > 0
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  ok = has_data & finite
  updates, new_opt_state = tx.update(grads, state.opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jnp.where(ok, new, old)
  state = state._replace(params=jax.tree.map(keep, new_params, params),
                         opt_state=jax.tree.map(keep, new_opt_state, state.opt_state))
  data = has_data.astype(jnp.int32)
  stats = stats._replace(
      loss_sum=stats.loss_sum + jnp.where(has_data, loss, 0.0),
      grad_norm_sum=stats.grad_norm_sum + jnp.where(has_data, grad_norm, 0.0),
      update_norm_sum=stats.update_norm_sum + jnp.where(ok, optax.tree.norm(updates), 0.0),
      with_data=stats.with_data + data, updates=stats.updates + ok.astype(jnp.int32),
      nonfinite=stats.nonfinite + (has_data & ~finite).astype(jnp.int32),
      loss_finite=stats.loss_finite & (jnp.isfinite(loss) | ~has_data),
      grad_finite=stats.grad_finite & (jnp.isfinite(grad_norm) | ~has_data))
  return state, stats


def _close_batch(state: TrainState, stats: BatchStats, learner_cfg: LearnerConfig,
                 with_kl: bool = False) -> tuple[TrainState, dict]:
  """Version, counters and metrics at the end of a learner batch."""
  applied = stats.updates > 0
  bad = (stats.nonfinite > 0).astype(jnp.int32)
  consecutive = jnp.where(bad > 0, state.nonfinite_consecutive + 1,
                          jnp.where(applied, 0, state.nonfinite_consecutive))
  new_state = state._replace(
      version=state.version + applied.astype(jnp.int32),
      rng=jnp.where(applied, jax.random.key_data(
          jax.random.split(jax.random.wrap_key_data(state.rng))[0]), state.rng),
      step=state.step + 1, nonfinite_consecutive=consecutive,
      nonfinite_total=state.nonfinite_total + bad)
  nan = jnp.float32(jnp.nan)
  mean = lambda total, n: jnp.where(n > 0, total / jnp.maximum(n, 1).astype(jnp.float32), nan)
  last = _schedule_step(state.opt_state)
  metrics = dict(offpolicy.finalize_diagnostics(stats.sums)._asdict())
  metrics.update(
      loss=mean(stats.loss_sum, stats.with_data),
      grad_norm=mean(stats.grad_norm_sum, stats.with_data),
      update_norm=mean(stats.update_norm_sum, stats.updates),
      param_norm=optax.tree.norm(state.params),
      learning_rate=(nan if last is None else jnp.where(
          applied, optimizer.learning_rate(learner_cfg.optimizer, last), nan)),
      tokens_processed=stats.tokens_processed,
      negative_lag_tokens=stats.negative_lag_tokens,
      updates_applied=stats.updates,
      minibatches_with_data=stats.with_data,
      is_finite=bad == 0,
      loss_finite=stats.loss_finite,
      grad_finite=stats.grad_finite,
      inputs_finite=stats.inputs_finite,
      logp_finite=stats.logp_finite,
      version=new_state.version,
      step=new_state.step,
      nonfinite_consecutive=new_state.nonfinite_consecutive,
      nonfinite_total=new_state.nonfinite_total,
  )
  if with_kl:
    metrics["kl_ref"] = mean(stats.kl_sum, stats.kl_tokens)
  return new_state, metrics


# Metrics that are absent (NaN) when the batch had nothing they describe, with the count that
# says so: the diagnostics' own counts, plus the step's loss and update statistics.
ABSENT_WITHOUT: dict[str, str] = {
    **offpolicy.DIAGNOSTIC_COUNTS, "loss": "minibatches_with_data",
    "grad_norm": "minibatches_with_data", "update_norm": "updates_applied",
    "learning_rate": "updates_applied", "moe_load_balance_loss": "minibatches_with_data",
    "moe_z_loss": "minibatches_with_data"}
