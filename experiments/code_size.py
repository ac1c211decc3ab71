"""Size of a package at a git revision: lines and code lines, per file and in total (JSON).

Code lines are the lines that hold a Python token other than a comment, excluding docstrings
(the first string statement of a module, class or function) and blank lines
(`lib/code_size.py`). Issue #25 compares `rlax_pipe/pipeline` before the pipeline redesign
(5eb5ab4^) and after.

  python3 experiments/code_size.py --rev=HEAD --path=rlax_pipe/pipeline
  python3 experiments/code_size.py --rev=5eb5ab4^ --path=rlax_pipe/pipeline --per_file
"""

import json
import subprocess

from absl import app
from absl import flags

from lib import code_size

_REV = flags.DEFINE_string("rev", "HEAD", "Git revision to read (the committed tree).")
_PATH = flags.DEFINE_string("path", "rlax_pipe/pipeline", "Folder of the repository to count.")
_PER_FILE = flags.DEFINE_bool("per_file", False, "Also print each file's counts.")


def _git(*args: str) -> str:
  return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def main(argv):
  del argv
  files = [f for f in _git("ls-tree", "-r", "--name-only", _REV.value, _PATH.value).split()
           if f.endswith(".py")]
  per_file = {}
  for f in files:
    source = _git("show", f"{_REV.value}:{f}")
    per_file[f] = {"lines": len(source.splitlines()), "code_lines": code_size.code_lines(source)}
  out = {"rev": _REV.value, "path": _PATH.value, "files": len(files),
         "lines": sum(c["lines"] for c in per_file.values()),
         "code_lines": sum(c["code_lines"] for c in per_file.values())}
  if _PER_FILE.value:
    out["per_file"] = per_file
  print(json.dumps(out, indent=2))


if __name__ == "__main__":
  app.run(main)
