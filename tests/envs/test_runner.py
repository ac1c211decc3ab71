"""EpisodeEngine: episodes on the sampler engine with tools in worker processes. A raising, a
hanging and a flooding tool become error messages (or end the episode), counted, never a dead
run; environment tokens are exactly the rendered results, mask 0; a run snapshotted while
episodes wait on tools resumes with every episode finished once."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_pipe import envs, model
from rlax_pipe import tokenizer as tokenizer_lib
from rlax_pipe.config import ModelConfig
from rlax_pipe.logprobs import SamplingConfig
from rlax_pipe.sampler import Request, SamplerConfig, SamplerEngine

from fake_tools import FakeEnv  # this directory; light, the tool workers import it

TOK = tokenizer_lib.default_tokenizer()
MODEL = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                    head_dim=16, d_ff=32, max_seq_len=96)
# many stop ids (EOS and most byte pieces): random weights end a turn every few tokens
CFG = SamplerConfig(num_slots=4, page_size=8, num_pages=48, max_seq_len=96, max_new_tokens=80,
                    min_prefill_bucket=16, prefill_rows=4, eos_id=(3,) + tuple(range(5, 120)),
                    sampling=SamplingConfig(temperature=1.0), decode_steps_per_dispatch=4)
TOOL_OF_PROMPT = {0: "echo", 1: "boom", 2: "hang", 3: "flood", 4: "nope", 5: "slow"}


@pytest.fixture(scope="module")
def params():
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda a: jnp.asarray(rng.normal(0.0, 0.5, a.shape).astype(np.float32)),
                      model.abstract_params(MODEL))


def _episode_engine(params, cfg, synchronous=True, seed=0):
  engine = SamplerEngine(MODEL, CFG, params)
  spans = []
  runner = envs.EpisodeEngine(engine, FakeEnv(), TOK, _IndexProtocol(), cfg,
                              synchronous=synchronous,
                              on_span=lambda *a: spans.append(a))
  runner.protocol.runner = runner
  return runner, spans


class _IndexProtocol:
  """Every turn calls TOOL_OF_PROMPT[prompt_index % 6] of the episode being parsed."""

  runner = None

  def parse(self, text):
    del text
    return [envs.ToolCall(TOOL_OF_PROMPT[self.current % 6], "")]

  def render(self, tok, results):
    return envs.PlainTextProtocol().render(tok, results)


def _submit(runner, ids, max_new=80):
  for i in ids:
    runner.submit(Request(prompt_tokens=np.array(TOK.encode(f"Q: {i}\n", add_bos=True)),
                          sample_id=i, group_id=i, prompt_index=i, max_new_tokens=max_new))


def _patch_parse(runner):
  """Lets the protocol know which episode's turn it parses."""
  original = runner._turn_ended

  def turn_ended(r):
    runner.protocol.current = r.prompt_index
    return original(r)
  runner._turn_ended = turn_ended


def test_failing_tools_become_messages_and_counts(params):
  cfg = envs.EnvConfig(max_turns=3, max_tool_output_tokens=16, tool_timeout_s=5.0,
                       tool_workers=2)
  runner, spans = _episode_engine(params, cfg)
  _patch_parse(runner)
  ids = [0, 1, 3, 4]
  try:
    _submit(runner, ids)
    out = runner.run_to_completion()
  finally:
    runner.close()
  assert sorted(r.sample_id for r in out) == ids
  expected = {0: "12\n", 1: "error: tool failed: RuntimeError('tool bug')\n",
              3: "error: output too long (500 tokens > 16)\n",
              4: "error: unknown tool 'nope'; tools: echo, boom, hang, flood, slow\n"}
  for r in out:
    mask = r.completion_mask
    if r.finish_reason != "eos":  # the sampler's budget ended it
      continue
    assert r.num_turns == 3 or runner.counts["ended_budget"] > 0  # a long error message
    # environment tokens: exactly the rendered result after each turn but the last
    env_at = np.flatnonzero(mask == 0)
    env_runs = np.split(env_at, np.flatnonzero(np.diff(env_at) > 1) + 1)
    assert len(env_runs) == r.num_turns - 1
    for run in env_runs:
      assert TOK.decode(r.completion_tokens[run]) == expected[r.sample_id]
      assert np.all(r.behavior_logprobs[run] == 0.0)
  counts = runner.tools.counts
  assert counts["error"] >= 1 and counts["too_long"] >= 1
  assert counts["unknown"] >= 1 and counts["ok"] >= 1
  assert runner.counts["episodes"] == 4
  assert any(s[0] == "env" and s[1] == "tool" for s in spans)
  assert runner.engine.stats().continued_tokens > 0 and runner.engine.num_parked == 0


def test_hanging_tool_is_killed_and_can_end_the_episode(params):
  cfg = envs.EnvConfig(max_turns=3, tool_timeout_s=1.0, on_tool_failure="end")
  runner, _ = _episode_engine(params, cfg)
  _patch_parse(runner)
  try:
    _submit(runner, [2])
    t0 = time.monotonic()
    (r,) = runner.run_to_completion()
    assert time.monotonic() - t0 < 30  # not the tool's 60 s
  finally:
    runner.close()
  if r.finish_reason == "eos":
    assert r.num_turns == 1 and r.loss_mask is None
    assert runner.counts["ended_tool_failure"] == 1
    assert runner.tools.counts["timeout"] == 1 and runner.tools.restarts == 1


def test_resume_while_episodes_wait_on_tools(params):
  cfg = envs.EnvConfig(max_turns=2, tool_timeout_s=5.0)
  runner, _ = _episode_engine(params, cfg)
  _patch_parse(runner)
  runner._launch = lambda: None  # the run is "killed" before the tools it waits on return
  ids = [0, 6]  # both call echo
  done = []
  try:
    _submit(runner, ids)
    while runner.engine.has_work:
      done += runner.step()
    state = runner.state_dict()
  finally:
    runner.close()
  waiting = {sid for sid, _ in state["episodes"]["pending"]}
  assert waiting and waiting | {r.sample_id for r in done} == set(ids)
  restored, _ = _episode_engine(params, cfg)
  _patch_parse(restored)
  try:
    restored.load_state_dict(state)
    assert restored.engine.num_parked == len(waiting)
    done += restored.run_to_completion()
  finally:
    restored.close()
  assert sorted(r.sample_id for r in done) == sorted(ids)  # nothing lost, nothing twice
  for r in done:
    if r.sample_id in waiting and r.finish_reason == "eos":
      assert r.num_turns == 2
      assert TOK.decode(r.completion_tokens[r.completion_mask == 0]) == "12\n"


def test_background_tools_overlap_decoding(params):
  cfg = envs.EnvConfig(max_turns=2, tool_timeout_s=5.0)
  runner, spans = _episode_engine(params, cfg, synchronous=False)
  _patch_parse(runner)
  ids = [0, 5, 6]  # echo, slow (0.3 s), echo
  try:
    _submit(runner, ids)
    out = runner.run_to_completion()
  finally:
    runner.close()
  assert sorted(r.sample_id for r in out) == ids and runner.engine.num_parked == 0
  for r in out:
    if r.finish_reason == "eos":
      assert r.num_turns == 2 and TOK.decode(r.completion_tokens[r.completion_mask == 0]) == "12\n"
  tool_spans = [s for s in spans if s[:2] == ("env", "tool")]
  assert tool_spans
  if any(r.sample_id == 5 and r.num_turns == 2 for r in out):
    assert runner.tool_s >= 0.29  # the slow tool's time is recorded apart from decoding
