"""Reading the answer the model means (issue #27 items 5 and 11), as properties over families.

- markers that reappear later (markdown headings of the GSM8K marker's level) do not move the
  answer; a marker glued to the end of another token ("Q&A:") is no marker;
- math delimiters around the answer (a box, $...$, \\(...\\), \\[...\\], nested) never hide it from
  the numeric and exact graders; a reference whose box has no braces is read;
- a tentative answer inside the reasoning block is never read: only the text after it.
"""

import json
import string

from hypothesis import given, settings, strategies as st
import pytest

from rlax_pipe import tasks
from rlax_pipe.tasks import answers
from rlax_pipe.tasks import dataset_file

SETTINGS = settings(max_examples=60, deadline=None)
THINK = ("<think>", "</think>")

numbers = st.one_of(
    st.integers(-10**6, 10**6).map(str),
    st.decimals(-1000, 1000, places=2, allow_nan=False, allow_infinity=False).map(str),
    st.tuples(st.integers(1, 99), st.integers(1, 99)).map(lambda t: f"{t[0]}/{t[1]}"))
words = st.text(string.ascii_letters, min_size=1, max_size=8)
# Heading text as models write it: words, possibly a step number, never a bare number.
headings = st.lists(words, min_size=1, max_size=4).flatmap(
    lambda ws: st.sampled_from([" ".join(ws), f"Step {len(ws)}: " + " ".join(ws),
                                " ".join(ws) + f" {len(ws)}"]))
prose = st.text(string.ascii_letters + " ,=+", max_size=30)
BRACED = [("\\boxed{", "}"), ("\\fbox{", "}"), ("\\text{", "}")]
MATH_MODE = [("$", "$"), ("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]")]
# As LaTeX allows: braced wrappers nest freely, one math-mode pair at most (inside or outside).
wrappings = st.tuples(st.lists(st.sampled_from(BRACED), max_size=2),
                      st.sampled_from([None] + MATH_MODE),
                      st.lists(st.sampled_from(BRACED), max_size=1))


def _wrap(answer, layers):
  inner, math_mode, outer = layers
  for left, right in inner + ([math_mode] if math_mode else []) + outer:
    answer = f"{left}{answer}{right}"
  return answer


# ---- markers that reappear; markers after punctuation -----------------------------------------
@SETTINGS
@given(answer=numbers, before=st.lists(headings, max_size=3), after=st.lists(headings, max_size=3),
       body=prose)
def test_gsm8k_headings_before_or_after_the_answer_are_not_the_answer(answer, before, after,
                                                                      body):
  text = "".join(f"#### {h}\n{body}\n" for h in before) + f"so\n#### {answer}\n"
  text += "".join(f"\n#### {h}\n{body}\n" for h in after)
  assert tasks.extract_final_answer(text, "gsm8k") == answer
  assert tasks.extract_final_answer(text, "auto") == answer
  assert tasks.answers_match(tasks.extract_final_answer(text, "gsm8k"), answer)


@SETTINGS
@given(answer=numbers, word=words, glue=st.sampled_from(list("&/-.:;,!?=+#@%^~|\\")),
       level=st.integers(1, 6), body=prose)
def test_marker_glued_after_punctuation_in_a_heading_is_not_the_answer(answer, word, glue, level,
                                                                       body):
  if (word, glue) == ("A", ":"):  # "A:A: setup" starts with a real marker
    return
  text = f"{'#' * level} {word}{glue}A: setup\n{body}\nA: {answer}\n"
  assert tasks.extract_marked_answer(text) == answer
  assert tasks.extract_final_answer(text, "auto") == answer
  assert tasks.extract_answer(text) == answer  # the JSONL task's reader


@pytest.mark.parametrize("text,expected", [
    ("### Q&A: setup\nA: 7", "7"), ("Q/A: x\nA: 7", "7"), ("**A:** 7", "7"), ("A: **7**", "7"),
    ("> A: 7", "7"), ("(A: 5)", "5)"), ("so A:12", "12"), ("_A: 1", None), ("Q&A: 3", None),
])
def test_marker_boundaries(text, expected):
  assert tasks.extract_marked_answer(text) == expected


def test_issue_inputs_through_the_tasks(tmp_path):
  arithmetic = tasks.ArithmeticTask()
  problem = tasks.Problem(index=0, split="train", prompt="Q\n", answer="7", solution="")
  assert arithmetic.reward(problem, "### Q&A: check each line\n3+4=7\nA: 7") == 1.0
  path = tmp_path / "gsm8k.jsonl"
  path.write_text(json.dumps({"question": "q", "answer": "so\n#### 72"}) + "\n")
  task = tasks.DatasetFileTask(tasks.DatasetFileConfig(path=path, prompt_field="question",
                                                       eval_fraction=0.0, answer_format="gsm8k"))
  p = task.problem(0)
  assert task.reward(p, "#### Work\n48/2=24\n#### 72\n\n#### Check\n24+48=72 holds") == 1.0
  assert task.reward(p, "#### 71\n\n#### Summary") == 0.0


