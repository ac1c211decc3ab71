"""Small control messages between processes through the coordination service's key-value store.

`jax.distributed` starts a coordination service in process 0; every process holds a client of it
(`jax._src.distributed.global_state.client`, the object orbax also uses for its barriers). Its
key-value store carries small JSON control messages well (reference/multihost-notes.md: 512
messages of 2 MB in ~0.2 s); bulk data (rollouts) goes through `links`.
"""

from __future__ import annotations

import json
from typing import Any


class KVTimeout(TimeoutError):
  """A key did not appear within the wait limit."""


def _client():
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("the coordination service is not running: call "
                       "rlax_pipe.cluster.initialize (jax.distributed.initialize) first.")
  return client


class KVStore:
  """JSON values under a key prefix in the coordination service's store.

  Example:
    kv = KVStore("rlax/w/")
    kv.set("req/0/3", {"have": 5})                # any process
    kv.get("req/0/3", timeout_s=1.0)              # another process: waits for it
  """

  def __init__(self, prefix: str = "rlax/"):
    self.prefix = prefix
    self._client = _client()

  def set(self, key: str, value: Any) -> None:
    """Stores `value` (JSON-serializable) under `key` (overwrites)."""
    self._client.key_value_set(self.prefix + key, json.dumps(value), allow_overwrite=True)

  def get(self, key: str, timeout_s: float) -> Any:
    """Waits up to `timeout_s` seconds for `key` and returns its value.

    Raises:
      KVTimeout: naming the key and the wait.
    """
    try:
      raw = self._client.blocking_key_value_get(self.prefix + key, max(1, int(timeout_s * 1000)))
    except Exception as e:  # pylint: disable=broad-except  (jaxlib raises JaxRuntimeError)
      if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e):
        raise KVTimeout(f"no value for {self.prefix + key!r} within {timeout_s:.1f} s") from None
      raise
    return json.loads(raw)

  def delete(self, key: str) -> None:
    """Removes `key` (no error if absent)."""
    self._client.key_value_delete(self.prefix + key)


def barrier(name: str, timeout_s: float, process_ids: list[int] | None = None) -> None:
  """A coordination-service barrier of `process_ids` (None = every process); never a device
  collective, which can hang next to cross-host transfers (reference/multihost-notes.md).

  Raises:
    KVTimeout: when not every process arrived within `timeout_s`.
  """
  try:
    _client().wait_at_barrier(f"rlax/{name}", max(1, int(timeout_s * 1000)),
                              process_ids=process_ids)
  except Exception as e:  # pylint: disable=broad-except
    if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e):
      raise KVTimeout(f"barrier {name!r} of processes {process_ids or 'all'}: not every process "
                      f"arrived within {timeout_s:.0f} s") from None
    raise
