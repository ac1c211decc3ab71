"""Reading a final answer out of text, and deciding whether two answers are the same.

Answer formats (`extract_answer(text, fmt)`), each matched only where a marker starts a token, so
that a marker inside a word or after other punctuation never counts ("Launches by NASA: 7" and
the heading "### Q&A: setup" hold no "A:" answer):

- "marker": the text after the FIRST "A:" that starts a whitespace-separated token (only opening
  brackets, quotes, "*" or ">" may come before it: "(A: 5)", "**A:** 5") up to the end of its
  line, without surrounding "*" emphasis; the convention of the built-in tasks
  (`base.extract_marked_answer`).
- "gsm8k": the text after "####" (not part of a longer run of "#") up to the end of its line, of
  the LAST such line that states a number (`parse_number`), else of the last one: a markdown
  heading of that level ("#### Step 2") written after the answer is not the answer.
- "boxed": the content of the LAST `\\boxed{...}` (or `\\fbox{...}`), braces balanced (MATH);
  without braces (`\\boxed 5`, `\\boxed5`, which LaTeX and some MATH solutions write) the text
  after it up to the closing "$", "\\)" / "\\]" or the end of the line.
- "answer_line": the LAST line of the form "Answer: ..." (also "Final answer:", "**Answer:**"),
  case-insensitive, at the start of a line; with nothing after the colon, the next non-empty
  line.
- "answer_tag": the content of the LAST `<answer>...</answer>` (reasoning-gym's and DeepSeek-R1's
  convention), stripped.
- "auto": the first of boxed, gsm8k (a "####" line stating a number), answer_tag, answer_line,
  marker, gsm8k (any "####" line: a heading is the last resort) that finds an answer.

Whatever the format, math delimiters around the whole answer are removed (`strip_math_delimiters`:
`\\boxed{...}`, `\\fbox{...}`, `$...$`, `$$...$$`, `\\(...\\)`, `\\[...\\]`, `\\text{...}`,
nested ones too), so `<answer>\\boxed{72}</answer>` and "Answer: $72$" read as "72".

Reasoning: the model's reasoning block (`<think>...</think>`, markers from the tokenizer's chat
template) is not part of the answer: `text_after_reasoning` keeps the text after the block, and
an unclosed block has no final answer. The pipeline applies it before any task's `reward`
(`rlax_pipe.grading.completion_for_grading`).

Equivalence (`answers_match(got, reference, grader)`):

Both sides lose their math delimiters first (`strip_math_delimiters`), then:

- "exact": equal after `normalize_text` (strip, collapse whitespace, case-fold, drop trailing
  periods).
- "numeric" (default): when both sides read as numbers (`parse_number`), equal as exact rationals
  (so "2.50" == "2.5", "72.0" == "72", "1e3" == "1000", "1,000" == "1000", "3/4" == "0.75");
  otherwise as "exact".
- "math_verify": numbers as in "numeric"; otherwise the math-verify library decides (symbolic
  equivalence of LaTeX / expressions, e.g. "\\frac{1}{2}" == "0.5", "x^2+1" == "1+x^2"). It is an
  optional dependency (`pip install -e ".[data]"`) and uses `signal.alarm` for its own timeouts,
  so it needs the main thread of its process: verifiers run in worker processes
  (`tasks.verifier_pool`), where that holds.
"""

from __future__ import annotations

import fractions
import re

ANSWER_FORMATS: tuple[str, ...] = ("marker", "gsm8k", "boxed", "answer_line", "answer_tag", "auto")
GRADERS: tuple[str, ...] = ("exact", "numeric", "math_verify")
ANSWER_MARKER = "A:"

_WHITESPACE = re.compile(r"\s+")
_GSM8K = re.compile(r"(?<![\w#])####(?!#)[ \t]*([^\n]*)")
_ANSWER_LINE = re.compile(r"^[ \t*_]*(?:final[ \t]+)?answer[ \t*_]*:[ \t*_]*(.*?)[ \t*_]*$",
                          re.IGNORECASE | re.MULTILINE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])[ \t]*")
# Ends of an unbraced box's argument: the closing math delimiter or the end of the line.
_UNBRACED_END = re.compile(r"\$|\\\)|\\\]|\n")
_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_BRACED_WRAPPER = re.compile(r"\\(?:boxed|fbox|text|textbf|mathrm)[ \t]*\{")
# A marker counts where it starts a whitespace-separated token, after opening brackets, quotes,
# "*" emphasis or a ">" quote at most.
_MARKER_PREFIX = r"(?<!\S)[(\[{\"'`*>]*"
# A plain number: sign, digits (optionally with thousands commas), decimals, exponent; or a/b.
_NUMBER = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d+)?")
_RATIO = re.compile(r"[+-]?\d+/\d+")


def _marker_pattern(marker: str) -> re.Pattern:
  return re.compile(_MARKER_PREFIX + re.escape(marker))


