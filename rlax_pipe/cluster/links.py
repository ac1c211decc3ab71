"""Process links: one socket between the learner's lead (process 0) and every other process.

Transport: the standard library's `multiprocessing.connection` (length-prefixed pickled
messages over TCP, HMAC authentication with a random key); the lead's listening address and key
are published through the coordination service's key-value store. A message is a pair
`(kind, payload)`. Rollouts, spans and metrics flow to the lead; requests, batches and the end
of the run flow from it.

Liveness: each side sends a heartbeat every `heartbeat_s` from a background thread. A link that
closes (the peer process exited or was killed) or stays silent for `fault_timeout_s` is a fault
of the peer (`faults.FaultMonitor`), named with its role. A process ends its link with "bye";
the lead broadcasts "abort" with the fault's message when any process fails.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from multiprocessing import connection
from typing import Any

from absl import logging

from rlax_pipe.cluster.config import DistributedConfig
from rlax_pipe.cluster.faults import FaultMonitor
from rlax_pipe.cluster.kv import KVStore
from rlax_pipe.cluster.topology import Topology, role_of

_BYE, _HB, _ABORT, _ERROR, _HELLO, _WELCOME = "bye", "hb", "abort", "error", "hello", "welcome"


class _Peer:
  """One end of a link: the connection, a send lock, the last time anything arrived."""

  def __init__(self, conn: connection.Connection):
    self.conn, self.lock = conn, threading.Lock()
    self.last_seen = time.monotonic()
    self.done = False  # said "bye": a closed socket is no fault any more

  def send(self, kind: str, payload: Any) -> None:
    with self.lock:
      self.conn.send((kind, payload))


class Hub:
  """The lead's end of every link.

  Messages from other processes land in `inbox` as (process id, kind, payload); heartbeats,
  "error" (a process's own fault, `Link`) and closed links are handled here (faults).

  Args:
    topology: the job.
    kv: key-value store (the listening address is published under "link/lead").
    monitor: this process's fault monitor; a fault broadcasts "abort" to every process.
    cfg: heartbeat and timeouts.
    host: address the other processes reach this host at.
  """

  def __init__(self, topology: Topology, kv: KVStore, monitor: FaultMonitor,
               cfg: DistributedConfig, host: str):
    self.topology, self.monitor, self.cfg = topology, monitor, cfg
    self._authkey = secrets.token_bytes(16)
    self._listener = connection.Listener(("0.0.0.0", 0), authkey=self._authkey)
    kv.set("link/lead", {"host": host, "port": self._listener.address[1],
                         "authkey": self._authkey.hex()})
    self.peers: dict[int, _Peer] = {}
    self.hellos: dict[int, dict] = {}
    self.inbox: queue.Queue = queue.Queue()
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    monitor.on_fault(self._broadcast_abort)

  def accept_all(self) -> dict[int, dict]:
    """Waits for every other process's link and hello; returns process id -> hello payload.

    Raises:
      ProcessFault: naming the processes that did not connect within `connect_timeout_s`.
    """
    expected = set(range(1, self.topology.num_processes))
    done = threading.Event()

    def accept_loop():
      while expected - set(self.peers) and not self._stop.is_set():
        try:
          conn = self._listener.accept()
        except OSError:
          return
        if not conn.poll(self.cfg.connect_timeout_s):
          conn.close()
          continue
        kind, hello = conn.recv()
        if kind != _HELLO or hello.get("process") not in expected:
          conn.close()
          continue
        p = int(hello["process"])
        conn.send((_WELCOME, {"clock": time.perf_counter()}))
        self.peers[p], self.hellos[p] = _Peer(conn), hello
      done.set()

    thread = threading.Thread(target=accept_loop, name="rlax_pipe-accept", daemon=True)
    thread.start()
    if not done.wait(self.cfg.connect_timeout_s):
      missing = sorted(expected - set(self.peers))
      self.monitor.report(
          f"{', '.join(self.topology.name(p) for p in missing)} did not connect to the learner "
          f"lead within {self.cfg.connect_timeout_s:.0f} s (connect_timeout_s).")
      self.monitor.check()
    for target, name in ((self._read_loop, "rlax_pipe-hub-read"),
                         (self._heartbeat_loop, "rlax_pipe-hub-heartbeat")):
      t = threading.Thread(target=target, name=name, daemon=True)
      t.start()
      self._threads.append(t)
    return dict(self.hellos)

  def send(self, process_id: int, kind: str, payload: Any = None) -> None:
    """Sends one message to a process (a broken link is a fault of that process)."""
    peer = self.peers[process_id]
    try:
      peer.send(kind, payload)
    except (OSError, EOFError) as e:
      if not peer.done:
        self.monitor.report(f"{self.topology.name(process_id)} is unreachable: its link "
                            f"failed ({type(e).__name__}: {e}).")

  def broadcast(self, kind: str, payload: Any = None, role: str | None = None) -> None:
    """Sends one message to every other process (of `role`, if given)."""
    for p in sorted(self.peers):
      if role is None or role_of(p, self.topology.num_learner_processes) == role:
        self.send(p, kind, payload)

  def _broadcast_abort(self, message: str) -> None:
    for p, peer in self.peers.items():
      try:
        peer.send(_ABORT, message)
      except (OSError, EOFError):
        pass

  def _read_loop(self) -> None:
    conns = {peer.conn: p for p, peer in self.peers.items()}
    while not self._stop.is_set() and conns:
      for conn in connection.wait(list(conns), timeout=0.2):
        p = conns[conn]
        peer = self.peers[p]
        try:
          kind, payload = conn.recv()
        except (EOFError, OSError) as e:
          del conns[conn]
          if not peer.done and not self._stop.is_set():
            self.monitor.report(f"{self.topology.name(p)} died: its link to the learner lead "
                                f"closed ({type(e).__name__}).")
          continue
        peer.last_seen = time.monotonic()
        if kind == _HB:
          continue
        if kind == _BYE:
          peer.done = True
        if kind == _ERROR:
          self.monitor.report(f"{self.topology.name(p)} reported: {payload}")
          continue
        self.inbox.put((p, kind, payload))

  def _heartbeat_loop(self) -> None:
    while not self._stop.wait(self.cfg.heartbeat_s):
      now = time.monotonic()
      for p, peer in list(self.peers.items()):
        if peer.done:
          continue
        try:
          peer.send(_HB, None)
        except (OSError, EOFError):
          pass  # the read loop reports the closed link
        if now - peer.last_seen > self.cfg.fault_timeout_s:
          self.monitor.report(
              f"{self.topology.name(p)} is unresponsive: nothing received for "
              f"{now - peer.last_seen:.0f} s (fault_timeout_s={self.cfg.fault_timeout_s:.0f}).")

  def close(self) -> None:
    """Stops the threads and closes every link and the listener."""
    self._stop.set()
    for t in self._threads:
      t.join(timeout=5.0)
    for peer in self.peers.values():
      peer.conn.close()
    self._listener.close()


class Link:
  """A non-lead process's link to the lead.

  Messages from the lead land in `inbox` as (kind, payload); "abort" becomes a fault here. This
  process's first fault (its main thread's exception, `FaultMonitor.report`) is sent to the lead
  as "error", so the lead's fault names it rather than only the closed link. The clock offset
  to the lead (`offset_s`, add it to `time.perf_counter()` to get the lead's clock) is
  measured at the handshake, NTP-style (half the round trip).

  Raises (constructor):
    ProcessFault: when the lead's address or the handshake does not come within
      `connect_timeout_s`.
  """

  def __init__(self, topology: Topology, kv: KVStore, monitor: FaultMonitor,
               cfg: DistributedConfig, hello: dict):
    self.topology, self.monitor, self.cfg = topology, monitor, cfg
    lead = kv.get("link/lead", cfg.connect_timeout_s)
    self._conn = connection.Client((lead["host"], int(lead["port"])),
                                   authkey=bytes.fromhex(lead["authkey"]))
    t0 = time.perf_counter()
    self._conn.send((_HELLO, {"process": topology.process_id, **hello}))
    if not self._conn.poll(cfg.connect_timeout_s):
      monitor.report(f"{topology.name()}: the learner lead did not answer the handshake within "
                     f"{cfg.connect_timeout_s:.0f} s.")
      monitor.check()
    kind, welcome = self._conn.recv()
    t1 = time.perf_counter()
    if kind != _WELCOME:
      raise RuntimeError(f"link handshake: expected {_WELCOME!r}, got {kind!r}")
    self.offset_s = float(welcome["clock"]) - (t0 + t1) / 2
    self._peer = _Peer(self._conn)
    self.inbox: queue.Queue = queue.Queue()
    self._stop = threading.Event()
    self._threads = []
    for target, name in ((self._read_loop, "rlax_pipe-link-read"),
                         (self._heartbeat_loop, "rlax_pipe-link-heartbeat")):
      t = threading.Thread(target=target, name=name, daemon=True)
      t.start()
      self._threads.append(t)
    monitor.on_fault(self._report_fault)

  def lead_clock(self) -> float:
    """Now, on the lead's `time.perf_counter()` clock (seconds)."""
    return time.perf_counter() + self.offset_s

  def send(self, kind: str, payload: Any = None) -> None:
    """Sends one message to the lead (a broken link is the lead's fault)."""
    try:
      self._peer.send(kind, payload)
    except (OSError, EOFError) as e:
      if not self._stop.is_set():
        self.monitor.report(f"learner lead (process 0) is unreachable: the link failed "
                            f"({type(e).__name__}: {e}).")

  def _report_fault(self, message: str) -> None:
    """Tells the lead this process's fault (the lead ends the job); a broken link is ignored:
    the lead then sees the link close."""
    try:
      self._peer.send(_ERROR, message)
    except (OSError, EOFError):
      pass

  def _read_loop(self) -> None:
    while not self._stop.is_set():
      try:
        if not self._conn.poll(0.2):
          continue
        kind, payload = self._conn.recv()
      except (EOFError, OSError) as e:
        if not self._stop.is_set():
          self.monitor.report(f"learner lead (process 0) died: its link closed "
                              f"({type(e).__name__}).")
        return
      self._peer.last_seen = time.monotonic()
      if kind == _HB:
        continue
      if kind == _ABORT:
        self.monitor.report(str(payload))
        continue
      self.inbox.put((kind, payload))

  def _heartbeat_loop(self) -> None:
    while not self._stop.wait(self.cfg.heartbeat_s):
      try:
        self._peer.send(_HB, None)
      except (OSError, EOFError):
        pass
      silent = time.monotonic() - self._peer.last_seen
      if silent > self.cfg.fault_timeout_s:
        self.monitor.report(f"learner lead (process 0) is unresponsive: nothing received for "
                            f"{silent:.0f} s (fault_timeout_s={self.cfg.fault_timeout_s:.0f}).")

  def close(self) -> None:
    """Says "bye" and closes the link."""
    if self._stop.is_set():
      return
    try:
      self._peer.send(_BYE, None)
    except (OSError, EOFError):
      pass
    self._stop.set()
    for t in self._threads:
      t.join(timeout=5.0)
    self._conn.close()
    logging.info("link to the learner lead closed.")
