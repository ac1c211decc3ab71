"""Summarise a per-test CPU report of the suite (written by tests/conftest.py when
RLAX_PIPE_TEST_CPU_REPORT=path is set) per file and per test.

  RLAX_PIPE_TEST_CPU_REPORT=/tmp/cpu.jsonl python3 -m pytest -n 2 --dist loadfile
  python3 tests/cpu_report.py /tmp/cpu.jsonl [--top 40] [--json]

CPU seconds = this process's (every thread) + its finished children's (user + system), summed
over setup, call and teardown of each test; a module- or session-scoped fixture's cost lands on
the first test that uses it. "overhead" is each worker's CPU outside its tests (imports,
collection, session fixtures' teardown). Several reports (chunks of one suite) may be given;
for a test present in more than one, the last report's record is kept.
"""

import argparse
import collections
import json
import sys


def load(paths):
  """(tests: {nodeid: record}, sessions: [record]) from JSONL report files.

  Raises:
    ValueError: a line is not a JSON object with a "kind" of "test" or "session".
  """
  tests, sessions = {}, []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        rec = json.loads(line)
        if not isinstance(rec, dict) or rec.get("kind") not in ("test", "session"):
          raise ValueError(f"{path}:{n}: not a CPU-report record: {line[:80]!r}")
        if rec["kind"] == "test":
          tests[rec["nodeid"]] = rec
        else:
          sessions.append(rec)
  return tests, sessions


def per_file(tests):
  """{file: {"tests", "cpu_s", "children_cpu_s", "total_cpu_s", "wall_s"}} summed over tests."""
  out = collections.defaultdict(lambda: collections.Counter())
  for nodeid, rec in tests.items():
    row = out[nodeid.split("::")[0]]
    row["tests"] += 1
    row["cpu_s"] += rec["cpu_s"]
    row["children_cpu_s"] += rec["children_cpu_s"]
    row["total_cpu_s"] += rec["cpu_s"] + rec["children_cpu_s"]
    row["wall_s"] += rec["wall_s"]
  return {k: dict(v) for k, v in out.items()}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("reports", nargs="+")
  parser.add_argument("--top", type=int, default=40, help="rows of each table")
  parser.add_argument("--json", action="store_true", help="print one JSON object instead")
  args = parser.parse_args(argv)
  tests, sessions = load(args.reports)
  files = per_file(tests)
  total = sum(r["total_cpu_s"] for r in files.values())
  workers = [s for s in sessions if s["worker"] or len(sessions) == 1]
  session_cpu = sum(s["cpu_s"] + s["children_cpu_s"] for s in workers)
  summary = {"tests": len(tests), "test_cpu_s": round(total, 1),
             "session_cpu_s": round(session_cpu, 1),
             "overhead_cpu_s": round(session_cpu - total, 1) if workers else None,
             "test_wall_s": round(sum(r["wall_s"] for r in tests.values()), 1)}
  if args.json:
    json.dump({"summary": summary, "files": files, "tests": tests}, sys.stdout)
    return
  print(json.dumps(summary))
  print(f"\n{'file':62s} {'n':>4s} {'cpu_s':>8s} {'child_s':>8s} {'total_s':>8s} {'wall_s':>8s}")
  for name, r in sorted(files.items(), key=lambda kv: -kv[1]["total_cpu_s"])[:args.top]:
    print(f"{name:62s} {r['tests']:4d} {r['cpu_s']:8.1f} {r['children_cpu_s']:8.1f} "
          f"{r['total_cpu_s']:8.1f} {r['wall_s']:8.1f}")
  print(f"\n{'test':100s} {'total_s':>8s} {'wall_s':>8s}")
  for nodeid, r in sorted(tests.items(),
                          key=lambda kv: -(kv[1]["cpu_s"] + kv[1]["children_cpu_s"]))[:args.top]:
    print(f"{nodeid[:100]:100s} {r['cpu_s'] + r['children_cpu_s']:8.1f} {r['wall_s']:8.1f}")


if __name__ == "__main__":
  main()
