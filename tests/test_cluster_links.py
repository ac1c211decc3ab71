"""A process's own fault reaches the lead through its link (rlax_pipe.cluster.links), in one
process: the lead's Hub and a replica's Link over a real socket, a dict as the key-value store."""

import threading
import time

from rlax_pipe import cluster
from rlax_pipe.pipeline.multihost.lead import fault_on_error


class _DictKV:
  """The two KVStore calls the links make, on a dict (no coordination service)."""

  def __init__(self):
    self._values = {}

  def set(self, key, value):
    self._values[key] = value

  def get(self, key, timeout_s):
    del timeout_s
    return self._values[key]


def _wait_for(predicate, timeout_s=10.0):
  end = time.monotonic() + timeout_s
  while not predicate() and time.monotonic() < end:
    time.sleep(0.01)
  return predicate()


def test_a_replicas_exception_is_named_in_the_leads_fault():
  cfg = cluster.DistributedConfig(heartbeat_s=0.05, fault_timeout_s=30.0, connect_timeout_s=10.0)
  lead_topo, replica_topo = (cluster.Topology(p, 2, 1, 1) for p in (0, 1))
  lead_mon = cluster.FaultMonitor(lead_topo.name(), exit_grace_s=None)
  replica_mon = cluster.FaultMonitor(replica_topo.name(), exit_grace_s=None)
  kv = _DictKV()
  hub = cluster.Hub(lead_topo, kv, lead_mon, cfg, "127.0.0.1")
  made = {}
  t = threading.Thread(target=lambda: made.update(
      link=cluster.Link(replica_topo, kv, replica_mon, cfg, hello={})))
  t.start()
  hub.accept_all()
  t.join(10.0)
  try:
    fault_on_error(replica_mon, replica_topo.name(), ValueError("bad shard 7"))
    assert _wait_for(lambda: lead_mon.error is not None)
    assert lead_mon.error.startswith(f"{replica_topo.name()} reported: ")
    assert "failed: ValueError: bad shard 7" in lead_mon.error
    # the lead's abort goes back to the replica, whose monitor keeps its own first fault
    assert replica_mon.error.endswith("ValueError: bad shard 7")
  finally:
    made["link"].close()
    hub.close()
