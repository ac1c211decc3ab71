"""Tests of the built-in arithmetic task: format, determinism, splits, rewards, long tail."""

import dataclasses

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import pytest

from rlax_pipe import tasks
from rlax_pipe import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def task():
  return tasks.ArithmeticTask(tasks.ArithmeticConfig())


def test_render_golden():
  prompt, answer, solution = tasks.render([3, 5, 2, 7], ["+", "+", "+"])
  assert prompt == "Q: 3+5+2+7\n"
  assert answer == "17"
  assert solution == "3+5=8\n8+2=10\n10+7=17\nA: 17"
  assert tasks.render([4], []) == ("Q: 4\n", "4", "A: 4")
  assert tasks.render([3, 5, 1], ["-", "+"]) == ("Q: 3-5+1\n", "-1", "3-5=-2\n-2+1=-1\nA: -1")
  with pytest.raises(ValueError):
    tasks.render([1, 2], [])


def test_problem_is_well_formed_and_solution_is_correct(task):
  for p in tasks.take_problems(task, 0, 300):
    terms = [int(t) for t in p.prompt[len("Q: "):-1].split("+")]
    assert p.prompt == "Q: " + "+".join(map(str, terms)) + "\n"
    assert p.answer == str(sum(terms))
    assert p.difficulty == len(terms)
    assert 3 <= len(terms) <= 32 and all(0 <= t <= 9 for t in terms)
    assert p.solution.endswith(f"A: {p.answer}")
    assert p.solution.count("\n") == len(terms) - 1


def test_problems_deterministic_and_addressable(task):
  again = tasks.ArithmeticTask(tasks.ArithmeticConfig())
  first = tasks.take_problems(task, 0, 50)
  assert first == tasks.take_problems(again, 0, 50)
  # Resuming from a counter gives the same stream.
  assert tasks.take_problems(task, 20, 30) == first[20:]
  assert all(task.problem(p.index, p.split) == p for p in first)
  other_seed = tasks.ArithmeticTask(tasks.ArithmeticConfig(seed=1))
  assert tasks.take_problems(other_seed, 0, 50) != first


def test_sample_prompts_deterministic_given_rng(task):
  a = task.sample_prompts(np.random.default_rng(7), 20)
  b = task.sample_prompts(np.random.default_rng(7), 20)
  c = task.sample_prompts(np.random.default_rng(8), 20)
  assert a == b and a != c
  assert all(task.problem(p.index) == p for p in a)


def test_splits_disjoint(task):
  train = {p.prompt for p in tasks.take_problems(task, 0, 2000, "train")}
  evals = tasks.take_problems(task, 0, 500, "eval")
  assert all(p.split == "eval" for p in evals)
  assert not train & {p.prompt for p in evals}
  assert all(tasks.split_of(p.prompt, 0.1) == "eval" for p in evals)


def test_splits_share_difficulty_distribution(task):
  n_train = [p.difficulty for p in tasks.take_problems(task, 0, 2000, "train")]
  n_eval = [p.difficulty for p in tasks.take_problems(task, 0, 2000, "eval")]
  assert abs(np.mean(n_train) - np.mean(n_eval)) < 0.6
  assert abs(np.mean(np.equal(n_train, 3)) - np.mean(np.equal(n_eval, 3))) < 0.05


def test_reward_reference_is_one_corrupted_is_zero(task):
  for p in tasks.take_problems(task, 0, 200) + tasks.take_problems(task, 0, 50, "eval"):
    assert task.reward(p, p.solution) == 1.0
    wrong = str(int(p.answer) + 1)
    assert task.reward(p, p.solution[:p.solution.rindex("A:")] + f"A: {wrong}") == 0.0
    assert task.reward(p, p.solution.replace("A:", "B:")) == 0.0  # No marker.
    assert task.reward(p, "") == 0.0


@pytest.mark.parametrize("completion,expected", [
    ("A: 17", 1.0), ("A:17", 1.0), ("A:  17  ", 1.0), ("junk\nA: 17\nmore junk", 1.0),
    ("A: 17\nA: 18", 1.0), ("A: 18\nA: 17", 0.0), ("A: 017", 0.0), ("A: 17.", 0.0),
    ("A: +17", 0.0), ("A: 1 7", 0.0), ("A: 17 apples", 0.0), ("17", 0.0), ("A:\n17", 0.0),
    ("The DATA: 5 rows\nA: 17", 1.0), ("Launches by NASA: 17", 0.0), ("xA: 17", 0.0),
])
def test_reward_format_rules(task, completion, expected):
  p = tasks.Problem(index=0, split="train", prompt="Q: 10+7\n", answer="17",
                    solution="10+7=17\nA: 17", difficulty=2.0)
  assert task.reward(p, completion) == expected


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_reward_total_on_any_text(task, completion):
  assert task.reward(task.problem(0), completion) in (0.0, 1.0)


def test_subtraction_config():
  task = tasks.ArithmeticTask(tasks.ArithmeticConfig(operators="+-", max_operand=20))
  problems = tasks.take_problems(task, 0, 300)
  assert any("-" in p.prompt for p in problems)
  assert any(p.answer.startswith("-") for p in problems)
  for p in problems:
    assert str(eval(p.prompt[3:-1])) == p.answer  # pylint: disable=eval-used
    assert task.reward(p, p.solution) == 1.0


def test_num_terms_distribution_is_heavy_tailed_and_bounded():
  cfg = tasks.ArithmeticConfig()
  rng = np.random.default_rng(0)
  n = np.array([tasks.draw_num_terms(rng, cfg) for _ in range(20000)])
  assert n.min() == cfg.min_terms and n.max() == cfg.max_terms
  p50, p99 = np.percentile(n, [50, 99])
  assert p99 >= 5 * p50
  narrow = dataclasses.replace(cfg, min_terms=4, max_terms=6)
  m = {tasks.draw_num_terms(rng, narrow) for _ in range(2000)}
  assert m == {4, 5, 6}


def test_length_stats_long_tailed(task):
  stats = tasks.length_stats(task, np.random.default_rng(0), 4000,
                             tokenizer_lib.default_tokenizer())
  assert stats.n == 4000
  assert stats.p50 <= stats.p90 <= stats.p99 <= stats.max
  assert stats.p99 / stats.p50 >= 3.0
  assert stats.max + stats.prompt_max <= 512  # Fits the default ModelConfig.max_seq_len.


@pytest.mark.parametrize("kwargs", [
    dict(min_terms=0), dict(min_terms=5, max_terms=4), dict(tail_index=0.0), dict(scale=-1.0),
    dict(max_operand=-1), dict(operators=""), dict(operators="*"), dict(eval_fraction=0.0),
    dict(eval_fraction=1.0), dict(seed=-1),
])
def test_config_validation(kwargs):
  with pytest.raises(ValueError):
    tasks.ArithmeticConfig(**kwargs)


def test_bad_index_and_split(task):
  with pytest.raises(ValueError):
    task.problem(-1)
  with pytest.raises(ValueError):
    task.problem(0, "test")
  assert task.num_problems("train") is None


def test_tiny_prompt_space():
  # One term of 0..2: three prompts; whichever split is empty must fail loudly, not loop.
  task = tasks.ArithmeticTask(tasks.ArithmeticConfig(min_terms=1, max_terms=1, max_operand=2))
  splits = {tasks.split_of(f"Q: {t}\n", 0.1) for t in range(3)}
  for split in ("train", "eval"):
    if split in splits:
      assert task.problem(0, split).split == split
    else:
      with pytest.raises(RuntimeError, match="too small"):
        task.problem(0, split)
