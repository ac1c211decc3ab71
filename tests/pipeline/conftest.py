"""Shared fixtures of the pipeline tests: a tiny random model checkpoint and tiny run configs."""

import json

import jax
import pytest

from rlax_pipe import objectives
from rlax_pipe import tasks
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner import LearnerConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.model import hf_io, transformer
from rlax_pipe.pipeline import config as pconfig
from rlax_pipe.pipeline import run as run_lib
from rlax_pipe.pipeline import staleness
from rlax_pipe.sampler import SamplerConfig
from rlax_pipe.tokenizer import default_tokenizer

MAX_SEQ = 48


@pytest.fixture(scope="session")
def tiny_init(tmp_path_factory):
  tok = default_tokenizer()
  cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                    head_dim=8, d_ff=64, max_seq_len=MAX_SEQ)
  path = tmp_path_factory.mktemp("tiny_init")
  hf_io.save_hf_checkpoint(path / "ckpt", jax.device_get(transformer.init_params(
      cfg, jax.random.key(0))), cfg)
  return str(path / "ckpt")


def tiny_config(tmp_path, init, *, driver="pipeline", mode="reproducible", steps=3, max_lag=1,
            policy="block", seed=0, resume=False, run_name="run"):
  tok = default_tokenizer()
  groups, size = 2, 2
  pipe = pconfig.PipelineConfig(
      driver=driver, mode=mode, num_steps=steps, groups_per_step=groups, group_size=size,
      seq_len=MAX_SEQ, staleness=staleness.StalenessConfig(policy=policy, max_lag=max_lag,
                                                           groups_per_step=groups),
      eval_every=100, eval_problems=4, checkpoint_every=1, wait_timeout_s=120.0, seed=seed)
  sampler = SamplerConfig(num_slots=4, page_size=8, num_pages=32, max_seq_len=MAX_SEQ,
                          max_new_tokens=MAX_SEQ, min_prefill_bucket=16, eos_id=tok.eos_id,
                          sampling=SamplingConfig(temperature=1.0), seed=seed)
  learner = LearnerConfig(mesh_axes=(("fsdp", 2), ("tp", 2)), learning_rate=1e-3, seed=seed,
                          async_checkpointing=False)
  return run_lib.RunConfig(
      run_dir=str(tmp_path / run_name), init=init, num_sampler_devices=2,
      num_learner_devices=4, sampler_mesh_axes=(("tp", 2),), learner=learner,
      objective=objectives.ObjectiveConfig(name="tis_pg"), sampler=sampler, pipeline=pipe,
      eval_slots=4, resume=resume,
      task_config=tasks.ArithmeticConfig(max_terms=4))


def train_rows(run_dir):
  rows = [json.loads(l) for l in open(f"{run_dir}/metrics.jsonl")]
  return [r for r in rows if r["kind"] == "train"]




@pytest.fixture(name="tiny_config")
def tiny_config_fixture():
  return tiny_config


@pytest.fixture(name="train_rows")
def train_rows_fixture():
  return train_rows
