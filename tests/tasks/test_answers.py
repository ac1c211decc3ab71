"""Reading the answer: markers only at a word boundary, references as written, numbers as numbers.

The inputs of issue #14 item 5 are here with their right values.
"""

import fractions
import json

import pytest

from rlax_pipe import tasks
from rlax_pipe.tasks import jsonl


def _problem(answer):
  return tasks.Problem(index=0, split="train", prompt="Q\n", answer=answer, solution="")


@pytest.mark.parametrize("text,expected", [
    ("The DATA: 5 rows\nA: 7", "7"),        # issue: "DATA:" is not the marker
    ("Launches by NASA: 7", None),          # issue: no answer at all
    ("A: 3\nA: 4", "3"),                    # first marker counts
    ("so A:12", "12"), ("(A: 5)", "5)"), ("xA: 1", None), ("_A: 1", None), ("9A: 1", None),
])
def test_marker_only_at_a_word_boundary(text, expected):
  assert tasks.extract_marked_answer(text) == expected


def test_issue_inputs_through_the_tasks(tmp_path):
  arithmetic = tasks.ArithmeticTask()
  assert arithmetic.reward(_problem("7"), "The DATA: 5 rows\nA: 7") == 1.0
  assert arithmetic.reward(_problem("7"), "Launches by NASA: 7") == 0.0
  path = tmp_path / "qa.jsonl"
  path.write_text("\n".join([
      '{"prompt": "p1", "answer": 2.50}', '{"prompt": "p2", "answer": 72.0}',
      '{"prompt": "p3", "answer": 1e3}', '{"prompt": "p4", "answer": "7"}',
      '{"prompt": "p5", "answer": 12345678901234567890}']) + "\n")
  task = tasks.JsonlTask(tasks.JsonlConfig(path=path, eval_fraction=0.0))
  by_prompt = {task.problem(i).prompt: task.problem(i) for i in range(5)}
  # The reference is kept as written (never rewritten through float) ...
  assert [by_prompt[p].answer for p in ("p1", "p2", "p3", "p5")] == [
      "2.50", "72.0", "1e3", "12345678901234567890"]
  # ... and numeric answers are compared as numbers.
  assert task.reward(by_prompt["p1"], "A: 2.50") == 1.0
  assert task.reward(by_prompt["p1"], "A: 2.5") == 1.0
  assert task.reward(by_prompt["p2"], "A: 72") == 1.0
  assert task.reward(by_prompt["p3"], "A: 1000") == 1.0
  assert task.reward(by_prompt["p5"], "A: 12345678901234567890") == 1.0
  assert task.reward(by_prompt["p5"], "A: 12345678901234567891") == 0.0
  assert task.reward(by_prompt["p4"], "The DATA: 5 rows\nA: 7") == 1.0
  assert task.reward(by_prompt["p4"], "Launches by NASA: 7") == 0.0
  exact = tasks.JsonlTask(tasks.JsonlConfig(path=path, eval_fraction=0.0, grader="exact"))
  assert exact.reward(by_prompt["p2"], "A: 72") == 0.0  # text rule when asked for it


@pytest.mark.parametrize("text,value", [
    ("2.50", fractions.Fraction(5, 2)), ("72.0", 72), ("1e3", 1000), ("1,000", 1000),
    ("-3/4", fractions.Fraction(-3, 4)), (".5", fractions.Fraction(1, 2)), ("$18", 18),
    ("18.", 18), (" 7 ", 7), ("+7", 7), ("1.5E-2", fractions.Fraction(3, 200)),
    ("5 rows", None), ("50%", None), ("nan", None), ("1_000", None), ("1,00", None),
    ("e3", None), ("0x10", None), ("1/0", None), ("", None), ("Paris", None),
])
def test_parse_number(text, value):
  assert tasks.parse_number(text) == value


@pytest.mark.parametrize("got,reference,grader,match", [
    ("2.50", "2.50", "numeric", True), ("72", "72.0", "numeric", True),
    ("1000", "1e3", "numeric", True), ("0.75", "3/4", "numeric", True),
    ("0.333", "1/3", "numeric", False), ("Paris.", "paris", "numeric", True),
    ("72", "72.0", "exact", False), (None, "7", "numeric", False),
    ("\\frac{1}{2}", "0.5", "numeric", False), ("\\frac{1}{2}", "0.5", "math_verify", True),
    ("1+x^2", "x^2+1", "math_verify", True), ("\\sqrt{2}", "1.41", "math_verify", False),
    ("1000", "1e3", "math_verify", True),  # numbers first: math-verify reads "1e3" as 1
])
def test_answers_match(got, reference, grader, match):
  assert tasks.answers_match(got, reference, grader) is match


@pytest.mark.parametrize("text,fmt,expected", [
    ("so 48/2 = 24\n#### 72", "gsm8k", "72"), ("#### 1\nthen\n#### 2 ", "gsm8k", "2"),
    ("##### 3", "gsm8k", None),
    ("\\boxed{\\frac{1}{\\sqrt{2}}} done", "boxed", "\\frac{1}{\\sqrt{2}}"),
    ("\\boxed{1} then \\fbox{ 2 }", "boxed", "2"), ("\\boxed{unclosed", "boxed", None),
    ("work\nAnswer: 12\n", "answer_line", "12"), ("**Final Answer:** 5", "answer_line", "5"),
    ("The answer: 3", "answer_line", None), ("<answer> 9 </answer>", "answer_tag", "9"),
    ("\\boxed{4}\n#### 5", "auto", "4"), ("#### 5\nAnswer: 6", "auto", "5"),
    ("Answer: 6\nA: 7", "auto", "6"), ("A: 7", "auto", "7"), ("nothing", "auto", None),
])
def test_answer_formats(text, fmt, expected):
  assert tasks.extract_final_answer(text, fmt) == expected


@pytest.mark.parametrize("fmt", tasks.ANSWER_FORMATS)
def test_format_answer_reads_back(fmt):
  assert tasks.extract_final_answer(tasks.format_answer("3/4", fmt), fmt) == "3/4"


def test_bad_names():
  with pytest.raises(ValueError, match="answer format"):
    tasks.extract_final_answer("x", "latex")
  with pytest.raises(ValueError, match="grader"):
    tasks.answers_match("1", "1", "fuzzy")
  with pytest.raises(ValueError, match="grader"):
    tasks.JsonlConfig(path="x.jsonl", grader="fuzzy")


def test_json_numbers_keep_their_text():
  assert str(json.loads('{"a": 2.50}')["a"]) == "2.5"   # what a plain json.loads gives
  assert jsonl.load_json_keeping_numbers('{"a": 2.50, "b": [1e3]}') == {"a": "2.50",
                                                                         "b": ["1e3"]}
