"""One command on an HF model directory (issue #17 item 5, with item 9's fields): a tiny random
Qwen3 saved by transformers, a byte-level BPE tokenizer trained here with a ChatML chat template,
and JSONL train / evaluation files. The SFT entry point fine-tunes the directory (chat prompts);
the RL job starts from its output and runs 2 learner steps with in-flight updates (top-k / top-p
sampling, max new tokens, one checkpoint kept, a separate evaluation file); the exported HF
directory loads back in transformers with the same logits and the same token ids."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# pylint: disable=wrong-import-position
from rlax_pipe import sft  # noqa: E402
from rlax_pipe import tasks  # noqa: E402
from rlax_pipe.learner import CheckpointConfig, LearnerConfig, OptimizerConfig  # noqa: E402
from rlax_pipe.logprobs import SamplingConfig  # noqa: E402
from rlax_pipe.model import hf_io, transformer  # noqa: E402
from rlax_pipe.pipeline import run as run_lib  # noqa: E402
from rlax_pipe.pipeline.config import PipelineConfig, RunConfig  # noqa: E402
from rlax_pipe.pipeline.staleness import StalenessConfig  # noqa: E402
from rlax_pipe.sampler import SamplerConfig  # noqa: E402
from rlax_pipe.tokenizer import PromptFormat, load_tokenizer  # noqa: E402

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
ROOT = pathlib.Path(__file__).resolve().parents[2]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SEQ = 64


def _problems(n, offset):
  rng = np.random.default_rng(offset)
  out = []
  for _ in range(n):
    a, b = (int(x) for x in rng.integers(1, 20, 2))
    out.append({"prompt": f"What is {a}+{b}?", "answer": str(a + b)})
  return out


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _model_dir(path, train_rows):
  """Random tiny Qwen3 (transformers) + ChatML BPE tokenizer + generation_config.json."""
  tk = tokenizers.Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  corpus = [f"{r['prompt']} Answer: {r['answer']}" for r in train_rows] * 4
  tk.train_from_iterator(corpus, trainers.BpeTrainer(
      vocab_size=300, special_tokens=SPECIALS, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  ids = {s: tk.token_to_id(s) for s in SPECIALS}
  torch.manual_seed(0)
  config = transformers.Qwen3Config(
      vocab_size=tk.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ,
      tie_word_embeddings=False, eos_token_id=ids["<|im_end|>"], bos_token_id=None)
  transformers.Qwen3ForCausalLM(config).save_pretrained(path)
  tk.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
      "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML}))
  # As Qwen3 ships it: two stop ids.
  (path / "generation_config.json").write_text(json.dumps(
      {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
  return path, ids


def _rl_config(tmp_path, init, train, evals):
  sampler = SamplerConfig(num_slots=4, page_size=8, num_pages=32, max_seq_len=SEQ,
                          max_new_tokens=12, sampling=SamplingConfig(temperature=1.0, top_k=40,
                                                                     top_p=0.95))
  pipeline = PipelineConfig(
      num_steps=2, group_size=2, seq_len=SEQ, eval_every=100, eval_problems=3,
      checkpoint_every=1, staleness=StalenessConfig("learner-wait", 1, 2))
  # The learner compiles at LLVM -O0 (the 2-step run is compile-bound; the exported weights
  # are checked against transformers below, not against a fixed number).
  learner = LearnerConfig(mesh_axes=(), optimizer=OptimizerConfig(learning_rate=1e-3,
                                                                   warmup_steps=0),
                          checkpoint=CheckpointConfig(keep=1, async_save=False),
                          compiler_options=(("xla_backend_optimization_level", 0),))
  return RunConfig(
      run_dir=str(tmp_path / "rl"), init=str(init), task="dataset_file",
      task_config=tasks.DatasetFileConfig(path=str(train), eval_path=str(evals),
                                          answer_format="marker"),
      prompt_format=PromptFormat("chat"), sampler=sampler, pipeline=pipeline, learner=learner,
      eval_slots=3)


def test_sft_then_rl_on_an_hf_model_directory_and_export(tmp_path):
  train = _write_jsonl(tmp_path / "train.jsonl", _problems(24, 0))
  evals = _write_jsonl(tmp_path / "test.jsonl", _problems(3, 1))
  hf_dir, ids = _model_dir(tmp_path / "qwen3", _problems(24, 0))
  # SFT demonstrations in chat format end with the template's end-of-turn token.
  chat_tok = load_tokenizer(hf_dir, prompt_format=PromptFormat("chat"))
  problem = tasks.DatasetFileTask(tasks.DatasetFileConfig(path=str(train))).problem(0)
  demo = sft.reference_rollout(problem, chat_tok, 0)
  assert demo.completion_tokens[-1] == ids["<|im_end|>"]
  assert chat_tok.decode(demo.prompt_tokens, stop_at_eos=False).endswith("assistant\n")

  # The SFT entry point on the HF directory (chat prompts, the dataset file).
  sft_dir = tmp_path / "sft"
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  out = subprocess.run(
      [sys.executable, "experiments/sft.py", "--config=experiments/configs/sft.py:dataset_file",
       f"--config.init={hf_dir}", f"--config.task_config.path={train}",
       f"--config.task_config.eval_path={evals}", "--config.task_config.answer_format=marker",
       "--config.prompt_format.kind=chat", f"--config.out_dir={sft_dir}",
       "--config.sft.steps=2", "--config.sft.rows=2", f"--config.sft.seq_len={SEQ}",
       "--config.sft.warmup_steps=0", "--config.sft.eval_problems=2",
       "--config.sft.eval_slots=2"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.strip().splitlines()[-1])["steps"] == 2
  assert (sft_dir / "tokenizer.json").exists() and (sft_dir / "generation_config.json").exists()

  # RL from the SFT output: 2 learner steps, in-flight updates, a separate evaluation file.
  versions = []

  class Record:
    def on_step(self, job, result, time_s):
      del time_s
      versions.append(sorted({int(v) for r in result.rollouts for v in r.policy_versions}))
      assert set(job.cfg.sampler.stop_ids) == {ids["<|im_end|>"], ids["<|endoftext|>"]}
      assert job.task.config.eval_path == str(evals)

    def on_end(self, job, time_s):
      del job, time_s

  cfg = _rl_config(tmp_path, sft_dir, train, evals)
  summary = run_lib.run(cfg, hooks=[Record()])
  assert summary["steps"] == 2 and summary["final_heldout_accuracy"] is not None
  rows = [json.loads(l) for l in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
  train_rows = [r for r in rows if r["kind"] == "train"]
  assert [r["step"] for r in train_rows] == [1, 2]
  assert train_rows[-1]["sampler_version"] >= 1  # version 1 reached the running sampler
  assert max(max(v) for v in versions) >= 1      # and sampled tokens that were trained
  # Sampler and learner score with the same top-k / top-p distribution: version-0 tokens of
  # step 1 have (numerically) the same log-probs on both sides.
  assert train_rows[0]["logp_mismatch_max"] < 1e-3
  assert all(max(r["completion_lengths"]) <= 12 for r in train_rows)  # max_new_tokens
  ckpts = [p for p in (tmp_path / "rl" / "checkpoints").iterdir() if p.name.isdigit()]
  assert [p.name for p in ckpts] == ["2"]  # learner.checkpoint.keep=1

  # The export loads back in transformers: same logits as ours, same token ids.
  export = tmp_path / "rl" / "hf"
  theirs_model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
  theirs_tok = transformers.AutoTokenizer.from_pretrained(export)
  ours_tok = load_tokenizer(export, prompt_format=PromptFormat("chat"))
  text = "What is 3+4? Answer: 7"
  assert theirs_tok(text)["input_ids"] == ours_tok.encode(text)
  model_cfg, params = hf_io.load_hf_checkpoint(export)
  tokens = np.asarray([ours_tok.encode_prompt("What is 3+4?")], np.int32)
  positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
  ours, _ = jax.jit(transformer.forward, static_argnums=3)(
      params, jnp.asarray(tokens), jnp.asarray(positions), model_cfg)
  with torch.no_grad():
    theirs = theirs_model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-4, rtol=0)
  assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == [
      ids["<|im_end|>"], ids["<|endoftext|>"]]
