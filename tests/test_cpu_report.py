"""tests/cpu_report.py (the suite's per-test CPU summary): records summed per file, bad lines
refused with the file and line named."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import cpu_report  # noqa: E402  pylint: disable=wrong-import-position


def _write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def _test(nodeid, cpu, child, wall):
  return {"kind": "test", "nodeid": nodeid, "worker": "gw0", "cpu_s": cpu,
          "children_cpu_s": child, "wall_s": wall}


def test_per_file_sums_and_a_later_report_replaces_a_test(tmp_path):
  first = _write(tmp_path / "a.jsonl", [
      _test("tests/a.py::t1", 1.0, 0.0, 2.0), _test("tests/a.py::t2", 0.5, 2.0, 3.0),
      _test("tests/b.py::t", 4.0, 0.0, 5.0),
      {"kind": "session", "worker": "gw0", "pid": 1, "cpu_s": 9.0, "children_cpu_s": 2.0}])
  rerun = _write(tmp_path / "b.jsonl", [_test("tests/b.py::t", 3.0, 0.0, 4.0)])
  tests, sessions = cpu_report.load([first, rerun])
  files = cpu_report.per_file(tests)
  assert files["tests/a.py"] == {"tests": 2, "cpu_s": 1.5, "children_cpu_s": 2.0,
                                 "total_cpu_s": 3.5, "wall_s": 5.0}
  assert files["tests/b.py"]["total_cpu_s"] == 3.0  # the rerun's record, not the first
  assert len(sessions) == 1


def test_a_line_that_is_no_record_is_named(tmp_path):
  bad = _write(tmp_path / "bad.jsonl", [_test("tests/a.py::t", 1.0, 0.0, 1.0), {"x": 1}])
  with pytest.raises(ValueError, match=r"bad.jsonl:2: not a CPU-report record"):
    cpu_report.load([bad])
