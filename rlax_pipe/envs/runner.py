"""`EpisodeEngine`: multi-turn, tool-calling episodes on a `SamplerEngine`, behind its interface.

It wraps a sampler engine and is used where one is (`submit`, `step`, `abort`, `abort_all`,
`unfinished`, `state_dict`, `update_weights`, ... ; attributes it does not define are the
engine's). Every request becomes an episode (`Request.multi_turn`):

  1. the engine samples a turn; one that ends on a stop id parks the sequence (slot freed,
     pages kept) and comes back from `engine.step` as a Rollout of the episode so far;
  2. the protocol (`rlax_pipe.envs.protocols`) parses the turn's text (the model's tokens of
     that turn, decoded) into tool calls; none, or the turn limit reached, ends the episode;
  3. the calls run in the verifier worker processes (`ToolPool`, hard time limit) on a
     background thread, so decoding goes on while tools run (`synchronous=True` waits for them
     inside the step: reproducible runs and tests);
  4. the results are rendered once into tokens and appended by `engine.continue_sequence` (a
     prefill continuation onto the kept pages); the episode decodes its next turn.

`step` returns finished episodes: one Rollout each (prompt, every turn's model tokens with their
behaviour log-probs and versions, the environment's tokens with loss mask 0; `num_turns`),
ungraded like the engine's; the task grades `Rollout.last_turn_tokens`. Tool time is recorded as
timeline spans (component "env", kind "tool"), apart from the sampler's decode spans.

Resume: `state_dict` holds the engine's state (parked episodes included) and the tool calls of
the episodes waiting on tools; `load_state_dict` runs those calls again, so an episode is
neither lost nor duplicated by a restart while its tools run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable

from rlax_pipe.envs import protocols
from rlax_pipe.envs.base import EnvConfig, is_environment, ToolCall, ToolResult
from rlax_pipe.envs.tool_pool import ToolPool
from rlax_pipe.sampler import Request, SamplerEngine
from rlax_pipe.tokenizer import Tokenizer
from rlax_pipe.types import Rollout, WeightUpdate

# on_span(component, kind, start_s, end_s, slots_active, slots_total), as the engine's hook
SpanHook = Callable[[str, str, float, float, int, int], None]
EPISODE_COUNTS: tuple[str, ...] = (
    "episodes", "turns", "tool_waves", "tool_calls", "ended_final_answer", "ended_max_turns",
    "ended_tool_failure", "ended_budget", "ended_sampler")


class EpisodeEngine:
  """Runs every request as a multi-turn episode (see the module docstring).

  Args:
    engine: the sampler engine (its stop set must end a model turn).
    env: the environment (`rlax_pipe.envs.base.Environment`): its tools run in workers.
    tok: the tokenizer of the model.
    protocol: a `PlainTextProtocol` or `ChatToolProtocol`; None = `protocol_for(env, chat)`.
    chat: prompts are chat-template conversations (picks the default protocol).
    cfg: limits and failure handling.
    problem_of: the task `Problem` of a request (default: `env.problem(prompt_index, "train")`).
    synchronous: run each step's tool calls inside the step (deterministic); False = on a
      background thread while the engine decodes.
    on_span: timeline hook (component "env", kind "tool").
    clock: seconds, for the spans (default `time.perf_counter`).

  Raises:
    ValueError: when the engine has no stop ids (a turn could never end) or the environment
      cannot be sent to the worker processes.
  """

  def __init__(self, engine: SamplerEngine, env, tok: Tokenizer, protocol=None,
               cfg: EnvConfig = EnvConfig(), *, chat: bool = False,
               problem_of: Callable[[Request], Any] | None = None, synchronous: bool = True,
               on_span: SpanHook | None = None, clock: Callable[[], float] = time.perf_counter):
    if not engine.cfg.stop_ids:
      raise ValueError("EpisodeEngine: SamplerConfig.eos_id is empty, so a model turn never "
                       "ends; set it to the tokenizer's stop ids.")
    protocol = protocols.protocol_for(env, chat) if protocol is None else protocol
    self.engine, self.env, self.tok, self.protocol, self.env_cfg = engine, env, tok, protocol, cfg
    self.problem_of = problem_of or (lambda rq: env.problem(rq.prompt_index, "train"))
    self.synchronous, self.on_span, self.clock = synchronous, on_span, clock
    self.tools = ToolPool(env, cfg, tok)
    self._requests: dict[int, Request] = {}
    self._waiting: dict[int, tuple[Rollout, list[ToolCall]]] = {}  # on tools, not yet sent
    self._running: dict[int, tuple[Rollout, list[ToolCall]]] = {}  # on tools, sent
    self._future: concurrent.futures.Future | None = None
    self._executor = None if synchronous else concurrent.futures.ThreadPoolExecutor(1)
    self.counts = {k: 0 for k in EPISODE_COUNTS}
    self.tool_s = 0.0

  def __getattr__(self, name):
    return getattr(self.engine, name)

  # --- requests ------------------------------------------------------------------------------
  def submit(self, request: Request) -> None:
    """Queues an episode (the request as a `multi_turn` one); see `SamplerEngine.submit`."""
    request = dataclasses.replace(request, multi_turn=True)
    self.engine.submit(request)
    self._requests[request.sample_id] = request

  @property
  def has_work(self) -> bool:
    """Whether an episode is decoding, waiting for a slot, or waiting on its tools."""
    return self.engine.has_work or bool(self._waiting or self._running)

  def abort(self, sample_id: int) -> Rollout | None:
    """Stops one episode (decoding, waiting, or waiting on tools); see `SamplerEngine.abort`."""
    self._waiting.pop(sample_id, None)
    self._running.pop(sample_id, None)  # a result that still arrives is dropped
    self._requests.pop(sample_id, None)
    return self.engine.abort(sample_id)

  def unfinished(self) -> dict[int, int | None]:
    """The engine's unfinished requests (`SamplerEngine.unfinished`). An episode waiting on its
    tools between two turns is among them: the engine parks a multi-turn sequence at the end of
    its turn (pages kept) until `update`/`end_sequence`, so the rollout worker's lost-sample
    check never takes it for lost."""
    return self.engine.unfinished()

  def update_weights(self, update: WeightUpdate) -> None:
    """Hands newer weights to the engine (`SamplerEngine.update_weights`); episodes waiting on
    their tools continue with them at their next turn."""
    self.engine.update_weights(update)

  def abort_all(self) -> list[Rollout]:
    """Stops every episode; see `SamplerEngine.abort_all`."""
    self._waiting.clear()
    self._running.clear()
    self._requests.clear()
    return self.engine.abort_all()

  def close(self) -> None:
    """Ends the tool worker processes and the tool thread."""
    if self._executor is not None:
      self._executor.shutdown(wait=True)
    self.tools.close()

  # --- stepping -------------------------------------------------------------------------------
  def step(self) -> list[Rollout]:
    """One engine step, then the environment's part: turns that ended are parsed, their tool
    calls started (or run, when synchronous), finished tool results appended. Returns the
    episodes that finished."""
    out = []
    for r in self.engine.step():
      if r.finish_reason == "eos" and r.sample_id in self._requests:
        done = self._turn_ended(r)
      else:  # length, capacity, aborted: the sampler ended the episode
        done = r
        self.counts["ended_sampler"] += 1
      if done is not None:
        out.append(self._finish(done))
    self._harvest(out, wait=self.synchronous)
    self._launch()
    if self.synchronous:
      self._harvest(out, wait=True)
    elif not self.engine.has_work and self._future is not None:
      self._harvest(out, wait=True)  # nothing to decode: wait for the tools
    return out

  def run_to_completion(self) -> list[Rollout]:
    """Steps until every episode finished; returns them in finishing order."""
    out = []
    while self.has_work:
      out.extend(self.step())
    return out

  def _finish(self, r: Rollout) -> Rollout:
    self._requests.pop(r.sample_id, None)
    self.counts["episodes"] += 1
    self.counts["turns"] += r.num_turns
    return r

  def _end(self, r: Rollout, why: str) -> Rollout:
    self.engine.end_sequence(r.sample_id)
    self.counts[f"ended_{why}"] += 1
    return r

  def _turn_ended(self, r: Rollout) -> Rollout | None:
    """Parses a finished turn: the episode ends (returned) or waits on its tools (None)."""
    text = self.tok.decode(r.last_turn_tokens)
    calls = self.protocol.parse(text)
    if not calls:
      return self._end(r, "final_answer")
    if r.num_turns >= self.env_cfg.max_turns:
      return self._end(r, "max_turns")
    self._waiting[r.sample_id] = (r, calls)
    return None

  def _launch(self) -> None:
    """Starts the tool calls of every episode waiting on tools (one wave set)."""
    if not self._waiting or self._future is not None:
      return
    batch, self._waiting = self._waiting, {}
    self._running.update(batch)
    limit = self.env_cfg.max_calls_per_turn
    items, owners = [], []
    for sid, (_, calls) in batch.items():
      problem = self.problem_of(self._requests[sid])
      for call in calls[:limit]:
        items.append((problem, call))
        owners.append(sid)
    t0 = self.clock()
    if self._executor is None:
      self._future = concurrent.futures.Future()
      self._future.set_result((self.tools.run(items), owners, t0, self.clock()))
    else:
      self._future = self._executor.submit(
          lambda: (self.tools.run(items), owners, t0, self.clock()))

  def _harvest(self, out: list[Rollout], wait: bool) -> None:
    """Appends the results of the finished tool wave set (waits for it if `wait`)."""
    if self._future is None or (not wait and not self._future.done()):
      return
    future, self._future = self._future, None
    results, owners, t0, t1 = future.result()
    self.tool_s += t1 - t0
    self.counts["tool_waves"] += 1
    if self.on_span is not None:
      self.on_span("env", "tool", t0, t1, len(results), len(results))
    by_episode: dict[int, list[ToolResult]] = {}
    for sid, res in zip(owners, results):
      by_episode.setdefault(sid, []).append(res)
    for sid, res in by_episode.items():
      entry = self._running.pop(sid, None)
      if entry is None:  # aborted while its tools ran
        continue
      r, calls = entry
      self.counts["tool_calls"] += len(calls)
      res += [ToolResult(c, f"at most {self.env_cfg.max_calls_per_turn} tool calls per turn",
                         "invalid") for c in calls[self.env_cfg.max_calls_per_turn:]]
      done = self._answer(r, res)
      if done is not None:
        out.append(self._finish(done))

  def _answer(self, r: Rollout, results: list[ToolResult]) -> Rollout | None:
    """Appends the rendered results to the episode, or ends it (returned)."""
    if any(x.failed for x in results) and self.env_cfg.on_tool_failure == "end":
      return self._end(r, "tool_failure")
    ids = self.protocol.render(self.tok, results)
    rq, cfg = self._requests[r.sample_id], self.engine.cfg
    budget = cfg.max_new_tokens if rq.max_new_tokens is None else rq.max_new_tokens
    end = min(len(r.prompt_tokens) + budget, cfg.max_seq_len)
    if len(r.prompt_tokens) + r.num_completion_tokens + len(ids) >= end or not ids:
      return self._end(r, "budget")  # no room for the results and a model token
    self.engine.continue_sequence(r.sample_id, ids)
    return None

  def episode_metrics(self) -> dict[str, float]:
    """The counters of this run so far, flat, for a metrics row (cumulative over the run,
    resumes included, not per step): "env_<k>" for every `EPISODE_COUNTS` key (episodes
    finished, model turns, tool calls, why episodes ended), "tool_<outcome>" for every
    `TOOL_OUTCOMES` (tool calls by outcome: ok, error, timeout, ...), "tool_s" (seconds spent
    in tool waves, on `clock`: wall seconds in threaded runs, 0 on a reproducible run's virtual
    clock, which charges tool waves through `CostModel.tools` instead) and "tool_restarts" (workers killed since this process started)."""
    return {**{f"env_{k}": v for k, v in self.counts.items()},
            **{f"tool_{k}": v for k, v in self.tools.counts.items()},
            "tool_s": self.tool_s, "tool_restarts": self.tools.restarts}

  # --- state ---------------------------------------------------------------------------------
  def state_dict(self) -> dict:
    """The engine's state (`SamplerEngine.state_dict`, same keys) with the episodes' own under
    "episodes": requests and the calls of episodes waiting on tools (run again on load; a
    result of a tool wave in flight is not saved)."""
    return {**self.engine.state_dict(), "episodes": self._episode_state()}

  def _episode_state(self) -> dict:
    pending = {**self._waiting, **self._running}
    return {"requests": [[sid, rq.prompt_index, rq.group_id, rq.max_new_tokens,
                          rq.prompt_tokens.tolist()] for sid, rq in self._requests.items()],
            "pending": [[sid, [[c.name, c.arguments] for c in calls]]
                        for sid, (_, calls) in pending.items()],
            "counts": dict(self.counts), "tool_counts": dict(self.tools.counts),
            "tool_s": self.tool_s}

  def load_state_dict(self, state: dict) -> None:
    """Restores a `state_dict`; episodes that waited on tools run them again."""
    self.engine.load_state_dict(state)
    self.load_episode_state(state)

  def load_episode_state(self, state: dict) -> None:
    """Restores the episodes' part of a `state_dict` whose engine part the engine already
    loaded (a job restores its engine first)."""
    state = state["episodes"]
    self._waiting.clear()
    self._running.clear()
    self._future = None
    parked = {r.sample_id: r for r in self.engine.parked_rollouts()}
    self._requests = {
        int(sid): Request(prompt_tokens=prompt, sample_id=int(sid), group_id=int(group_id),
                          prompt_index=int(prompt_index), max_new_tokens=max_new,
                          multi_turn=True)
        for sid, prompt_index, group_id, max_new, prompt in state["requests"]}
    for sid, calls in state["pending"]:
      self._waiting[int(sid)] = (parked[int(sid)], [ToolCall(n, a) for n, a in calls])
    self.counts.update(state.get("counts", {}))
    self.tools.counts.update(state.get("tool_counts", {}))
    self.tool_s = float(state.get("tool_s", self.tool_s))


def evaluation_engine(engine: SamplerEngine, env, tok: Tokenizer, env_cfg=None,
                      *, split: str = "eval", chat: bool | None = None):
  """`engine` wrapped as an `EpisodeEngine` for evaluating environment `env` on `split`:
  tool calls run synchronously in worker processes and see the held-out problem of each
  request's prompt index. Close it (`.close()`) to end its tool workers.

  Args:
    engine: an idle sampler engine (its stop set ends a turn).
    env: an environment (`is_environment`).
    tok: the tokenizer.
    env_cfg: `EnvConfig` limits (None = defaults).
    split: the split of the problems evaluated.
    chat: chat-template prompts (None = the tokenizer's prompt format).

  Raises:
    ValueError: when `env` has no tools, or from `EpisodeEngine`.
  """
  if not is_environment(env):
    raise ValueError(f"evaluation_engine: {type(env).__name__} has no tools (call_tool, "
                     "tool_names); evaluate it with the plain engine.")
  chat = tok.prompt_format.kind == "chat" if chat is None else chat
  return EpisodeEngine(engine, env, tok, None, env_cfg or EnvConfig(), chat=chat,
                       problem_of=lambda rq: env.problem(rq.prompt_index, split),
                       synchronous=True)
