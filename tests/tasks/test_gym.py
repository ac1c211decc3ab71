"""reasoning-gym datasets as tasks (optional extra "gym"); skipped cleanly without it."""

import re

import numpy as np
import pytest

from rlax_pipe import tasks

reasoning_gym = pytest.importorskip("reasoning_gym")

CONFIGS = [
    tasks.ReasoningGymConfig("chain_sum", {"min_terms": 2, "max_terms": 3, "max_digits": 2},
                             seed=3),
    tasks.ReasoningGymConfig("basic_arithmetic", {"min_terms": 2, "max_terms": 3}, seed=5,
                             answer_format="marker"),
]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c.dataset)
def task(request):
  return tasks.make_task("reasoning_gym", request.param)


def test_problems_are_seeded_addressable_and_split(task):
  again = tasks.ReasoningGymTask(task.config)
  first = tasks.take_problems(task, 0, 30)
  assert first == tasks.take_problems(again, 0, 30)                   # pure function of config
  assert task.problem(17) == first[17]
  evals = tasks.take_problems(task, 0, 30, "eval")
  assert not {p.prompt for p in first} & {p.prompt for p in evals}   # disjoint splits
  assert all(tasks.split_of(p.prompt[:-1], task.config.eval_fraction) == "eval" for p in evals)
  assert len({p.prompt for p in first}) > 20
  other_seed = tasks.ReasoningGymTask(
      tasks.ReasoningGymConfig(task.config.dataset, task.config.dataset_config, seed=99,
                               answer_format=task.config.answer_format))
  assert [p.prompt for p in tasks.take_problems(other_seed, 0, 5)] != [
      p.prompt for p in first[:5]]
  drawn = task.sample_prompts(np.random.default_rng(0), 4)
  assert drawn == again.sample_prompts(np.random.default_rng(0), 4)


def test_config_reaches_the_generator(task):
  for p in tasks.take_problems(task, 0, 20):
    numbers = re.findall(r"\d+", p.prompt)
    assert 2 <= len(numbers) <= 3, p.prompt


def test_graded_by_the_datasets_own_scoring(task):
  dataset = reasoning_gym.create_dataset(task.config.dataset, seed=task.config.seed,
                                         size=task.config.size,
                                         **dict(task.config.dataset_config))
  for p in tasks.take_problems(task, 0, 10):
    assert task.reward(p, "Working...\n" + p.solution) == 1.0
    wrong = str(int(p.answer) + 1)
    assert task.reward(p, tasks.format_answer(wrong, task.config.answer_format)) == 0.0
    assert task.reward(p, "no answer given") == 0.0
    # The score is the dataset's own: the same entry scored directly agrees.
    entry = next(dataset[k] for k in range(2 * p.index * 256, 2 * p.index * 256 + 256)
                 if tasks.split_of(dataset[k]["question"], task.config.eval_fraction) == "train")
    assert entry["answer"] == p.answer
    assert task.reward(p, tasks.format_answer(p.answer, task.config.answer_format)) == (
        dataset.score_answer(p.answer, entry))


def test_runs_in_verifier_processes(task):
  problems = tasks.take_problems(task, 0, 3)
  with tasks.VerifierPool(task, timeout_s=30.0) as pool:
    verdicts = pool.grade([(p, p.solution) for p in problems])
  assert [v.reward for v in verdicts] == [1.0, 1.0, 1.0]


def test_bad_names_and_fields():
  with pytest.raises(ValueError, match="did you mean.*chain_sum"):
    tasks.ReasoningGymTask(tasks.ReasoningGymConfig("chain_sums"))
  with pytest.raises(ValueError, match="rejected dataset_config"):
    tasks.ReasoningGymTask(tasks.ReasoningGymConfig("chain_sum", {"bogus": 1}))
  for bad in ({"eval_fraction": 0.0}, {"prompt_template": "no question"},
              {"answer_format": "latex"}, {"dataset_config": [1, 2]}):
    with pytest.raises(ValueError):
      tasks.ReasoningGymConfig("chain_sum", **bad)
