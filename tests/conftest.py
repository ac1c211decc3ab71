"""Test set-up: CPU with 8 virtual devices and strict rank promotion, before JAX is imported;
shared fixtures: a tiny random model checkpoint and tiny RL run configs."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
# Every program the tests compile (and their child processes, which inherit XLA_FLAGS) at XLA's
# backend optimization level 0 (LLVM -O0): the suite is compile-bound (tiny models, few steps;
# backend compiles are most of its CPU time) and -O0 compiles the same programs cheaper
# (measured: 25 % less CPU on four learner and sampler test files, WORKSPACE_NOTES.md). Numbers
# stay within every test's tolerance; test_drivers' goldens are recorded at this level
# (tests/pipeline/golden/README.md). RLAX_PIPE_TEST_DEFAULT_XLA_OPT=1 keeps XLA's default level.
if "xla_backend_optimization_level" not in _flags and not os.environ.get(
    "RLAX_PIPE_TEST_DEFAULT_XLA_OPT"):
  _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
# One persistent compilation cache for the session, shared with its child processes (they inherit
# the variables): the suite compiles the same programs again and again (each Learner jits its own
# step, every tiny end-to-end run builds one; entry points and multi-process jobs start fresh
# processes), and a program compiled once is then loaded. Measured: 22 % less CPU on seven
# end-to-end test files (WORKSPACE_NOTES.md). A cache directory set by the caller is kept.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  import atexit
  import shutil
  import tempfile
  _cache_dir = tempfile.mkdtemp(prefix="rlax_pipe_tests_jax_cache_")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache_dir,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")

import jax  # noqa: E402  (must follow the environment set-up above)

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

# Property tests keep no example database: none is written into the repository (.hypothesis/),
# and parallel workers (pytest-xdist) share no file. Failures still print their example.
import json  # noqa: E402

import hypothesis  # noqa: E402
import pytest  # noqa: E402

hypothesis.settings.register_profile("rlax_pipe", database=None)
hypothesis.settings.load_profile("rlax_pipe")

# ---- opt-in per-test CPU report (suite-time work, load-independent) -------------------------
#
# RLAX_PIPE_TEST_CPU_REPORT=/path/report.jsonl appends one JSON line per test: the CPU seconds of
# this process (time.process_time(): every thread, XLA's compile and run threads included) and of
# its finished child processes (resource.getrusage(RUSAGE_CHILDREN), user + system) spent in the
# test's setup, call and teardown (so a module fixture's cost lands on the first test that uses
# it), and its wall seconds. Each process (pytest-xdist worker) also writes one "session" line
# with its whole CPU (imports and collection included). Summarise with tests/cpu_report.py.

import resource  # noqa: E402
import time  # noqa: E402

_CPU_REPORT = os.environ.get("RLAX_PIPE_TEST_CPU_REPORT")


def _children_cpu_s():
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def _write_cpu_record(record):
  with open(_CPU_REPORT, "a", encoding="utf-8") as f:
    f.write(json.dumps(record) + "\n")  # one short write per line: O_APPEND keeps lines whole


if _CPU_REPORT:

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
    cpu0, child0, wall0 = time.process_time(), _children_cpu_s(), time.perf_counter()
    yield
    _write_cpu_record({
        "kind": "test", "nodeid": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "cpu_s": time.process_time() - cpu0, "children_cpu_s": _children_cpu_s() - child0,
        "wall_s": time.perf_counter() - wall0})

  def pytest_sessionfinish(session, exitstatus):  # pylint: disable=unused-argument
    _write_cpu_record({
        "kind": "session", "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "pid": os.getpid(), "cpu_s": time.process_time(), "children_cpu_s": _children_cpu_s()})

# ---- shared fixtures of the pipeline and experiments tests ---------------------------------

# pylint: disable=wrong-import-position
from rlax_pipe import objectives  # noqa: E402
from rlax_pipe import tasks
from rlax_pipe.config import ModelConfig
from rlax_pipe.learner import CheckpointConfig, LearnerConfig, OptimizerConfig
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
      driver=driver, mode=mode, num_steps=steps, group_size=size,
      seq_len=MAX_SEQ, staleness=staleness.StalenessConfig(policy=policy, max_lag=max_lag,
                                                           groups_per_step=groups),
      eval_every=100, eval_problems=4, checkpoint_every=1, wait_timeout_s=120.0)
  sampler = SamplerConfig(num_slots=4, page_size=8, num_pages=32, max_seq_len=MAX_SEQ,
                          max_new_tokens=MAX_SEQ, min_prefill_bucket=16, eos_id=tok.eos_id,
                          sampling=SamplingConfig(temperature=1.0), seed=seed)
  learner = LearnerConfig(mesh_axes=(("fsdp", 2), ("tp", 2)), seed=seed,
                          optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=0),
                          checkpoint=CheckpointConfig(async_save=False))
  return run_lib.RunConfig(
      run_dir=str(tmp_path / run_name), init=init, sampler_mesh_axes=(("tp", 2),),
      learner=learner,
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


# ---- plots: every panel labelled ------------------------------------------------------------

import matplotlib.figure  # noqa: E402

_SAVED = []


@pytest.fixture(name="saved_figures")
def saved_figures_fixture(monkeypatch):
  """Figures passed to savefig during the test (they are still written)."""
  _SAVED.clear()
  original = matplotlib.figure.Figure.savefig

  def savefig(fig, *args, **kwargs):
    _SAVED.append(fig)
    return original(fig, *args, **kwargs)

  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
  return _SAVED


def _assert_every_panel_labelled(figures):
  """Each axes of each figure has a title and a y-label."""
  assert figures
  for fig in figures:
    for ax in fig.axes:
      assert ax.get_title(), f"untitled panel (ylabel {ax.get_ylabel()!r})"
      assert ax.get_ylabel(), f"panel {ax.get_title()!r} has no y-label"


@pytest.fixture(name="assert_every_panel_labelled")
def assert_every_panel_labelled_fixture():
  return _assert_every_panel_labelled
