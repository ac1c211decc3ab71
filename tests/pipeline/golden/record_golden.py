"""Records the golden metrics of tests/pipeline/test_drivers.py (see README.md here).

Run from the root of a checkout of the code the goldens must come from:

    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0" \
      PYTHONPATH=$PWD python3 tests/pipeline/golden/record_golden.py OUT_DIR

OUT_DIR gets one run directory per driver and `<driver>_block.json`, the rows the test compares.
"""

import pathlib
import sys

sys.path.insert(0, "tests")
sys.path.insert(0, "tests/pipeline")

import conftest  # noqa: E402  (tests/conftest.py: tiny_config)
import test_drivers  # noqa: E402  (write_golden)

from rlax_pipe.pipeline import run as run_lib  # noqa: E402


def main(out: pathlib.Path) -> None:
  for driver in ("sync", "async-batch", "pipeline"):
    cfg = conftest.tiny_config(out / driver, "builtin", driver=driver, max_lag=1, policy="block")
    run_lib.run(cfg)
    test_drivers.write_golden(cfg.run_dir, out / f"{driver}_block.json")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))
