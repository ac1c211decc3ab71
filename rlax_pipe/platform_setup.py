"""Process set-up for entry points: virtual CPU devices must be requested before JAX starts."""

from __future__ import annotations

import os


def request_cpu_devices(n: int = 8) -> None:
  """Asks XLA for `n` virtual CPU devices unless the user already chose a device count.

  Must run before `jax` is imported (XLA reads the flag at backend start-up). On a machine with
  accelerators the flag only affects the (unused) CPU backend.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
