"""Tests of safe_reward: errors, hangs and invalid values score 0.0, are counted and logged."""

import threading

from absl import logging
import numpy as np
import pytest

from rlax_pipe import tasks

PROBLEM = tasks.Problem(index=0, split="train", prompt="Q: 1+1\n", answer="2",
                        solution="1+1=2\nA: 2", difficulty=2.0)


class _FnTask:
  name = "fn"

  def __init__(self, fn):
    self.fn = fn

  def reward(self, problem, completion):
    return self.fn(problem, completion)


@pytest.fixture
def warnings(monkeypatch):
  messages = []
  monkeypatch.setattr(logging, "warning", lambda msg, *args: messages.append(msg % args))
  return messages


@pytest.mark.parametrize("timeout_s", [None, 1.0])
def test_ok(timeout_s, warnings):
  stats = tasks.RewardStats()
  task = tasks.ArithmeticTask()
  assert tasks.safe_reward(task, PROBLEM, "A: 2", sample_id=1, timeout_s=timeout_s,
                           stats=stats) == 1.0
  assert tasks.safe_reward(task, PROBLEM, "A: 3", sample_id=2, timeout_s=timeout_s,
                           stats=stats) == 0.0
  assert stats.snapshot() == tasks.RewardCounts(ok=2)
  assert not warnings


@pytest.mark.parametrize("timeout_s", [None, 1.0])
def test_raising_reward(timeout_s, warnings):
  def boom(problem, completion):
    raise KeyError("verifier bug")
  stats = tasks.RewardStats()
  assert tasks.safe_reward(_FnTask(boom), PROBLEM, "A: 2", sample_id=17, timeout_s=timeout_s,
                           stats=stats) == 0.0
  assert stats.snapshot() == tasks.RewardCounts(error=1)
  assert len(warnings) == 1 and "sample 17" in warnings[0] and "verifier bug" in warnings[0]


def test_hanging_reward_is_abandoned(warnings):
  release = threading.Event()
  def hang(problem, completion):
    release.wait(30.0)
    return 1.0
  stats = tasks.RewardStats()
  try:
    reward = tasks.safe_reward(_FnTask(hang), PROBLEM, "A: 2", sample_id=42, timeout_s=0.05,
                               stats=stats)
    assert reward == 0.0
    assert stats.timeouts == 1 and stats.snapshot().failed == 1
    assert len(warnings) == 1 and "sample 42" in warnings[0] and "exceeded" in warnings[0]
    abandoned = [t for t in threading.enumerate() if t.name == "reward-42"]
    assert abandoned and abandoned[0].daemon
    # The run goes on: the next call works.
    assert tasks.safe_reward(tasks.ArithmeticTask(), PROBLEM, "A: 2", sample_id=43,
                             timeout_s=0.05, stats=stats) == 1.0
  finally:
    release.set()


@pytest.mark.parametrize("value", [None, "1.0", True, float("nan"), float("inf"), [1.0]])
def test_invalid_values(value, warnings):
  stats = tasks.RewardStats()
  assert tasks.safe_reward(_FnTask(lambda p, c: value), PROBLEM, "", sample_id=5,
                           stats=stats) == 0.0
  assert stats.snapshot() == tasks.RewardCounts(invalid=1)
  assert "sample 5" in warnings[0]


def test_numpy_values_accepted():
  for value in (np.float32(0.5), np.int64(1)):
    out = tasks.safe_reward(_FnTask(lambda p, c, v=value: v), PROBLEM, "", sample_id=0)
    assert isinstance(out, float) and out == float(value)


def test_stats_thread_safe_and_validated():
  stats = tasks.RewardStats()
  threads = [threading.Thread(target=lambda: [stats.record("ok") for _ in range(1000)])
             for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert stats.snapshot().ok == 4000 and stats.snapshot().total == 4000
  with pytest.raises(ValueError):
    stats.record("weird")
  with pytest.raises(ValueError):
    tasks.safe_reward(tasks.ArithmeticTask(), PROBLEM, "", sample_id=0, timeout_s=0.0)
