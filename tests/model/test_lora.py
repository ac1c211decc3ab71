"""LoRA adapters: the merge against a float64 numpy W + (alpha/r) B A in HF's [out, in] layout,
init (W' = W), targets and errors, the NNX model through the Model protocol, and the PEFT export
loaded by peft + transformers on CPU torch (same logits as the built-in merged model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe.config import LoraConfig, ModelConfig
from rlax_pipe.model import LoraAdapters, Transformer, adapters_for, hf_io, save_peft_adapter

CFG = ModelConfig(vocab_size=61, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4,
                  d_ff=24, max_seq_len=32, tie_embeddings=False)
MODEL = Transformer(CFG)
LORA = LoraAdapters(MODEL, LoraConfig(rank=3, alpha=5.0))
MERGE = jax.jit(LORA.merge)  # one compile shared by the tests


def _random(tree, seed, std=0.3):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: (std * rng.standard_normal(a.shape)).astype(np.float32), tree)


@pytest.fixture(scope="module")
def base():
  return _random(MODEL.abstract_params(), 0)


@pytest.fixture(scope="module")
def adapters():
  return _random(LORA.abstract_params(), 1)  # B nonzero, unlike a fresh init


def _numpy_merge(base, adapters, lora):
  """W + s B A computed per layer in HF's nn.Linear layout [out, in], float64."""
  out = jax.tree.map(lambda x: np.asarray(x, np.float64), base)
  s = lora.cfg.alpha / lora.cfg.rank
  n_in = {"wo": 2}
  for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
    w = out["layers"][name]
    a = np.asarray(adapters[f"layers/{name}"]["lora_a"], np.float64)
    b = np.asarray(adapters[f"layers/{name}"]["lora_b"], np.float64)
    k = n_in.get(name, 1)
    for i in range(w.shape[0]):
      in_w = int(np.prod(w.shape[1:1 + k]))
      w_hf = w[i].reshape(in_w, -1).T                         # [out, in]
      a_hf = a[i].reshape(lora.cfg.rank, in_w)                # [r, in]
      b_hf = b[i].reshape(-1, lora.cfg.rank)                  # [out, r]
      w[i] = (w_hf + s * b_hf @ a_hf).T.reshape(w[i].shape)
  return out


def test_merge_equals_numpy_reference_and_merged_forward(base, adapters):
  merged = MERGE(base, adapters)
  want = _numpy_merge(base, adapters, LORA)
  for path, got in jax.tree_util.tree_flatten_with_path(merged)[0]:
    ref = want
    for k in path:
      ref = ref[k.key]
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5, rtol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
    assert got.dtype == np.float32
  tokens = np.arange(10, dtype=np.int32)[None] % CFG.vocab_size
  pos = np.arange(10, dtype=np.int32)[None]
  ours, _ = MODEL.forward(merged, tokens, pos)
  ref, _ = MODEL.forward(jax.tree.map(lambda x: x.astype(np.float32), want), tokens, pos)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=1e-5, rtol=0)


def test_fresh_adapters_leave_the_base_unchanged_and_have_the_stated_shapes(base):
  fresh = jax.jit(LORA.init_params)(jax.random.key(0))
  merged = MERGE(base, fresh)
  for got, want in zip(jax.tree.leaves(merged), jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(got), want)
  wo = fresh["layers/wo"]
  assert wo["lora_a"].shape == (2, 3, 4, 4) and wo["lora_b"].shape == (2, 16, 3)
  assert not np.any(np.asarray(wo["lora_b"])) and np.all(np.abs(wo["lora_a"]) <= 1 / 4)
  assert LORA.param_axes()["layers/wq"] == {
      "lora_a": ("layers", "lora_rank", "embed"),
      "lora_b": ("layers", "heads", "head_dim", "lora_rank")}
  assert adapters_for(MODEL, LoraConfig()) is None


def test_target_and_rank_errors_name_the_fix():
  with pytest.raises(ValueError, match=r"\['q_proj'\] match no weight matrix.*layers/wq"):
    LoraAdapters(MODEL, LoraConfig(rank=2, target_modules=("wq", "q_proj")))
  with pytest.raises(ValueError, match="rank=17 exceeds the smallest width 16"):
    LoraAdapters(MODEL, LoraConfig(rank=17, target_modules=("wq",)))
  with pytest.raises(ValueError, match="rank"):
    LoraConfig(rank=-1)
  with pytest.raises(ValueError, match="alpha"):
    LoraConfig(rank=1, alpha=0.0)
  only_attn = LoraAdapters(MODEL, LoraConfig(rank=2, target_modules=("wq", "wv")))
  assert [s.name for s in only_attn.specs] == ["layers/wq", "layers/wv"]