def extract_marked_answer(text: str, marker: str = ANSWER_MARKER) -> str | None:
  """Text after the first `marker` that starts a token, up to the end of its line; stripped of
  whitespace and "*" emphasis (module docstring).

  Example: extract_marked_answer("The DATA: 5 rows\\nA: 7") == "7";
  extract_marked_answer("Launches by NASA: 7") is None;
  extract_marked_answer("### Q&A: setup\\n**A:** 7") == "7".

  Returns:
    The answer text, or None when no marker starts a token.
  """
  match = _marker_pattern(marker).search(text)
  if match is None:
    return None
  return text[match.end():].split("\n", 1)[0].strip().strip("*").strip()


def extract_gsm8k(text: str) -> str | None:
  """Text after "####" (not part of a longer run of "#") to the end of its line, of the last such
  line stating a number, else of the last one (module docstring)."""
  matches = [m.strip() for m in _GSM8K.findall(text)]
  return _extract_gsm8k_number(text, matches) or (matches[-1] if matches else None)


def _extract_gsm8k_number(text: str, matches: list[str] | None = None) -> str | None:
  """The last "####" line's text that states a number, or None."""
  if matches is None:
    matches = [m.strip() for m in _GSM8K.findall(text)]
  numeric = [m for m in matches if parse_number(strip_math_delimiters(m)) is not None]
  return numeric[-1] if numeric else None


def _balanced_end(text: str, start: int) -> int | None:
  """Index of the "}" closing the "{" just before `start`, or None when it is never closed."""
  depth = 1
  for k in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[k], 0)
    if depth == 0:
      return k
  return None


