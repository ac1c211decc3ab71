"""`Learner`: a thin shell over the jitted, donated train step on the learner mesh.

The class holds the sharded `TrainState`, places batches on the mesh, dispatches one optimizer
step per `train_step` call and reads the previous step's metrics while the new step runs
(metrics one step late, so the host never stalls the device). Non-finite steps are skipped
inside the jitted step; here they are logged and counted, and too many in a row save a
checkpoint and raise `NonFiniteError`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

from absl import logging
import jax
from jax.sharding import Mesh, NamedSharding
import numpy as np

from rlax_pipe import logprobs as logprobs_lib
from rlax_pipe import objectives
from rlax_pipe.learner import checkpoint as checkpoint_lib
from rlax_pipe.learner import lora_base
from rlax_pipe.learner import optimizer
from rlax_pipe.learner import persistence
from rlax_pipe.learner import reference as reference_lib
from rlax_pipe.learner import sharding as sharding_lib
from rlax_pipe.learner import train_state as train_state_lib
from rlax_pipe.learner import train_step as train_step_lib
from rlax_pipe.host_rules import plan_micro_batches
from rlax_pipe.learner.config import LearnerConfig
from rlax_pipe.model import HiddenStatesModel, Model, ModelLike, as_model
from rlax_pipe.model import lora as lora_lib
from rlax_pipe.model import train_attention
from rlax_pipe.types import TrainBatch

class NonFiniteError(RuntimeError):
  """Raised after `max_consecutive_nonfinite` skipped (non-finite) optimizer steps in a row."""


class _Compiled(NamedTuple):
  """Jitted step programs for one configuration, mesh and row length L."""
  prox: Any
  accumulate: Any
  apply: Any
  init: Any
  micro_sharding: dict[str, NamedSharding]


@functools.lru_cache(maxsize=8)
def _compiled_step(model: Model, step_cfg: LearnerConfig,
                   objective_cfg: objectives.ObjectiveConfig,
                   sampling_cfg: logprobs_lib.SamplingConfig, mesh: Mesh,
                   seq_len: int) -> _Compiled:
  """The jitted step programs for one configuration, mesh and row length (shared between
  learners). Their inputs have fixed shapes ([micro_batch_rows, seq_len] micro-batches), so a
  batch of any number of rows reuses them."""
  tx = optimizer.make_optimizer(step_cfg.optimizer)
  lora = lora_lib.adapters_for(model, step_cfg.lora)
  space = lora or model
  state_sh = train_state_lib.state_shardings(space, tx, mesh)
  frozen_sh = None if lora is None else sharding_lib.param_shardings(model, mesh)
  kernel = train_attention.resolve_train_attention(
      step_cfg.attention_impl, mesh.devices.flat[0].platform, seq_len,
      step_cfg.attention_block_len)
  attention = kernel if kernel == "blockwise" else train_attention.sharded_flash_attention(
      kernel, step_cfg.attention_block_len, mesh)
  fns = train_step_lib.make_step_fns(model, step_cfg, objective_cfg, sampling_cfg, tx,
                                     sharding_lib.compute_constraint(mesh), lora=lora,
                                     attention_kernel=attention)
  rows = (step_cfg.micro_batch_rows, seq_len)
  tok_sh = sharding_lib.batch_sharding(mesh, rows)
  micro_sh = {name: tok_sh for name in train_step_lib.BATCH_FIELDS}
  if objective_cfg.router_replay == "replay":  # [R, L, L_moe, k]: rows split like the tokens
    micro_sh[train_step_lib.ROUTES_FIELD] = NamedSharding(mesh, jax.sharding.PartitionSpec(
        *tok_sh.spec, None, None))
  rep = sharding_lib.replicated(mesh)
  abstract = space.abstract_params()
  bins = objective_cfg.hist_bins
  make_acc = lambda: (train_step_lib.init_accum(abstract), train_step_lib.init_stats(bins))
  acc_abstract, stats_abstract = jax.eval_shape(make_acc)
  acc_sh = acc_abstract._replace(grads=state_sh.params, numerator=rep,
                                 counts=jax.tree.map(lambda _: rep, acc_abstract.counts), used=rep)
  stats_sh = jax.tree.map(lambda _: rep, stats_abstract)
  opts = dict(step_cfg.compiler_options) or None
  jit = functools.partial(jax.jit, compiler_options=opts)
  return _Compiled(
      prox=jit(fns.prox, in_shardings=(state_sh, micro_sh, frozen_sh), out_shardings=tok_sh),
      accumulate=jit(fns.accumulate,
                     in_shardings=(state_sh, acc_sh, stats_sh, micro_sh, tok_sh, rep, frozen_sh) + (
                         () if objective_cfg.kl == "off" else (reference_lib.reference_shardings(model, mesh),)),
                     out_shardings=(acc_sh, stats_sh), donate_argnums=(1, 2)),
      apply=jit(fns.apply, in_shardings=(state_sh, acc_sh, stats_sh, rep),
                out_shardings=(state_sh, acc_sh, stats_sh, rep), donate_argnums=(0, 1, 2)),
      init=jit(make_acc, out_shardings=(acc_sh, stats_sh)),
      micro_sharding=micro_sh)


def lower_accumulate(model: ModelLike, cfg: LearnerConfig,
                     objective_cfg: objectives.ObjectiveConfig,
                     sampling_cfg: logprobs_lib.SamplingConfig, mesh: Mesh,
                     seq_len: int) -> jax.stages.Lowered:
  """The learner's micro-batch program (forward, log-probs, loss, gradient accumulation) for
  [micro_batch_rows, seq_len] micro-batches, lowered from abstract inputs (nothing allocated):
  `.compile()` it and read `memory_analysis()`, `cost_analysis()` or `as_text()` (the HLO).
  """
  step_cfg, model = cfg.step_slice(), as_model(model)
  fns = _compiled_step(model, step_cfg, objective_cfg, sampling_cfg, mesh, seq_len)
  tx = optimizer.make_optimizer(step_cfg.optimizer)
  lora = lora_lib.adapters_for(model, step_cfg.lora)
  state = train_state_lib.sharded_abstract_state(lora or model, tx, mesh)
  frozen = None if lora is None else jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), model.abstract_params(),
      sharding_lib.param_shardings(model, mesh))
  acc, stats = jax.eval_shape(fns.init)
  shape = (step_cfg.micro_batch_rows, seq_len)
  mb = {name: jax.ShapeDtypeStruct(shape, train_step_lib.BATCH_DTYPES[name],
                                   sharding=fns.micro_sharding[name])
        for name in train_step_lib.BATCH_FIELDS}
  if objective_cfg.router_replay == "replay":
    mb[train_step_lib.ROUTES_FIELD] = jax.ShapeDtypeStruct(
        shape + _routes_tail(model), train_step_lib.ROUTES_DTYPE,
        sharding=fns.micro_sharding[train_step_lib.ROUTES_FIELD])
  prox = jax.ShapeDtypeStruct(shape, np.float32, sharding=fns.micro_sharding["tokens"])
  ref = () if objective_cfg.kl == "off" else (reference_lib.abstract_reference(model, mesh),)
  return fns.accumulate.lower(state, acc, stats, mb, prox, jax.ShapeDtypeStruct((), np.bool_),
                              frozen, *ref)


def _take_rows(arrays: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
  """The given rows of every field; index -1 gives an all-zero row (padding, no loss)."""
  pad = rows < 0
  idx = np.where(pad, 0, rows)
  return {name: np.where(pad.reshape((-1,) + (1,) * (x.ndim - 1)), np.zeros((), x.dtype), x[idx])
          for name, x in arrays.items()}


def _routes_tail(model) -> tuple[int, int]:
  """(L_moe, k) of a model's router routes.

  Raises:
    ValueError: for a model without MoE layers (router replay has nothing to replay).
  """
  cfg = getattr(model, "cfg", None)
  if cfg is None or not getattr(cfg, "n_experts", 0):
    raise ValueError("--config.objective.router_replay='replay' needs a mixture-of-experts "
                     "model (ModelConfig.n_experts > 0); set it to 'off' for a dense model.")
  return cfg.n_moe_layers, cfg.n_experts_per_tok


@functools.lru_cache(maxsize=8)
def _compiled_init(model: Model | lora_lib.LoraAdapters, step_cfg: LearnerConfig, mesh: Mesh,
                   from_params: bool):
  """Jitted state initializer writing straight into the learner shardings (`model` may be a
  `LoraAdapters`: then the state trains freshly initialized adapters)."""
  tx = optimizer.make_optimizer(step_cfg.optimizer)
  state_sh = train_state_lib.state_shardings(model, tx, mesh)
  opts = dict(step_cfg.compiler_options) or None
  rep = sharding_lib.replicated(mesh)
  if from_params:
    return jax.jit(lambda params, seed: train_state_lib.init_state(params, tx, seed),
                   in_shardings=(state_sh.params, rep), out_shardings=state_sh,
                   compiler_options=opts)
  return jax.jit(lambda seed: train_state_lib.init_state(
      model.init_params(jax.random.key(seed)), tx, seed),
                 in_shardings=(rep,), out_shardings=state_sh, compiler_options=opts)


def batch_arrays(batch: TrainBatch | dict, routes: bool = False) -> dict[str, np.ndarray]:
  """TrainBatch (or dict) -> dict of host [B, L] arrays in the contract dtypes (device arrays
  are fetched explicitly: the batch is cut into micro-batches on the host); with `routes`
  (router replay) also the [B, L, L_moe, k] routes as int16.

  Raises:
    ValueError: on a missing field, or `routes` without routes in the batch.
  """
  if isinstance(batch, TrainBatch):
    batch = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
  out = {}
  if routes:
    r = batch.get(train_step_lib.ROUTES_FIELD)
    if r is None:
      raise ValueError("router_replay='replay' but the batch has no routes: the sampler must "
                       "record them (an MoE model's Rollout.routes); or set "
                       "--config.objective.router_replay=off.")
    out[train_step_lib.ROUTES_FIELD] = np.asarray(
        jax.device_get(r) if isinstance(r, jax.Array) else r,
        np.dtype(train_step_lib.ROUTES_DTYPE))
  for name, dtype in train_step_lib.BATCH_DTYPES.items():
    if name not in batch:
      raise ValueError(f"batch lacks {name!r}; fields are {train_step_lib.BATCH_FIELDS}.")
    x = batch[name]
    out[name] = np.asarray(jax.device_get(x) if isinstance(x, jax.Array) else x,
                           np.dtype(dtype))
  return out


class Learner(persistence.LearnerPersistence):
  """Sharded learner: init, train_step, params/version for the weight channel, save/restore.

  Example:
    >>> learner = Learner(ModelConfig(), LearnerConfig(mesh_axes=(("fsdp", 2), ("tp", 2))),
    ...                   ObjectiveConfig(), SamplingConfig(), devices=jax.devices()[:4])
    >>> prev_metrics = learner.train_step(batch)   # metrics of the previous step (or None)
    >>> last_metrics = learner.flush()
  """

  def __init__(self, model: ModelLike, cfg: LearnerConfig,
               objective_cfg: objectives.ObjectiveConfig,
               sampling_cfg: logprobs_lib.SamplingConfig, *,
               devices: Sequence[Any] | None = None, mesh: Mesh | None = None,
               params: Any = None, restore: bool = False):
    """Builds the mesh and the initial state (version 0, or restored from a checkpoint).

    Args:
      model: the model (`rlax_pipe.model.Model`, or a `ModelConfig` of the built-in one).
      cfg: learner configuration.
      objective_cfg: objective configuration.
      sampling_cfg: the sampler's SamplingConfig (log-probs are recomputed with it).
      devices: learner devices (default: the first `cfg.num_devices` of `jax.devices()`);
        ignored when `mesh` is given.
      mesh: an existing learner mesh (its shape must match `cfg.mesh_axes`).
      params: initial parameters (e.g. an SFT checkpoint), any placement; they are copied
        onto the learner shardings. None = random init from `cfg.seed`, created directly on
        the shardings by a jitted init with `out_shardings`. With LoRA (`cfg.lora.rank` >= 1)
        these are the frozen base (`base_params`) and the trained state starts from fresh
        adapters (B = 0, so version 0 is exactly the base).
      restore: instead of initializing, restore the newest usable checkpoint of
        `cfg.checkpoint.directory` onto this mesh (its JSON extra dict is kept in
        `self.restored_extra`); `params` must then be None, except with LoRA, where the
        checkpoint holds the adapters only and `params` is the same frozen base as when it
        was saved.

    Raises:
      ValueError: on a mesh / device-count mismatch, params of the wrong structure, or
        `restore` without a checkpoint directory or together with `params`.
      checkpoint.CheckpointError: with `restore`, if no usable checkpoint exists.
    """
    self.model, self.cfg = as_model(model), cfg
    self.objective_cfg, self.sampling_cfg = objective_cfg, sampling_cfg
    if mesh is None:
      devices = list(jax.devices()[:cfg.num_devices] if devices is None else devices)
      mesh = sharding_lib.learner_mesh(devices, cfg)
    elif dict(mesh.shape) != cfg.mesh_shape:
      raise ValueError(f"mesh shape {dict(mesh.shape)} != LearnerConfig.mesh_axes "
                       f"{cfg.mesh_shape}.")
    self.mesh = mesh
    # (micro-batches, rows processed with padding) of the last dispatched step's plan
    # (`plan_micro_batches`); (0, 0) before the first step.
    self.last_plan: tuple[int, int] = (0, 0)
    self._step_cfg = cfg.step_slice()
    self._tx = optimizer.make_optimizer(self._step_cfg.optimizer)
    # LoRA: the optimizer trains the adapters; the frozen base is held here, outside the state.
    self.lora = lora_lib.adapters_for(self.model, cfg.lora)
    self._space = self.lora or self.model
    self.state_shardings = train_state_lib.state_shardings(self._space, self._tx, mesh)
    self._frozen = None
    self._checkpointer = None
    ckpt = cfg.checkpoint
    if ckpt.directory is not None:
      self._checkpointer = checkpoint_lib.Checkpointer(
          ckpt.directory, keep=ckpt.keep, async_save=ckpt.async_save,
          active_processes=sorted({d.process_index for d in mesh.devices.flat}))
    self._pending = None  # device metrics of the last dispatched step, not yet checked
    # Host copies of the state's counters (no device read on the step path): `_step` counts
    # dispatched steps; `_version` is the version after the last step whose metrics were read
    # (`train_step` reads the previous step's, `flush` the last one's).
    self._step, self._version = 0, 0
    self._compiled: _Compiled | None = None
    self._accum = None  # (GradAccum, BatchStats) device buffers, zero between batches
    rep = sharding_lib.replicated(mesh)
    # Device constants passed to the step programs (explicit transfers, made once).
    self._flags = {v: jax.device_put(np.bool_(v), rep) for v in (False, True)}
    self._zeros_cache: dict[tuple[int, ...], jax.Array] = {}
    self.restored_extra: dict | None = None
    self.last_restore: checkpoint_lib.Restored | None = None
    logging.info("Learner: mesh %s on devices %s; initial state from %s.", dict(mesh.shape),
                 [d.id for d in mesh.devices.flat],
                 "checkpoint" if restore else "given params" if params is not None else "random")
    seed = jax.device_put(np.int32(cfg.seed), sharding_lib.replicated(mesh))
    if self.lora is not None:
      self._frozen = lora_base.place_base(self.model, mesh, params, seed)
      params = None
      logging.info("Learner: LoRA rank %d, alpha %g on %d weights (%s): %d adapter bytes "
                   "trained, base frozen.", cfg.lora.rank, cfg.lora.alpha, len(self.lora.specs),
                   ", ".join(sp.name for sp in self.lora.specs),
                   lora_lib.adapter_bytes(self.lora.abstract_params()))
    self.reference_params: Any = None  # pi_ref of ObjectiveConfig.kl, None when off
    kl_path = objective_cfg.kl_reference if objective_cfg.kl != "off" else None
    if kl_path is not None:
      self.reference_params = reference_lib.make_reference(
          self.model, mesh, reference_lib.load_reference_params(self.model, kl_path))
    if restore:
      if params is not None:
        raise ValueError("Learner: pass either params or restore=True, not both.")
      if objective_cfg.kl != "off" and kl_path is None and self.lora is not None:
        # LoRA: the initial policy is the frozen base (fresh adapters have B = 0).
        self.reference_params = reference_lib.make_reference(self.model, mesh, self._frozen)
      elif objective_cfg.kl != "off" and kl_path is None:
        raise ValueError("Learner: restore=True without params does not know the initial "
                         "params to use as the KL reference; pass params and call restore() "
                         "afterwards, or set --config.objective.kl_reference.")
      self.restored_extra = self.restore()
      return
    if params is None:
      self._state = _compiled_init(self._space, self._step_cfg, mesh, False)(seed)
    else:
      params = jax.device_put(params, self.state_shardings.params)
      self._state = _compiled_init(self.model, self._step_cfg, mesh, True)(params, seed)
    self._block_nonfinite_head_columns()
    if objective_cfg.kl != "off" and kl_path is None:  # the initial params (default)
      # With LoRA the initial merged params are the base itself (fresh adapters have B = 0).
      init = self._frozen if self.lora is not None else self._state.params
      self.reference_params = reference_lib.make_reference(self.model, mesh, init)

  # ---- state access -------------------------------------------------------------------------

  @property
  def state(self) -> train_state_lib.TrainState:
    """The current TrainState (donated by the next `train_step`: do not keep references)."""
    return self._state

  @property
  def params(self) -> Any:
    """Learner-sharded trained params of the current version (with LoRA: the adapters only),
    valid until the next `train_step` (which donates them): copy them (e.g. into the weight
    channel) before stepping again."""
    return self._state.params

  @property
  def base_params(self) -> Any:
    """With LoRA, the frozen base params (learner-sharded, never donated); else None."""
    return self._frozen

  def merged_params(self) -> Any:
    """The model's full params of the current version: `params` itself, or with LoRA the base
    merged with the adapters (W + alpha/r B A, a new learner-sharded tree; e.g. for an HF
    export of the trained policy or an evaluation engine)."""
    if self.lora is None:
      return self._state.params
    return lora_base.merge(self.lora, self.mesh, self._frozen, self._state.params)

  @property
  def version(self) -> int:
    """Policy version of `params` (a host integer). Exact once the metrics of the last
    dispatched step were read (`flush`, as the pipeline's `Trainer` does every step); while a
    step's metrics are pending it waits for that step and reads its version (a device read;
    the metrics stay pending for `train_step` / `flush`)."""
    if self._pending is not None:
      return int(jax.device_get(self._pending["version"]))
    return self._version

  @property
  def step(self) -> int:
    """Number of train_step calls so far, applied or skipped (a host integer, no device read)."""
    return self._step

  @property
  def checkpointer(self) -> checkpoint_lib.Checkpointer | None:
    return self._checkpointer

  def compile_counts(self) -> dict[str, int]:
    """Compiled variants of each step program so far ({} before the first step). One each
    after any number of steps with any batch sizes of one row length."""
    if self._compiled is None:
      return {}
    return {name: getattr(self._compiled, name)._cache_size()  # pylint: disable=protected-access
            for name in ("prox", "accumulate", "apply")}

  # ---- training -------------------------------------------------------------------------------

  def train_step(self, batch: TrainBatch | dict) -> dict[str, np.ndarray] | None:
    """Dispatches one learner batch (num_minibatches updates, one version); returns the
    PREVIOUS step's metrics.

    The batch (any number of rows B) is cut on the host into micro-batches of
    `micro_batch_rows` rows (`plan_micro_batches`); each is placed on the mesh and run
    through the fixed-shape programs of `train_step.make_step_fns`, so no batch size ever
    triggers a compile once the first step of a row length has compiled.

    Args:
      batch: TrainBatch (host numpy) or a dict with the same [B, L] fields (host or device).

    Returns:
      Host (numpy) metrics of the previous step (see `train_step.make_step_fns`; metrics with
      nothing to describe are left out, see `train_step.ABSENT_WITHOUT`), or None on the
      first call. Use `flush()` for the metrics of the step just dispatched.

    Raises:
      NonFiniteError: when the previous step made `max_consecutive_nonfinite` skipped steps
        in a row (a checkpoint is saved first when a checkpoint directory is configured).
    """
    arrays = batch_arrays(batch, routes=self.objective_cfg.router_replay == "replay")
    num_rows, seq_len = arrays["tokens"].shape
    fns = _compiled_step(self.model, self._step_cfg, self.objective_cfg,
                         self.sampling_cfg, self.mesh, seq_len)
    if fns is not self._compiled:
      self._compiled, self._accum = fns, fns.init()
    cfg = self._step_cfg
    plan = plan_micro_batches(num_rows, cfg.micro_batch_rows, cfg.num_minibatches)
    n = sum(len(mb) for mb in plan)
    self.last_plan = (n, n * cfg.micro_batch_rows)
    micro = [[jax.device_put(_take_rows(arrays, rows), fns.micro_sharding) for rows in mb]
             for mb in plan]
    no_prox = fns.micro_sharding["tokens"]
    prox = {}
    if cfg.num_minibatches > 1:  # proximal log-probs: the params before the first update
      prox = {(j, i): fns.prox(self._state, mb, self._frozen) for j in range(1, len(micro))
              for i, mb in enumerate(micro[j])}
    acc, stats = self._accum
    ref = () if self.reference_params is None else (self.reference_params,)
    for j, minibatch in enumerate(micro):
      for i, mb in enumerate(minibatch):
        p = prox.get((j, i))
        if p is None:
          p = self._zeros(no_prox, mb["tokens"].shape)
        acc, stats = fns.accumulate(self._state, acc, stats, mb, p,
                                    self._flags[(j, i) in prox], self._frozen, *ref)
      self._state, acc, stats, metrics = fns.apply(self._state, acc, stats,
                                                   self._flags[j == len(micro) - 1])
    self._accum = (acc, stats)
    self._step += 1
    previous, self._pending = self._pending, metrics
    return None if previous is None else self._check(previous)

  def _read_counters(self) -> None:
    """The host copies of the state's step and version, read once after a state was loaded."""
    step, version = jax.device_get((self._state.step, self._state.version))
    self._step, self._version = int(step), int(version)
    self._block_nonfinite_head_columns()

  def _block_nonfinite_head_columns(self) -> None:
    """Adds the ids whose output-head column is non-finite to `sampling_cfg.excluded_ids`.

    A NaN / inf row of a tied embedding no real token uses (the padding id) is also that id's
    output column and would poison every log-prob (#27 item 1). The sampler blocks such ids per
    installed weight version; the learner finds them here, once, when its params are set (a
    finite column stays finite under the optimizer: the row gets no gradient and a non-finite
    step is skipped), so on finite weights its step programs are exactly the unmasked ones. A
    change recompiles them. Forward-only models (no `output_head`) are not checked.
    """
    if not isinstance(self.model, HiddenStatesModel):
      return
    params = self._frozen if self.lora is not None else self._state.params
    bad = logprobs_lib.nonfinite_ids(self.model.output_head(params))
    if not bad or set(bad) <= set(self.sampling_cfg.excluded_ids):
      return
    logging.warning("Learner: output-head columns of ids %s hold NaN / inf; those ids are "
                    "blocked (log-prob %g, as the sampler blocks them).", list(bad),
                    logprobs_lib.OUT_OF_SUPPORT)
    self.sampling_cfg = dataclasses.replace(
        self.sampling_cfg,
        excluded_ids=tuple(sorted(set(self.sampling_cfg.excluded_ids) | set(bad))))
    self._compiled = None

  def _zeros(self, sharding, shape):
    """A cached device array of zeros (the placeholder proximal log-probs)."""
    if shape not in self._zeros_cache:
      self._zeros_cache[shape] = jax.device_put(np.zeros(shape, np.float32), sharding)
    return self._zeros_cache[shape]

  def flush(self) -> dict[str, np.ndarray] | None:
    """Waits for the last dispatched step and returns (and checks) its host metrics (one
    explicit device-to-host transfer)."""
    previous, self._pending = self._pending, None
    return None if previous is None else self._check(previous)

  def _check(self, device_metrics: dict) -> dict[str, np.ndarray]:
    m = jax.device_get(device_metrics)
    self._version = int(m["version"])
    for name, count in train_step_lib.ABSENT_WITHOUT.items():
      if int(m[count]) == 0:  # nothing to describe: absent, never a fake 0
        m.pop(name, None)  # (MoE metrics exist only for MoE models)
    if int(m["minibatches_with_data"]) == 0:
      logging.info("Learner: step %d had no token that contributes to the loss; no update "
                   "(params, optimizer state and version %d unchanged).", int(m["step"]),
                   int(m["version"]))
    if bool(m["is_finite"]):
      return m
    bad = [name for name in ("loss_finite", "grad_finite", "logp_finite", "inputs_finite")
           if not bool(m[name])]
    consecutive = int(m["nonfinite_consecutive"])
    logging.warning(
        "Learner: step %d skipped (update not applied, version stays %d): non-finite %s; "
        "loss=%s grad_norm=%s; %d in a row, %d in total.", int(m["step"]), int(m["version"]),
        ", ".join(n.replace("_finite", "") for n in bad), m.get("loss"), m.get("grad_norm"),
        consecutive, int(m["nonfinite_total"]))
    if consecutive >= self.cfg.max_consecutive_nonfinite:
      where = "no checkpoint saved (LearnerConfig.checkpoint.directory is None)"
      if self._checkpointer is not None:
        saved = self.save({"stopped_on": "nonfinite", "nonfinite_consecutive": consecutive})
        self._checkpointer.wait()
        # Metrics are read one step late: the saved state may include one more dispatched step.
        where = (f"checkpoint step {saved} (version {self.version}) saved in "
                 f"{self._checkpointer.directory}")
      first = int(m["step"]) - consecutive + 1
      raise NonFiniteError(
          f"{consecutive} consecutive optimizer steps (steps {first}..{int(m['step'])}) had a "
          f"non-finite {' / '.join(n.replace('_finite', '') for n in bad)} (last loss="
          f"{m.get('loss')}, grad_norm={m.get('grad_norm')}); max_consecutive_nonfinite="
          f"{self.cfg.max_consecutive_nonfinite}. Their updates were skipped (params, optimizer "
          f"state and version {int(m['version'])} unchanged); {where}.")
    return m
