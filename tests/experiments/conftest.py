"""Tests of experiments/lib (the code the entry points share): put experiments/ on sys.path, as
running `python3 experiments/<entry>.py` does, and tests/sim for its synthetic-run helpers."""

import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]
for _path in (_ROOT / "experiments", _ROOT / "tests" / "sim"):
  if str(_path) not in sys.path:
    sys.path.insert(0, str(_path))

