"""Tests of the JSONL task: parsing, malformed files (file + line number), splits, verifier."""

import json

import numpy as np
import pytest

from rlax_pipe import tasks

ROWS = [
    {"prompt": "Capital of France?", "answer": "Paris"},
    {"prompt": "2+2=?", "answer": 4, "difficulty": 1},
    {"prompt": "Tallest tower in Paris?", "answer": "The Eiffel Tower",
     "solution": "It is the Eiffel Tower.\nA: The Eiffel Tower", "extra": "ignored"},
]


def _write(path, rows, blank_lines=False):
  lines = [json.dumps(r) if not isinstance(r, str) else r for r in rows]
  sep = "\n\n  \n" if blank_lines else "\n"
  path.write_text(sep.join(lines) + "\n", encoding="utf-8")
  return path


def test_read_good_file(tmp_path):
  records = tasks.read_jsonl_problems(_write(tmp_path / "good.jsonl", ROWS, blank_lines=True))
  assert [r.prompt for r in records] == [r["prompt"] for r in ROWS]
  assert records[1].answer == "4" and records[1].difficulty == 1.0
  assert records[0].solution == "A: Paris" and records[0].difficulty == 0.0
  assert records[2].solution == ROWS[2]["solution"]


@pytest.mark.parametrize("bad_line,what", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"answer": "x"}', "missing required key 'prompt'"),
    ('{"prompt": "p"}', "missing required key 'answer'"),
    ('{"prompt": "  ", "answer": "x"}', "'prompt' must be a non-empty string"),
    ('{"prompt": 3, "answer": "x"}', "'prompt' must be a non-empty string"),
    ('{"prompt": "p", "answer": null}', "'answer' must be a string or a number"),
    ('{"prompt": "p", "answer": true}', "'answer' must be a string or a number"),
    ('{"prompt": "p", "answer": " . "}', "empty after normalization"),
    ('{"prompt": "p", "answer": "x", "solution": 5}', "'solution' must be a string"),
    ('{"prompt": "p", "answer": "x", "difficulty": "hard"}', "'difficulty' must be a finite"),
    ('{"prompt": "p", "answer": "x", "difficulty": NaN}', "'difficulty' must be a finite"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad_line, what):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n" + bad_line + "\n")
  with pytest.raises(tasks.JsonlFormatError) as info:
    tasks.JsonlTask(tasks.JsonlConfig(path=path))
  message = str(info.value)
  assert message.startswith(f"{path}:4: ")
  assert what in message


def test_invalid_utf8_and_empty_files(tmp_path):
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + b'{"prompt": "caf\xe9", "answer": "x"}\n')
  with pytest.raises(tasks.JsonlFormatError, match=r"latin1.jsonl:2: not valid UTF-8"):
    tasks.read_jsonl_problems(path)
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n  \n")
  with pytest.raises(tasks.JsonlFormatError, match="no problems"):
    tasks.read_jsonl_problems(empty)
  with pytest.raises(FileNotFoundError):
    tasks.read_jsonl_problems(tmp_path / "missing.jsonl")


def test_normalize_and_extract():
  assert tasks.normalize_answer("  The  Eiffel\tTower. ") == "the eiffel tower"
  assert tasks.normalize_answer("STRASSE") == tasks.normalize_answer("straße")  # case-fold
  assert tasks.normalize_answer("3.14.") == "3.14"
  assert tasks.extract_answer("thinking\nA: Paris.\nA: Rome") == "Paris."
  assert tasks.extract_answer("thinking...\n  Paris  \n\n") == "  Paris  "
  assert tasks.extract_answer("") == ""


def test_reward(tmp_path):
  task = tasks.JsonlTask(tasks.JsonlConfig(path=_write(tmp_path / "t.jsonl", ROWS),
                                           eval_fraction=0.0))
  by_prompt = {task.problem(i).prompt: task.problem(i) for i in range(3)}
  paris = by_prompt["Capital of France?"]
  for completion in ("A: Paris", "A:  paris. ", "Hmm.\nA: PARIS\nA: Rome", "Let me see\nParis.",
                     paris.solution):
    assert task.reward(paris, completion) == 1.0, completion
  for completion in ("A: Rome", "A: Paris, France", "Paris\nRome", "", "A:\nParis"):
    assert task.reward(paris, completion) == 0.0, completion
  for p in by_prompt.values():
    assert task.reward(p, p.solution) == 1.0
  assert task.reward(by_prompt["2+2=?"], "A: 4") == 1.0


def test_hash_split_and_stream(tmp_path):
  rows = [{"prompt": f"question {i}", "answer": str(i)} for i in range(200)]
  task = tasks.JsonlTask(tasks.JsonlConfig(path=_write(tmp_path / "t.jsonl", rows),
                                           eval_fraction=0.25))
  n_train, n_eval = task.num_problems("train"), task.num_problems("eval")
  assert n_train + n_eval == 200 and 25 <= n_eval <= 75
  train_epoch = [task.problem(i, "train") for i in range(n_train)]
  eval_epoch = [task.problem(i, "eval") for i in range(n_eval)]
  assert len({p.prompt for p in train_epoch}) == n_train  # One epoch = each problem once.
  assert not {p.prompt for p in train_epoch} & {p.prompt for p in eval_epoch}
  assert all(tasks.split_of(p.prompt, 0.25) == "eval" for p in eval_epoch)
  second = [task.problem(n_train + i, "train") for i in range(n_train)]
  assert {p.prompt for p in second} == {p.prompt for p in train_epoch}
  assert [p.prompt for p in second] != [p.prompt for p in train_epoch]  # Reshuffled.
  # Deterministic and resumable from a counter, across task instances.
  again = tasks.JsonlTask(task.config)
  assert tasks.take_problems(again, 150, 20) == tasks.take_problems(task, 150, 20)
  a = task.sample_prompts(np.random.default_rng(3), 10, "eval")
  assert a == again.sample_prompts(np.random.default_rng(3), 10, "eval")
  assert all(p.split == "eval" for p in a)


def test_eval_file_and_empty_split(tmp_path):
  train = _write(tmp_path / "train.jsonl", ROWS)
  evals = _write(tmp_path / "eval.jsonl", [{"prompt": "Held out?", "answer": "yes"}])
  task = tasks.JsonlTask(tasks.JsonlConfig(path=train, eval_path=evals))
  assert task.num_problems("train") == 3 and task.num_problems("eval") == 1
  assert task.problem(5, "eval").prompt == "Held out?"
  only_train = tasks.JsonlTask(tasks.JsonlConfig(path=train, eval_fraction=0.0))
  assert only_train.num_problems("eval") == 0
  with pytest.raises(ValueError, match="empty"):
    only_train.problem(0, "eval")
  with pytest.raises(ValueError, match="empty"):
    only_train.sample_prompts(np.random.default_rng(0), 2, "eval")
  with pytest.raises(ValueError):
    tasks.JsonlConfig(path=train, eval_fraction=2.0)