def extract_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` / `\\fbox{...}` with balanced braces (None if unclosed);
  of an unbraced `\\boxed 5` / `\\boxed5`, the text after it up to the closing math delimiter
  or the end of its line (trailing period dropped)."""
  boxes = list(_BOX.finditer(text))
  if not boxes:
    return None
  start = boxes[-1].end()
  if text.startswith("{", start):
    end = _balanced_end(text, start + 1)
    return None if end is None else text[start + 1:end].strip()
  stop = _UNBRACED_END.search(text, start)
  found = text[start:stop.start() if stop else len(text)].strip().rstrip(".").strip()
  return found or None


def strip_math_delimiters(text: str) -> str:
  """`text` stripped, without math delimiters or a box around the WHOLE of it, repeatedly.

  Removed: `\\boxed{...}`, `\\fbox{...}`, `\\text{...}`, `\\textbf{...}`, `\\mathrm{...}`
  (balanced braces), `$$...$$`, `$...$`, `\\(...\\)`, `\\[...\\]`, and one sentence period
  after a closing delimiter. Text that is not wholly enclosed ("$5", "$x$ and $y$") is
  returned stripped, otherwise unchanged.

  Example: strip_math_delimiters("$\\boxed{72}$.") == "72".
  """
  s = text.strip()
  while True:
    inner = _unwrap_once(s[:-1].rstrip() if s.endswith(".") else s)
    if inner is None and s.endswith("."):
      inner = _unwrap_once(s)
    if inner is None:
      return s
    s = inner.strip()


def _unwrap_once(s: str) -> str | None:
  """The content of one delimiter pair enclosing all of `s`, or None."""
  match = _BRACED_WRAPPER.match(s)
  if match is not None and _balanced_end(s, match.end()) == len(s) - 1:
    return s[match.end():-1]
  for left, right in _WRAPPERS:
    if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
      inner = s[len(left):len(s) - len(right)]
      if left.startswith("$") and "$" in inner:  # "$x$ and $y$" is not one span
        continue
      if left.startswith("\\") and (left in inner or right in inner):
        continue
      return inner
  return None


def extract_answer_line(text: str) -> str | None:
  """The answer of the last "Answer: ..." line (see the module docstring); when nothing follows
  the colon ("**Final Answer:**" alone), the next non-empty line."""
  matches = list(_ANSWER_LINE.finditer(text))
  if not matches:
    return None
  last = matches[-1]
  if last.group(1).strip():
    return last.group(1).strip()
  following = [line for line in text[last.end():].split("\n") if line.strip()]
  return following[0].strip() if following else ""


def extract_answer_tag(text: str) -> str | None:
  """Content of the last `<answer>...</answer>`, stripped."""
  matches = _ANSWER_TAG.findall(text)
  return matches[-1].strip() if matches else None


_EXTRACTORS = {
    "boxed": extract_boxed, "gsm8k": extract_gsm8k, "answer_tag": extract_answer_tag,
    "answer_line": extract_answer_line, "marker": extract_marked_answer,
    "gsm8k_number": _extract_gsm8k_number,
}


def extract_answer(text: str, fmt: str = "auto") -> str | None:
  """The final answer of `text` in format `fmt` (one of `ANSWER_FORMATS`), or None.

  Raises:
    ValueError: for an unknown format.
  """
  if fmt == "auto":
    names = ("boxed", "gsm8k_number", "answer_tag", "answer_line", "marker", "gsm8k")
  elif fmt in ANSWER_FORMATS:
    names = (fmt,)
  else:
    raise ValueError(f"answer format {fmt!r}; choose one of {ANSWER_FORMATS}.")
  for name in names:
    found = _EXTRACTORS[name](text)
    if found is not None:
      return strip_math_delimiters(found)
  return None


def text_after_reasoning(text: str, markers: tuple[str, str] | None,
                         starts_inside: bool = False) -> str | None:
  """The part of a completion after its reasoning block: what is graded.

  Args:
    text: the decoded completion.
    markers: (open, close) reasoning markers, e.g. ("<think>", "</think>") (from
      `Tokenizer.reasoning_markers`); None = no reasoning block: `text` as is.
    starts_inside: whether the prompt left a block open (a generation prompt ending in
      "<think>\\n", as DeepSeek-R1's template writes), so the completion starts inside one.

  Returns:
    The text after the last closing marker; `text` when it holds no marker and does not start
    inside a block; None when a block is left open (an unclosed block has no final answer).

  Example: text_after_reasoning("<think>A: 3?</think>A: 4", ("<think>", "</think>")) == "A: 4".
  """
  if markers is None:
    return text
  open_marker, close_marker = markers
  at_open, at_close = text.rfind(open_marker), text.rfind(close_marker)
  if at_close >= 0 and at_close > at_open:
    return text[at_close + len(close_marker):]
  if at_open >= 0 or starts_inside:
    return None
  return text


def format_answer(answer: str, fmt: str = "marker") -> str:
  """A minimal completion stating `answer` in format `fmt`, read back by `extract_answer`.

  "marker" and "auto": "A: <answer>"; "gsm8k": "#### <answer>"; "boxed": "\\boxed{<answer>}";
  "answer_line": "Answer: <answer>"; "answer_tag": "<answer><answer></answer>".

  Raises:
    ValueError: for an unknown format.
  """
  forms = {"marker": f"{ANSWER_MARKER} {answer}", "auto": f"{ANSWER_MARKER} {answer}",
           "gsm8k": f"#### {answer}", "boxed": f"\\boxed{{{answer}}}",
           "answer_line": f"Answer: {answer}", "answer_tag": f"<answer>{answer}</answer>"}
  if fmt not in forms:
    raise ValueError(f"answer format {fmt!r}; choose one of {ANSWER_FORMATS}.")
  return forms[fmt]


def normalize_text(text: str) -> str:
  """Strip, collapse whitespace runs to one space, case-fold, drop trailing periods.

  Example: normalize_text("  The  Eiffel\\tTower. ") == "the eiffel tower".
  """
  text = _WHITESPACE.sub(" ", text).strip().casefold()
  return text.rstrip(".").rstrip()


def parse_number(text: str) -> fractions.Fraction | None:
  """The exact rational value of a plain number, or None when `text` is not one.

  Accepted: optional sign; digits, optionally grouped by thousands commas ("1,000"); a decimal
  part; an exponent ("1e3"); or an integer ratio ("3/4"). Around it: whitespace, one "$" prefix
  (currency or inline math), a trailing "$" or ".". Anything else ("5 rows", "50%", "0x10",
  "nan") is not a number.

  Example: parse_number("2.50") == parse_number("2.5") == Fraction(5, 2).
  """
  s = text.strip()
  if s.startswith("$"):
    s = s[1:].strip()
  s = s.rstrip(".").rstrip("$").strip()
  if not s or not any(c.isdigit() for c in s):
    return None
  if _RATIO.fullmatch(s):
    num, den = s.split("/")
    return fractions.Fraction(int(num), int(den)) if int(den) else None
  if not _NUMBER.fullmatch(s):
    return None
  return fractions.Fraction(s.replace(",", ""))


def _math_verify_match(got: str, reference: str) -> bool:
  try:
    import math_verify  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("grader 'math_verify' needs the math-verify package: "
                      "pip install -e \".[data]\" (or pip install math-verify).") from e

  def wrap(s: str) -> str:  # math-verify finds LaTeX inside math delimiters or \boxed
    return s if "$" in s or "\\boxed" in s else f"${s}$"
  gold, answer = math_verify.parse(wrap(reference)), math_verify.parse(wrap(got))
  return bool(gold) and bool(answer) and bool(math_verify.verify(gold, answer))


def answers_match(got: str | None, reference: str, grader: str = "numeric") -> bool:
  """Whether answer `got` equals `reference` under `grader` (see the module docstring).

  Args:
    got: the extracted answer (None = no answer: never a match).
    reference: the reference answer, as written.
    grader: one of `GRADERS`.

  Raises:
    ValueError: for an unknown grader.
    ImportError: for "math_verify" without the math-verify package.
  """
  if grader not in GRADERS:
    raise ValueError(f"grader {grader!r}; choose one of {GRADERS}.")
  if got is None:
    return False
  got, reference = strip_math_delimiters(got), strip_math_delimiters(reference)
  if grader != "exact":
    a, b = parse_number(got), parse_number(reference)
    if a is not None and b is not None:
      return a == b
  if normalize_text(got) == normalize_text(reference):
    return True
  return grader == "math_verify" and _math_verify_match(got, reference)
