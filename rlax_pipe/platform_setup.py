"""Process set-up for entry points: virtual CPU devices (requested before JAX starts) and the log
level of the libraries underneath."""

from __future__ import annotations

import logging
import os


def request_cpu_devices(n: int = 8) -> None:
  """Asks XLA for `n` virtual CPU devices unless the user already chose a device count.

  Must run before `jax` is imported (XLA reads the flag at backend start-up). On a machine with
  accelerators the flag only affects the (unused) CPU backend.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


# Packages whose own log lines are shown only from `quiet_library_logging`'s level up.
QUIET_PACKAGES: tuple[str, ...] = ("orbax",)


class _LibraryFilter(logging.Filter):
  """Drops records below `level` that come from files of the given packages."""

  def __init__(self, level: int, packages: tuple[str, ...]):
    super().__init__()
    self.level = level
    self.parts = tuple(f"{os.sep}{p}{os.sep}" for p in packages)

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= self.level:
      return True
    return not any(part in record.pathname for part in self.parts)


def quiet_library_logging(level: str | int = "warning",
                          packages: tuple[str, ...] = QUIET_PACKAGES) -> None:
  """Shows log lines of `packages` (default: orbax) only from `level` up.

  Orbax logs ~50 info lines per checkpoint through absl; entry points call this so the run's own
  progress lines stay readable. Idempotent (a second call replaces the first filter).

  Args:
    level: "debug", "info", "warning", "error" or a `logging` level number.
    packages: top-level package names whose source files' records are filtered.
  """
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  if isinstance(level, str):
    level = logging.getLevelName(level.upper())
  # Orbax logs through absl (the "absl" logger); a library using the standard logging module
  # reaches absl's handler on the root logger. Filter at both.
  for target in (logging.getLogger("absl"), absl_logging.get_absl_handler()):
    for f in [f for f in target.filters if isinstance(f, _LibraryFilter)]:
      target.removeFilter(f)
    target.addFilter(_LibraryFilter(int(level), packages))