# ---- delimiters around the answer; unbraced boxes ------------------------------------------------
@SETTINGS
@given(answer=numbers, layers=wrappings, grader=st.sampled_from(["numeric", "exact"]),
       fmt=st.sampled_from(["answer_tag", "answer_line", "marker", "gsm8k", "auto"]))
def test_delimiters_around_the_answer_never_hide_it(answer, layers, grader, fmt):
  wrapped = _wrap(answer, layers)
  text = {"answer_tag": f"<answer>{wrapped}</answer>", "answer_line": f"Answer: {wrapped}",
          "marker": f"A: {wrapped}", "gsm8k": f"#### {wrapped}",
          "auto": f"<answer> {wrapped} </answer>"}[fmt]
  got = tasks.extract_final_answer(text, fmt)
  assert got == answer
  assert tasks.answers_match(got, answer, grader)
  assert tasks.answers_match(wrapped, answer, grader)  # a wrapped reference or answer alike


@pytest.mark.parametrize("text,kept", [
    ("$5", "$5"), ("$x$ and $y$", "$x$ and $y$"), ("\\(a\\) or \\(b\\)", "\\(a\\) or \\(b\\)"),
    ("\\boxed{1}+\\boxed{2}", "\\boxed{1}+\\boxed{2}"), ("72.", "72."), (" 3 ", "3"),
])
def test_text_not_wholly_enclosed_is_kept(text, kept):
  assert answers.strip_math_delimiters(text) == kept


@SETTINGS
@given(answer=st.integers(0, 10**6).map(str), space=st.sampled_from(["", " ", "  "]),
       around=st.sampled_from(["{}", "${}$", "${}$.", "\\({}\\)", "\\[{}\\]", "{}.", "{}\nmore"]),
       lead=prose)
def test_reference_with_an_unbraced_box_is_read(answer, space, around, lead):
  if not space and not answer[0].isdigit():
    return
  solution = f"{lead}\n" + around.format(f"\\boxed{space}{answer}")
  assert dataset_file.read_reference(solution, "auto") == (answer, True)
  assert dataset_file.read_reference(solution, "boxed") == (answer, True)
  assert tasks.extract_final_answer(solution, "boxed") == answer


def test_unbraced_box_reference_can_be_scored_correct(tmp_path):
  path = tmp_path / "math.jsonl"
  rows = [{"problem": "1+4?", "solution": "So the answer is $\\boxed 5$."},
          {"problem": "2+4?", "solution": "Hence \\boxed6"}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  task = tasks.DatasetFileTask(tasks.DatasetFileConfig(
      path=path, prompt_field="problem", answer_field="solution", eval_fraction=0.0))
  by_answer = {task.problem(i).answer: task.problem(i) for i in range(2)}
  assert sorted(by_answer) == ["5", "6"]
  assert task.reward(by_answer["5"], "\\boxed{5}") == 1.0
  assert task.reward(by_answer["6"], "<answer>$6$</answer>") == 1.0
  assert tasks.extract_final_answer("\\boxedfoo 5", "boxed") is None  # another macro


# ---- reasoning blocks ------------------------------------------------------------------------------
@SETTINGS
@given(final=numbers, tentative=numbers, fmt=st.sampled_from(["marker", "auto", "answer_line"]),
       before=prose, after=prose)
def test_tentative_answer_in_the_reasoning_block_is_never_read(final, tentative, fmt, before,
                                                               after):
  stated = tasks.format_answer(final, fmt)
  guess = tasks.format_answer(tentative, fmt)
  text = f"<think>{before}\n{guess}\n{after}</think>\n{stated}"
  graded = answers.text_after_reasoning(text, THINK)
  assert tasks.extract_final_answer(graded, fmt) == final
  # An unclosed block has no final answer, whatever it holds.
  assert answers.text_after_reasoning(f"<think>{before}\n{stated}", THINK) is None
  # A generation prompt that opened the block: the completion starts inside it.
  inside = f"{before}\n{guess}</think>\n{stated}"
  assert tasks.extract_final_answer(answers.text_after_reasoning(inside, THINK, True),
                                    fmt) == final
  assert answers.text_after_reasoning(f"{before}\n{stated}", THINK, True) is None
  # Without markers the text is graded as is.
  assert answers.text_after_reasoning(stated, THINK) == stated
  assert answers.text_after_reasoning(text, None) == text
