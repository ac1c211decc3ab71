"""Size of a package at a git revision: lines and code lines, per file and in total (JSON).

Code lines are the lines that hold a Python token other than a comment, excluding docstrings
(the first string statement of a module, class or function) and blank lines. Issue #25 compares
`rlax_pipe/pipeline` before the pipeline redesign (5eb5ab4^) and after.

  python3 experiments/code_size.py --rev=HEAD --path=rlax_pipe/pipeline
  python3 experiments/code_size.py --rev=5eb5ab4^ --path=rlax_pipe/pipeline --per_file
"""

import ast
import io
import json
import subprocess
import tokenize

from absl import app
from absl import flags

_REV = flags.DEFINE_string("rev", "HEAD", "Git revision to read (the committed tree).")
_PATH = flags.DEFINE_string("path", "rlax_pipe/pipeline", "Folder of the repository to count.")
_PER_FILE = flags.DEFINE_bool("per_file", False, "Also print each file's counts.")

_NOT_CODE = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENDMARKER)


def docstring_lines(source: str) -> set[int]:
  """The 1-based line numbers of the module's, classes' and functions' docstrings."""
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
  docstrings (`docstring_lines`)."""
  docs, code = docstring_lines(source), set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type not in _NOT_CODE:
      code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
  return len(code)


def _git(*args: str) -> str:
  return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def main(argv):
  del argv
  files = [f for f in _git("ls-tree", "-r", "--name-only", _REV.value, _PATH.value).split()
           if f.endswith(".py")]
  per_file = {}
  for f in files:
    source = _git("show", f"{_REV.value}:{f}")
    per_file[f] = {"lines": len(source.splitlines()), "code_lines": code_lines(source)}
  out = {"rev": _REV.value, "path": _PATH.value, "files": len(files),
         "lines": sum(c["lines"] for c in per_file.values()),
         "code_lines": sum(c["code_lines"] for c in per_file.values())}
  if _PER_FILE.value:
    out["per_file"] = per_file
  print(json.dumps(out, indent=2))


if __name__ == "__main__":
  app.run(main)