def test_nnx_model_gets_adapters_through_the_model_protocol():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from rlax_pipe.model import NnxModel  # pylint: disable=import-outside-toplevel

  class Tiny(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(11, 8, rngs=rngs)
      self.q_proj = nnx.Linear(8, 6, rngs=rngs)
      self.out = nnx.Linear(6, 11, rngs=rngs)

    def __call__(self, tokens_BT, positions_BT, *, cache=None, **_):
      return self.out(jnp.tanh(self.q_proj(self.embed(tokens_BT)))), cache

  model = NnxModel.create(Tiny, vocab_size=11, max_seq_len=8, n_layers=1, n_kv_heads=1,
                          head_dim=2)
  lora = LoraAdapters(model, LoraConfig(rank=2, alpha=2.0, target_modules=("q_proj",)))
  assert [s.name for s in lora.specs] == ["q_proj/kernel"]  # the bias (rank 1) is not adapted
  params = model.init_params(jax.random.key(0))
  ad = _random(lora.abstract_params(), 3)
  merged = jax.jit(lora.merge)(params, ad)
  kernel = np.asarray(params["q_proj"]["kernel"], np.float64)       # [in, out]
  ref = kernel + 1.0 * (np.asarray(ad["q_proj/kernel"]["lora_b"], np.float64)
                        @ np.asarray(ad["q_proj/kernel"]["lora_a"], np.float64)).T
  np.testing.assert_allclose(np.asarray(merged["q_proj"]["kernel"]), ref, atol=1e-6)
  tokens = np.arange(6, dtype=np.int32)[None]

  def loss(a):
    logits, _ = model.forward(lora.merge(params, a), tokens, tokens)
    return jnp.mean(logits ** 2)
  grads = jax.grad(loss)(ad)
  assert jax.tree.structure(grads) == jax.tree.structure(ad)
  assert all(np.any(np.asarray(g)) for g in jax.tree.leaves(grads))


def test_peft_export_loads_in_peft_with_the_merged_models_logits(base, adapters, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  hf_io.save_hf_checkpoint(tmp_path / "base", base, CFG)
  written = save_peft_adapter(tmp_path / "lora", adapters, LORA,
                              base_model_name_or_path=str(tmp_path / "base"))
  assert {p.name for p in written} == {"adapter_model.safetensors", "adapter_config.json"}
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
  peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "lora").eval()
  tokens = np.array([[3, 17, 5, 60, 2, 9, 44, 1]], np.int64)
  with torch.no_grad():
    theirs = peft_model(input_ids=torch.from_numpy(tokens)).logits.float().numpy()
  ours, _ = MODEL.forward(MERGE(base, adapters), tokens.astype(np.int32),
                          np.arange(8, dtype=np.int32)[None])
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-4, rtol=0)
  with torch.no_grad():  # the adapters matter: without them the logits differ
    plain = hf(input_ids=torch.from_numpy(tokens)).logits.float().numpy()
  with peft_model.disable_adapter(), torch.no_grad():
    plain = peft_model(input_ids=torch.from_numpy(tokens)).logits.float().numpy()
  assert np.max(np.abs(plain - theirs)) > 1e-2
  with pytest.raises(FileExistsError):
    save_peft_adapter(tmp_path / "lora", adapters, LORA)


def test_adapter_gradients_follow_the_chain_rule_through_the_full_weight_gradient(base,
                                                                                 adapters):
  """dL/dA = s B^T G and dL/dB = s G A^T (HF layout), G = dL/dW' of the merged weight."""
  tokens = (np.arange(12, dtype=np.int32)[None] * 7) % CFG.vocab_size
  pos = np.arange(12, dtype=np.int32)[None]

  def loss(params):
    logits, _ = MODEL.forward(params, tokens, pos)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  merged = MERGE(base, adapters)
  g_full = jax.device_get(jax.jit(jax.grad(loss))(merged))
  g_ad = jax.device_get(jax.jit(jax.grad(lambda a: loss(LORA.merge(base, a))))(adapters))
  s, r = LORA.cfg.alpha / LORA.cfg.rank, LORA.cfg.rank
  for name, k in (("wq", 1), ("wo", 2), ("w_down", 1)):
    g = np.asarray(g_full["layers"][name], np.float64)
    a = np.asarray(adapters[f"layers/{name}"]["lora_a"], np.float64)
    b = np.asarray(adapters[f"layers/{name}"]["lora_b"], np.float64)
    for i in range(CFG.n_layers):
      in_w = int(np.prod(g.shape[1:1 + k]))
      g_hf, a_hf, b_hf = g[i].reshape(in_w, -1).T, a[i].reshape(r, in_w), b[i].reshape(-1, r)
      np.testing.assert_allclose(
          g_ad[f"layers/{name}"]["lora_a"][i].reshape(r, in_w), s * b_hf.T @ g_hf,
          atol=1e-6, rtol=1e-4)
      np.testing.assert_allclose(
          g_ad[f"layers/{name}"]["lora_b"][i].reshape(-1, r), s * g_hf @ a_hf.T,
          atol=1e-6, rtol=1e-4)
