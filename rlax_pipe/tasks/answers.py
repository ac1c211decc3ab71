"""Reading a final answer out of text, and deciding whether two answers are the same.

Answer formats (`extract_answer(text, fmt)`), each matched only at a boundary so that a marker
inside a word or a longer token never counts ("Launches by NASA: 7" holds no "A:" answer):

- "marker": the text after the FIRST "A:" (not preceded by a letter, digit or "_") up to the end
  of its line; the convention of the built-in tasks (`base.extract_marked_answer`).
- "gsm8k": the text after the LAST "####" up to the end of its line (GSM8K's `#### 72`).
- "boxed": the content of the LAST `\\boxed{...}` (or `\\fbox{...}`), braces balanced (MATH).
- "answer_line": the LAST line of the form "Answer: ..." (also "Final answer:", "**Answer:**"),
  case-insensitive, at the start of a line.
- "answer_tag": the content of the LAST `<answer>...</answer>` (reasoning-gym's and DeepSeek-R1's
  convention), stripped.
- "auto": the first of boxed, gsm8k, answer_tag, answer_line, marker that finds an answer.

Equivalence (`answers_match(got, reference, grader)`):

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
_BOXED = re.compile(r"\\(?:boxed|fbox)[ \t]*\{")
# A plain number: sign, digits (optionally with thousands commas), decimals, exponent; or a/b.
_NUMBER = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d+)?")
_RATIO = re.compile(r"[+-]?\d+/\d+")


def _marker_pattern(marker: str) -> re.Pattern:
  return re.compile(r"(?<![\w])" + re.escape(marker))


def extract_marked_answer(text: str, marker: str = ANSWER_MARKER) -> str | None:
  """Text after the first `marker` that starts a word, up to the end of its line; stripped.

  Example: extract_marked_answer("The DATA: 5 rows\\nA: 7") == "7";
  extract_marked_answer("Launches by NASA: 7") is None.

  Returns:
    The answer text, or None when no marker starts a word.
  """
  match = _marker_pattern(marker).search(text)
  if match is None:
    return None
  return text[match.end():].split("\n", 1)[0].strip()


def extract_gsm8k(text: str) -> str | None:
  """Text after the last "####" (not part of a longer run of "#"), to the end of its line."""
  matches = _GSM8K.findall(text)
  return matches[-1].strip() if matches else None


def extract_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` / `\\fbox{...}` with balanced braces; None if unclosed."""
  starts = [m.end() for m in _BOXED.finditer(text)]
  if not starts:
    return None
  depth, start = 1, starts[-1]
  for k in range(start, len(text)):
    depth += {"{": 1, "}": -1}.get(text[k], 0)
    if depth == 0:
      return text[start:k].strip()
  return None


def extract_answer_line(text: str) -> str | None:
  """The answer of the last "Answer: ..." line (see the module docstring)."""
  matches = _ANSWER_LINE.findall(text)
  return matches[-1].strip() if matches else None


def extract_answer_tag(text: str) -> str | None:
  """Content of the last `<answer>...</answer>`, stripped."""
  matches = _ANSWER_TAG.findall(text)
  return matches[-1].strip() if matches else None


_EXTRACTORS = {
    "boxed": extract_boxed, "gsm8k": extract_gsm8k, "answer_tag": extract_answer_tag,
    "answer_line": extract_answer_line, "marker": extract_marked_answer,
}


def extract_answer(text: str, fmt: str = "auto") -> str | None:
  """The final answer of `text` in format `fmt` (one of `ANSWER_FORMATS`), or None.

  Raises:
    ValueError: for an unknown format.
  """
  if fmt == "auto":
    for name in ("boxed", "gsm8k", "answer_tag", "answer_line", "marker"):
      found = _EXTRACTORS[name](text)
      if found is not None:
        return found
    return None
  if fmt not in _EXTRACTORS:
    raise ValueError(f"answer format {fmt!r}; choose one of {ANSWER_FORMATS}.")
  return _EXTRACTORS[fmt](text)


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
  if grader != "exact":
    a, b = parse_number(got), parse_number(reference)
    if a is not None and b is not None:
      return a == b
  if normalize_text(got) == normalize_text(reference):
    return True
  return grader == "math_verify" and _math_verify_match(got, reference)
