"""A user-defined flax NNX decoder through `NnxModel`: the cache contract, shardings, and the real
pipeline (learner, weight channel with in-flight updates, paged sampler, checkpoint, resume)."""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.lib.learner_bench import synthetic_batch
from rlax_pipe import sharding
from rlax_pipe.objectives import ObjectiveConfig
from rlax_pipe.learner import CheckpointConfig, Learner, LearnerConfig, OptimizerConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import DenseKVCache, NnxModel, attend_with_cache, gqa_attention
from rlax_pipe.model import packed_causal_mask
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.sampler import PagedKVCache, PoolLayout
from rlax_pipe.tokenizer import default_tokenizer

MAX_SEQ = 48


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  vocab: int
  width: int = 32
  layers: int = 2
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 8
  hidden: int = 64


def _sinusoid(positions_BT, dim):
  """Absolute sinusoidal position embedding (Vaswani et al. 2017, sec. 3.5): [B, T, dim]."""
  inv = 1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  angles = positions_BT.astype(jnp.float32)[..., None] * inv[None, None, :]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class Block(nnx.Module):
  """Pre-LayerNorm block, GQA attention, GELU MLP; weights annotated with logical axes."""

  def __init__(self, c: DecoderConfig, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()

    def param(shape, axes):
      return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes,
                       eager_sharding=False)

    self.c = c
    self.norm1 = nnx.LayerNorm(c.width, rngs=rngs)
    self.norm2 = nnx.LayerNorm(c.width, rngs=rngs)
    self.wq = param((c.width, c.heads, c.head_dim), ("embed", "heads", "head_dim"))
    self.wk = param((c.width, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"))
    self.wv = param((c.width, c.kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"))
    self.wo = param((c.heads, c.head_dim, c.width), ("heads", "head_dim", "embed"))
    self.up = nnx.Linear(c.width, c.hidden, rngs=rngs)     # axes given by the `axes` callable
    self.down = nnx.Linear(c.hidden, c.width, rngs=rngs)

  def __call__(self, h, layer, positions, mask, cache, valid):
    x = self.norm1(h)
    q = jnp.einsum("bte,ehd->bthd", x, self.wq[...])
    k = jnp.einsum("bte,ekd->btkd", x, self.wk[...])
    v = jnp.einsum("bte,ekd->btkd", x, self.wv[...])
    if cache is None:
      out = gqa_attention(q, k, v, mask)
    else:
      out, cache = attend_with_cache(cache, layer, q, k, v, positions, valid)
    h = h + jnp.einsum("bthd,hde->bte", out, self.wo[...])
    return h + self.down(jax.nn.gelu(self.up(self.norm2(h)))), cache


class Decoder(nnx.Module):
  """A small decoder that is not the built-in one: LayerNorm, absolute positions, GELU."""

  def __init__(self, c: DecoderConfig, rngs: nnx.Rngs):
    self.embed = nnx.Embed(c.vocab, c.width, rngs=rngs)
    self.blocks = nnx.List([Block(c, rngs) for _ in range(c.layers)])
    self.norm = nnx.LayerNorm(c.width, rngs=rngs)
    self.width = c.width

  def __call__(self, tokens_BT, positions_BT, *, segment_ids_BT=None, cache=None, valid_BT=None):
    h = self.embed(tokens_BT) + _sinusoid(positions_BT, self.width)
    mask = None
    if cache is None:
      seg = jnp.zeros_like(tokens_BT) if segment_ids_BT is None else segment_ids_BT
      mask = packed_causal_mask(seg)
    valid = jnp.ones(tokens_BT.shape, bool) if valid_BT is None else valid_BT
    for i, block in enumerate(self.blocks):
      h, cache = block(h, i, positions_BT, mask, cache, valid)
    return self.embed.attend(self.norm(h)), cache


def _axes(path, shape):
  """Logical axes of the parameters without metadata (embedding and MLP)."""
  if path.endswith("['embedding']"):
    return ("vocab", "embed")
  if "['up']['kernel']" in path:
    return ("embed", "mlp")
  if "['down']['kernel']" in path:
    return ("mlp", "embed")
  if "['up']['bias']" in path:
    return ("mlp",)
  return None  # norms and the down bias: replicated


def make_model(vocab, **overrides):
  c = DecoderConfig(vocab=vocab, **overrides)
  return NnxModel.create(lambda rngs: Decoder(c, rngs), vocab_size=vocab, max_seq_len=MAX_SEQ,
                         n_layers=c.layers, n_kv_heads=c.kv_heads, head_dim=c.head_dim,
                         axes=_axes)


def test_params_axes_and_shardings():
  model = make_model(40)
  params = model.init_params(jax.random.key(0))
  abstract = model.abstract_params()
  assert jax.tree.structure(params) == jax.tree.structure(abstract)
  assert all(isinstance(k, str) for k in params["blocks"])  # list indices as strings
  axes = model.param_axes()
  assert axes["blocks"]["0"]["wq"] == ("embed", "heads", "head_dim")  # from metadata
  assert axes["embed"]["embedding"] == ("vocab", "embed")             # from the callable
  assert axes["norm"]["scale"] == (None,)                              # neither: replicated
  mesh = sharding.make_mesh(jax.devices()[:4], {"fsdp": 2, "tp": 2}, sharding.LEARNER_RULES)
  sh = sharding.logical_to_sharding(axes, mesh, sharding.LEARNER_RULES, abstract)
  assert sh["blocks"]["1"]["wk"].spec == jax.P("fsdp", "tp", None)
  assert sh["blocks"]["1"]["up"]["kernel"].spec == jax.P("fsdp", "tp")
  # Same construction, same model: a static jit argument that does not recompile.
  assert hash(model) == hash(model) and model == dataclasses.replace(model)


def test_bad_axes_name_the_parameter():
  with pytest.raises(ValueError, match=r"\['embed'\]\['embedding'\].*not logical axes"):
    NnxModel.create(lambda rngs: Decoder(DecoderConfig(vocab=40), rngs), vocab_size=40,
                    max_seq_len=MAX_SEQ, n_layers=2, n_kv_heads=2, head_dim=8,
                    axes=lambda path, shape: ("fsdp", "tp") if "embedding" in path else None)


@pytest.mark.parametrize("cache_kind", ["dense", "paged"])
def test_cached_decode_matches_full_forward(cache_kind):
  """The KV-cache contract: prefill + token-by-token decode == one cache-free forward."""
  model = make_model(40)
  params = model.init_params(jax.random.key(1))
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 40)
  positions = jnp.broadcast_to(jnp.arange(12)[None], (2, 12))
  full, none = model.forward(params, tokens, positions)
  assert none is None and full.dtype == jnp.float32 and full.shape == (2, 12, 40)
  if cache_kind == "dense":
    cache = DenseKVCache.init(2, 2, 16, 2, 8)
  else:  # 4 pages of 4 tokens per row, rows on disjoint pages of an 8-page pool
    layout = PoolLayout(num_layers=2, num_kv_heads=2, num_pages=8, page_size=4, head_dim=8)
    cache = PagedKVCache(pools=tuple(jnp.zeros(s) for s in layout.shapes), layout=layout,
                         block_tables=jnp.array([[0, 1, 2, 3], [7, 6, 5, 4]]))
  fwd = jax.jit(lambda p, t, pos, c: model.forward(p, t, pos, cache=c))
  logits, cache = fwd(params, tokens[:, :5], positions[:, :5], cache)
  outs = [logits]
  for t in range(5, 12):
    logits, cache = fwd(params, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
    outs.append(logits)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=2e-5, rtol=2e-5)


def test_nnx_decoder_trains_and_samples_through_the_pipeline(tmp_path, tiny_config, train_rows):
  """The real job with a user NNX decoder: learner on a 2x2 mesh, weights pushed in flight to a
  2-device paged sampler, checkpoints, then a resume that continues from them."""
  tok = default_tokenizer()
  model = make_model(tok.vocab_size)
  params = model.init_params(jax.random.key(0))
  cfg = tiny_config(tmp_path, "builtin", steps=3, max_lag=1)
  summary = run_lib.run(cfg, model=model, params=params)
  rows = train_rows(cfg.run_dir)
  assert [r["step"] for r in rows] == [1, 2, 3] and summary["steps"] == 3
  assert all(np.isfinite(r["loss"]) and r["samples"] > 0 for r in rows)
  # Step 1 trains version-0 samples with version-0 weights: the sampler's behaviour log-probs
  # (paged-cache mode of the NNX module) and the learner's (packed mode) agree.
  assert rows[0]["token_lag_max"] == 0 and rows[0]["logp_mismatch_max"] < 1e-4
  # In-flight updates: the sampler ran newer weights while the learner kept stepping, and
  # some trained tokens came from an older policy than the learner's (lag > 0).
  assert rows[-1]["sampler_version"] >= 2
  assert max(r["token_lag_max"] for r in rows) >= 1
  assert summary["final_heldout_accuracy"] is not None
  # Resume from the NNX checkpoint and take one more step.
  resumed = run_lib.run(dataclasses.replace(cfg, resume=True, pipeline=dataclasses.replace(
      cfg.pipeline, num_steps=4), change_on_resume=("pipeline.num_steps",)), model=model)
  assert resumed["steps"] == 4
  assert [r["step"] for r in train_rows(cfg.run_dir)] == [1, 2, 3, 4]
  # The checkpoint holds the NNX params tree at version 4 (a random policy earns no reward here,
  # so gradients are zero: `test_learner_updates_nnx_params` checks the gradient path).
  ckpt = CheckpointConfig(directory=f"{cfg.run_dir}/checkpoints")
  learner = Learner(model, dataclasses.replace(cfg.learner, checkpoint=ckpt),
                    cfg.objective, cfg.sampler.sampling, devices=jax.devices()[:4], restore=True)
  assert learner.version == 4
  assert jax.tree.structure(learner.params) == jax.tree.structure(params)
  learner.close()


def test_learner_updates_nnx_params():
  """Gradients flow through nnx.merge: two sharded optimizer steps move every parameter."""
  model = make_model(40)
  params = jax.device_get(model.init_params(jax.random.key(0)))
  learner = Learner(model, LearnerConfig(mesh_axes=(("fsdp", 2), ("tp", 2)),
                                           optimizer=OptimizerConfig(learning_rate=1e-2),
                                           # LLVM -O0: compile-bound; asserts movement only
                                           compiler_options=(("xla_backend_optimization_level",
                                                              0),)),
                    ObjectiveConfig(), SamplingConfig(), devices=jax.devices()[:4], params=params)
  assert learner.state.params["blocks"]["0"]["wq"].sharding.spec == jax.P("fsdp", "tp", None)
  rng = np.random.default_rng(0)
  for _ in range(2):
    learner.train_step(synthetic_batch(rng, 4, 32, 40))
  metrics = learner.flush()
  assert bool(metrics["is_finite"]) and float(metrics["grad_norm"]) > 0 and learner.version == 2
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b))),
                       jax.device_get(learner.params), params)
  assert all(d > 0 for d in jax.tree.leaves(moved)), moved
