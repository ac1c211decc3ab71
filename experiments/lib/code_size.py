"""Size of Python source: lines that hold code, without blank, comment and docstring lines.

Used by `experiments/code_size.py` (issue #25 measures `rlax_pipe/pipeline` with it).
"""

import ast
import io
import tokenize

_NOT_CODE = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENDMARKER)


def docstring_lines(source: str) -> set[int]:
  """The 1-based line numbers of the module's, classes' and functions' docstrings.

  Raises:
    SyntaxError: when `source` is not valid Python.
  """
  lines = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      first = node.body[0] if node.body else None
      if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
          and isinstance(first.value.value, str)):
        lines.update(range(first.lineno, first.end_lineno + 1))
  return lines


def code_lines(source: str) -> int:
  """Lines of `source` (Python text) holding code: a token that is not a comment, outside the
  docstrings (`docstring_lines`); a token over several lines counts each of them once.

  Raises:
    SyntaxError: when `source` is not valid Python.
  """
  docs, code = docstring_lines(source), set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type not in _NOT_CODE:
      code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
  return len(code)
