"""Dataset files people have (JSONL / JSON / Parquet / CSV), read locally, graded by equivalence."""

import json
import socket

import numpy as np
import pytest

from rlax_pipe import tasks

GSM8K_ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\n48+24 = <<48+24=72>>72\n#### 72"},
    {"question": "Weng earns $12 an hour. She did 50 minutes of babysitting. How much?",
     "answer": "12/60 = $0.2 per minute.\n0.2 x 50 = $<<0.2*50=10>>10\n#### 10"},
]


@pytest.fixture
def no_network(monkeypatch):
  """Any attempt to open a connection fails: reading must stay local (no hub access)."""
  def refuse(*args, **kwargs):
    raise AssertionError("network access attempted")
  monkeypatch.setattr(socket.socket, "connect", refuse)
  monkeypatch.setattr(socket, "create_connection", refuse)


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return path


def test_gsm8k_jsonl_with_its_own_columns(tmp_path, no_network):
  cfg = tasks.DatasetFileConfig(path=_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS),
                                prompt_field="question", eval_fraction=0.0,
                                prompt_template="{question}\nGive the final answer after '####'.\n")
  task = tasks.make_task("dataset_file", cfg)
  problems = {task.problem(i).answer: task.problem(i) for i in range(2)}
  p = problems["72"]
  assert p.prompt.startswith("Natalia") and p.prompt.endswith("after '####'.\n")
  assert p.solution == GSM8K_ROWS[0]["answer"] and task.reward(p, p.solution) == 1.0
  for completion, reward in [("so 72 clips\n#### 72", 1.0), ("#### 72.0", 1.0),
                             ("#### 71", 0.0), ("\\boxed{72}", 1.0), ("Answer: 72", 1.0),
                             ("72", 0.0), ("", 0.0)]:
    assert task.reward(p, completion) == reward, completion
  assert task.reward(problems["10"], "#### $10") == 1.0


def test_parquet_math_style_with_math_verify(tmp_path, no_network):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  path = tmp_path / "math.parquet"
  pq.write_table(pa.table({
      "problem": ["What is 1/2 as a fraction?", "Expand (x+1)^2 - 2x.", "What is 6*7?"],
      "solution": ["It is $\\boxed{\\frac{1}{2}}$.", "We get \\boxed{x^2+1}.", "42"],
      "level": [1, 2, 1]}), path)
  cfg = tasks.DatasetFileConfig(path=path, prompt_field="problem", answer_field="solution",
                                answer_format="boxed", grader="math_verify", eval_fraction=0.0)
  task = tasks.DatasetFileTask(cfg)
  by_answer = {task.problem(i).answer: task.problem(i) for i in range(3)}
  assert set(by_answer) == {"\\frac{1}{2}", "x^2+1", "42"}
  half, poly, plain = by_answer["\\frac{1}{2}"], by_answer["x^2+1"], by_answer["42"]
  assert task.reward(half, "so \\boxed{0.5}") == 1.0
  assert task.reward(half, "so \\boxed{\\frac{2}{4}}") == 1.0
  assert task.reward(half, "so \\boxed{0.6}") == 0.0
  assert task.reward(poly, "\\boxed{1 + x^2}") == 1.0
  assert plain.solution == "\\boxed{42}" and task.reward(plain, plain.solution) == 1.0


def test_csv_keeps_answers_as_written(tmp_path, no_network):
  path = tmp_path / "qa.csv"
  path.write_text('prompt,answer,notes\n"Price, in $?",2.50,x\nAgent?,007,\nMissing?,NA,\n',
                  encoding="utf-8")
  task = tasks.DatasetFileTask(tasks.DatasetFileConfig(path=path, eval_fraction=0.0))
  by_prompt = {task.problem(i).prompt: task.problem(i) for i in range(3)}
  assert [by_prompt[k].answer for k in ("Price, in $?", "Agent?", "Missing?")] == [
      "2.50", "007", "NA"]
  assert task.reward(by_prompt["Price, in $?"], "A: 2.5") == 1.0
  assert task.reward(by_prompt["Agent?"], "A: 7") == 1.0    # numbers as numbers
  assert task.reward(by_prompt["Missing?"], "A: na") == 1.0  # text: normalized match
  assert by_prompt["Agent?"].solution == "A: 007"


def test_json_array_eval_file_and_stream(tmp_path):
  rows = [{"prompt": f"question {i}", "answer": i} for i in range(60)]
  train = tmp_path / "train.json"
  train.write_text(json.dumps(rows))
  evals = tmp_path / "eval.jsonl"
  evals.write_text('{"prompt": "held out", "answer": 1.50}\n')
  task = tasks.DatasetFileTask(tasks.DatasetFileConfig(path=train, eval_path=evals))
  assert task.num_problems("train") == 60 and task.num_problems("eval") == 1
  assert task.problem(3, "eval").answer == "1.50"
  again = tasks.DatasetFileTask(task.config)
  assert tasks.take_problems(again, 50, 20) == tasks.take_problems(task, 50, 20)
  a = task.sample_prompts(np.random.default_rng(0), 5)
  assert a == again.sample_prompts(np.random.default_rng(0), 5)
  split = tasks.DatasetFileTask(tasks.DatasetFileConfig(path=train, eval_fraction=0.3))
  train_prompts = {split.problem(i).prompt for i in range(split.num_problems("train"))}
  eval_prompts = {split.problem(i, "eval").prompt for i in range(split.num_problems("eval"))}
  assert not train_prompts & eval_prompts and len(train_prompts | eval_prompts) == 60


@pytest.mark.parametrize("content,name,kwargs,what", [
    ('{"q": "x", "answer": "1"}\n', "a.jsonl", {}, "no column 'prompt'"),
    ('{"prompt": "x", "answer": ""}\n', "a.jsonl", {}, "empty or non-text answer"),
    ('{"prompt": "x", "answer": null}\n', "a.jsonl", {}, "empty or non-text answer"),
    ('{"prompt": " ", "answer": "1"}\n', "a.jsonl", {}, "empty prompt"),
    ('{"prompt": "x", "answer": "1"}\n', "a.jsonl", {"reference_format": "gsm8k"},
     "no gsm8k answer"),
    ('{"prompt": "x", "answer": "1"}\n', "a.jsonl", {"prompt_template": "{question}"},
     "not a column"),
    ('{"prompt": "x", "answer": "1"\n', "a.jsonl", {}, "invalid JSON"),
    ('[1, 2]', "a.json", {}, "must be a JSON object"),
    ("prompt,answer\n", "a.txt", {}, "cannot tell the format"),
])
def test_bad_files_name_the_file_row_and_fix(tmp_path, content, name, kwargs, what):
  path = tmp_path / name
  path.write_text(content, encoding="utf-8")
  with pytest.raises(tasks.DatasetFileError, match=what) as info:
    tasks.DatasetFileTask(tasks.DatasetFileConfig(path=path, **kwargs))
  assert str(path) in str(info.value)


def test_config_and_registry_errors(tmp_path):
  with pytest.raises(FileNotFoundError):
    tasks.DatasetFileTask(tasks.DatasetFileConfig(path=tmp_path / "missing.csv"))
  for bad in ({"file_format": "xlsx"}, {"grader": "fuzzy"}, {"answer_format": "latex"},
              {"eval_fraction": 1.5}, {"prompt_template": "no field"}):
    with pytest.raises(ValueError):
      tasks.DatasetFileConfig(path="x.jsonl", **bad)
  with pytest.raises(ValueError, match="needs a DatasetFileConfig"):
    tasks.make_task("dataset_file")
