"""Learning-rate schedule and the optax chain (global-norm clipping, then AdamW)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from rlax_pipe.learner.config import OptimizerConfig

_NO_DECAY_NAMES = ("bq", "bk", "bv")


def learning_rate(cfg: OptimizerConfig, step: jax.Array | int) -> jax.Array:
  """Learning rate used by applied optimizer step `step` (0-based).

  Linear warmup peak * min(1, (step + 1) / warmup_steps), then constant at peak or a
  half-cosine from peak down to peak * min_lr_ratio at `decay_steps` (Loshchilov & Hutter 2017,
  eq. 5 without restarts), constant afterwards.

  Args:
    cfg: optimizer configuration.
    step: int scalar, number of optimizer updates applied before this one.

  Returns:
    float32 scalar learning rate.
  """
  step = jnp.asarray(step, jnp.float32)
  peak = jnp.float32(cfg.learning_rate)
  warm = jnp.minimum(1.0, (step + 1.0) / max(cfg.warmup_steps, 1))
  if cfg.schedule == "constant":
    return peak * warm
  span = float(cfg.decay_steps - cfg.warmup_steps)
  progress = jnp.clip((step - cfg.warmup_steps) / span, 0.0, 1.0)
  floor = cfg.min_lr_ratio
  cosine = floor + (1.0 - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
  return peak * warm * jnp.where(step < cfg.warmup_steps, 1.0, cosine)


def decay_mask(params: Any) -> Any:
  """Bool tree: True for leaves that get weight decay (matrices and embeddings).

  Norm scales (names ending in "norm") and attention biases are excluded.
  """
  def keep(path, _):
    name = getattr(path[-1], "key", str(path[-1]))
    return not (name.endswith("norm") or name in _NO_DECAY_NAMES)
  return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """optax chain: clip_by_global_norm(max_grad_norm) (if set), then AdamW with the schedule.

  The schedule is indexed by AdamW's own update count, which only advances on applied
  (finite) steps because a skipped step keeps the previous optimizer state.
  """
  adamw = optax.adamw(learning_rate=lambda count: learning_rate(cfg, count), b1=cfg.adam_b1,
                      b2=cfg.adam_b2, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                      mask=decay_mask)
  if cfg.max_grad_norm is None:
    return adamw
  return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
