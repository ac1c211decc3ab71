"""Weights across processes: the newest version only, device to device, by request / announce /
acknowledge (DESIGN.md, "Multi-host"; reference/multihost-notes.md).

Control messages go through the coordination service's key-value store (prefix "rlax/w/"):

  1. request      replica r, its m-th time:  req/{r}/{m} = {"have": version it holds, -1 none}
  2. announce     the lead, once a version newer than "have" exists, appends to the transfer log
                  log/{n} = {"kind": "transfer", "version": v, "replica": r, "sender": g, ...}
                  with v the newest version at that moment (a replica that is behind gets the
                  newest, never a backlog), its checksums and the layout digest. The lead also
                  appends {"kind": "retire", "below": v} when it pushes v, and {"kind": "end"}.
  3. transfer     every process reads the log in order and calls `jax.device_put` for every
                  transfer: learner process g (= r mod K) with its staging copy of v, replica r
                  into its replica layout, every other process with stand-ins. Why everybody:
                  jax 0.10 pairs a send with its receive by a transfer key that each process
                  draws from its own counter, once per transfer it takes part in, and a process
                  that skips a transfer is out of step from then on (measured: the next receive
                  hangs or pairs with the wrong send). A stand-in call is free (no data moves).
  4. acknowledge  replica r, once every array has arrived: ack/{n} = {"ok": true, ...}; then the
                  engine swaps the version in at its next dispatch boundary (the replica keeps
                  decoding meanwhile) and checks its checksums; then r requests again.
  5. release      learner process g keeps its staging copy of v alive until each transfer of v
                  it sent is acknowledged, so the learner donating its params at the next step
                  never frees an in-flight buffer; a copy is freed once unreferenced and retired.

Versions are never used up by a failed transfer: the replica asks again with the version it
holds and the lead announces the newest one (again). A layout that differs between learner and
replica is an error naming both sides (`layout.LayoutMismatchError`); weights that arrive but
are not the version announced are caught by the engine's checksum check
(`param_checksum.WeightMismatchError`). Every wait has a limit (`DistributedConfig`).
"""

from __future__ import annotations

import abc
import dataclasses
import queue
import threading
import time
from typing import Any, Callable

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from rlax_pipe import param_checksum
from rlax_pipe.cluster import DistributedConfig, FaultMonitor, KVStore, KVTimeout
from rlax_pipe.pipeline.multihost import messages
from rlax_pipe.pipeline.multihost.layout import TransferLayout
from rlax_pipe.pipeline.weight_channel import check_manifest, delete_all, params_manifest
from rlax_pipe.types import WeightUpdate

KV_PREFIX = "rlax/w/"
_POLL_S = 0.5


class _LogReader(abc.ABC):
  """A process's end of the protocol: its key-value store (prefix `KV_PREFIX`) and a thread that
  reads the transfer log in order, running `self._handle(n, entry)` for every entry (each
  subclass starts it once set up); an exception there is a fault of this process.
  """

  def __init__(self, layout: TransferLayout, monitor: FaultMonitor, cfg: DistributedConfig):
    self.layout, self._monitor, self._cfg = layout, monitor, cfg
    self._kv = KVStore(KV_PREFIX)
    self._log_thread = threading.Thread(target=self._read_log, name="rlax_pipe-transfer-log",
                                        daemon=True)

  @abc.abstractmethod
  def _handle(self, n: int, entry: dict) -> None:
    """Handles log entry number `n` (its "kind": transfer, retire, end) on the log thread."""

  def _read_log(self) -> None:
    n = 0
    while self._monitor.error is None:
      try:
        entry = self._kv.get(f"log/{n}", _POLL_S)
      except KVTimeout:
        continue
      try:
        self._handle(n, entry)
      except Exception as e:  # pylint: disable=broad-except
        logging.exception("transfer log entry %d failed", n)
        self._monitor.report(f"{self.layout.topology.name()}: weight transfer log entry {n} "
                             f"({entry}) failed: {type(e).__name__}: {e}")
        return
      if entry["kind"] == "end":
        return
      n += 1

  def log_ended(self, timeout_s: float) -> bool:
    """Waits up to `timeout_s` for the "end" entry to be handled; returns whether it was."""
    self._log_thread.join(timeout_s)
    return not self._log_thread.is_alive()


def transfer(layout: TransferLayout, entry: dict, source: list[jax.Array] | None
             ) -> list[jax.Array]:
  """This process's part of one logged transfer: `jax.device_put` from learner process
  `entry["sender"]`'s staging copy into replica `entry["replica"]`'s layout. `source` is the
  sender's own copy on the sender, None elsewhere (stand-ins are used)."""
  topo = layout.topology
  src = source if source is not None else layout.stand_ins(entry["sender"])
  return jax.device_put(src, layout.process_sharding(topo.replica_process(entry["replica"])))


@dataclasses.dataclass
class _Snapshot:
  version: int
  staged: list[jax.Array]
  local: list[jax.Array]
  checksum: jax.Array
  refs: int = 0


class LearnerSender(_LogReader):
  """A learner process's side: staging copies per version, sending, freeing on acknowledgement.

  Args:
    layout: the shared layout.
    monitor: fault monitor.
    cfg: time limits.
  """

  def __init__(self, layout: TransferLayout, monitor: FaultMonitor, cfg: DistributedConfig):
    super().__init__(layout, monitor, cfg)
    self._pid = layout.topology.process_id
    self._manifest = params_manifest(layout.abstract)
    self._relayout = jax.jit(lambda xs: [jnp.copy(x) for x in xs],
                             out_shardings=layout.staging_sharding())
    self._cond = threading.Condition()
    self._snaps: dict[int, _Snapshot] = {}
    self.latest = -1
    self._retired_below = -1
    self.on_push: Callable[[int], None] | None = None  # on_push(version) after each push
    self._acks: queue.Queue = queue.Queue()
    threading.Thread(target=self._ack_loop, name="rlax_pipe-acks", daemon=True).start()
    self._log_thread.start()

  # ---- learner thread ---------------------------------------------------------------------
  def push(self, update: WeightUpdate) -> None:
    """Re-lays `update.params` out into this process's replica-layout copy and keeps it as
    `update.version` (`types.WeightSink`: the `Trainer` calls it after every step, every learner
    process for the same versions in the same order, as the re-layout is a collective on the
    learner mesh). Returns once the re-layout and the checksums are dispatched; the copy is this
    sender's own (the learner may donate `params` at once) and it computes the checksums the
    replicas check, so `donated` and `checksum` are not read.

    Raises:
      ManifestError: if `params` does not match the model's params tree.
      ValueError: if `version` is not newer than the last pushed one.
    """
    params, version = update.params, update.version
    check_manifest(self._manifest, params, what=f"pushed params (version {version})")
    if version <= self.latest:
      raise ValueError(f"LearnerSender.push: version {version} is not newer than {self.latest}.")
    staged = self._relayout(jax.tree_util.tree_leaves(params))
    snap = _Snapshot(version, staged, self.layout.local_view(staged, self._pid),
                     param_checksum.checksum(staged))
    with self._cond:
      self._snaps[version] = snap
      self.latest = version
      self._cond.notify_all()
    if self.on_push is not None:
      self.on_push(version)

  def checksum(self, version: int) -> list[int]:
    """The checksums of pushed `version` (host values; waits for their computation)."""
    with self._cond:
      snap = self._snaps[version]
    return [int(c) for c in param_checksum.host(snap.checksum)]

  def local_params(self, version: int | None = None) -> tuple[int, Any]:
    """(version, a fresh copy of this process's replica-layout params of `version`, default the
    newest), for an engine on this process's devices (held-out evaluation)."""
    with self._cond:
      snap = self._snaps[self.latest if version is None else version]
    copy = jax.jit(lambda xs: [jnp.copy(x) for x in xs])(snap.local)
    return snap.version, jax.tree_util.tree_unflatten(self.layout.treedef, copy)

  # ---- log thread -------------------------------------------------------------------------
  def _handle(self, n: int, entry: dict) -> None:
    if entry["kind"] == "retire":
      with self._cond:
        self._retired_below = max(self._retired_below, int(entry["below"]))
        self._free_locked()
      return
    if entry["kind"] != "transfer":
      return
    if entry["sender"] != self._pid:
      transfer(self.layout, entry, None)
      return
    version = int(entry["version"])
    deadline = time.monotonic() + self._cfg.transfer_timeout_s
    with self._cond:
      while version not in self._snaps:
        if self._monitor.error is not None:
          return
        if time.monotonic() > deadline:
          raise TimeoutError(f"version {version} was announced but this process did not push "
                             f"it within {self._cfg.transfer_timeout_s:.0f} s")
        self._cond.wait(_POLL_S)
      snap = self._snaps[version]
      snap.refs += 1
    transfer(self.layout, entry, snap.local)
    self._acks.put((n, version, entry["replica"], time.monotonic()))

  def _free_locked(self) -> None:
    for v in [v for v, s in self._snaps.items()
              if s.refs == 0 and v < self._retired_below and v != self.latest]:
      delete_all(self._snaps.pop(v).staged)

  # ---- ack thread -------------------------------------------------------------------------
  def _ack_loop(self) -> None:
    while self._monitor.error is None:
      try:
        n, version, replica, t0 = self._acks.get(timeout=_POLL_S)
      except queue.Empty:
        continue
      while self._monitor.error is None:
        try:
          ack = self._kv.get(f"ack/{n}", _POLL_S)
          break
        except KVTimeout:
          if time.monotonic() - t0 > self._cfg.transfer_timeout_s:
            self._monitor.report(
                f"{self.layout.topology.name(self.layout.topology.replica_process(replica))} "
                f"did not acknowledge weight version {version} (transfer {n}) within "
                f"{self._cfg.transfer_timeout_s:.0f} s (transfer_timeout_s).")
            return
      else:
        return
      if not ack.get("ok", False):
        logging.warning("weight transfer %d (version %d) to replica %d failed on arrival: %s; "
                        "the replica asks again.", n, version, replica, ack.get("error"))
      with self._cond:
        self._snaps[version].refs -= 1
        self._free_locked()
        self._cond.notify_all()

  def wait_newer(self, have: int, stop: threading.Event) -> None:
    """Blocks until a version newer than `have` was pushed (`latest > have`) or `stop` is set
    (checked every poll interval)."""
    with self._cond:
      while self.latest <= have and not stop.is_set():
        self._cond.wait(_POLL_S)

  def close(self, timeout_s: float) -> None:
    """Waits (up to `timeout_s`) for the log's end and every acknowledgement, then frees every
    copy."""
    deadline = time.monotonic() + timeout_s
    self.log_ended(max(0.0, deadline - time.monotonic()))
    with self._cond:  # the ack thread notifies on every acknowledgement
      self._cond.wait_for(lambda: not any(s.refs for s in self._snaps.values()),
                          max(0.0, deadline - time.monotonic()))
      for snap in self._snaps.values():
        delete_all(snap.staged)
      self._snaps.clear()


class WeightCoordinator:
  """The lead's side of the protocol: answers every replica's requests with the newest version.

  Args:
    sender: the lead's `LearnerSender` (pushed versions and their checksums; its layout's
      digest is announced with every transfer).
    monitor: fault monitor.
  """

  def __init__(self, sender: LearnerSender, monitor: FaultMonitor):
    self.topology, self._sender, self._monitor = sender.layout.topology, sender, monitor
    self._kv, self._digest = KVStore(KV_PREFIX), sender.layout.digest()
    self._lock = threading.RLock()  # orders the log's appends
    self._appended = 0
    self._stop = threading.Event()
    sender.on_push = self._retire
    self._threads = [threading.Thread(target=self._serve, args=(r,), daemon=True,
                                      name=f"rlax_pipe-weights-r{r}")
                     for r in range(self.topology.num_replicas)]
    for t in self._threads:
      t.start()

  def _append(self, entry: dict) -> None:
    with self._lock:
      self._kv.set(f"log/{self._appended}", entry)
      self._appended += 1

  def _retire(self, version: int) -> None:
    if version > 0:
      self._append({"kind": "retire", "below": version})

  def _serve(self, replica: int) -> None:
    m = 0
    sender_pid = replica % self.topology.num_learner_processes
    while not self._stop.is_set() and self._monitor.error is None:
      try:
        have = int(self._kv.get(f"req/{replica}/{m}", _POLL_S)["have"])
      except KVTimeout:
        continue
      self._sender.wait_newer(have, self._stop)
      if self._stop.is_set():
        return
      with self._lock:  # versions in the log never go down (retire entries rely on it)
        version = self._sender.latest
        self._append({
            "kind": "transfer", "version": version, "replica": replica, "sender": sender_pid,
            "request": m, "checksum": self._sender.checksum(version), "layout": self._digest})
      m += 1

  def end(self) -> None:
    """Stops answering and appends the log's "end" entry (after every earlier entry)."""
    self._stop.set()
    for t in self._threads:
      t.join(timeout=5.0)
    self._append({"kind": "end"})


@dataclasses.dataclass
class _Incoming:
  n: int
  entry: dict
  arrays: list[jax.Array]
  t0: float


class ReplicaReceiver(_LogReader):
  """A sampler replica's side: asks for newer versions, receives them while decoding, hands a
  complete version to the engine, acknowledges.

  Args:
    layout: the shared layout.
    monitor: fault monitor.
    cfg: time limits.
  """

  def __init__(self, layout: TransferLayout, monitor: FaultMonitor, cfg: DistributedConfig):
    super().__init__(layout, monitor, cfg)
    self.replica = layout.topology.replica
    self._digest = layout.digest()
    self._lock = threading.Lock()
    self._incoming: _Incoming | None = None
    self._requests = 0
    self.received: list[dict] = []  # per installed version: version, transfer seconds, ...
    self._log_thread.start()

  def request(self, have: int) -> None:
    """Asks the lead for a version newer than `have` (-1: the first one)."""
    self._kv.set(f"req/{self.replica}/{self._requests}", {"have": int(have)})
    self._requests += 1

  def _handle(self, n: int, entry: dict) -> None:
    if entry["kind"] != "transfer":
      return
    arrays = transfer(self.layout, entry, None)
    if entry["replica"] != self.replica:
      return
    if entry["layout"] != self._digest:
      raise RuntimeError(
          f"weight layout mismatch: the learner announces layout {entry['layout']} for version "
          f"{entry['version']}, {self.layout.topology.name()} expects {self._digest} (see the "
          "layout comparison logged at start).")
    with self._lock:
      self._incoming = _Incoming(n, entry, arrays, time.monotonic())

  def poll(self) -> WeightUpdate | None:
    """Non-blocking: the announced version once all its arrays are here (acknowledged then),
    else None. The update carries the learner's checksums: the engine checks them after the
    swap."""
    with self._lock:
      inc = self._incoming
      if inc is None:
        return None
      if not all(a.is_ready() for a in inc.arrays):
        waited = time.monotonic() - inc.t0
        if waited > self._cfg.transfer_timeout_s:
          self._monitor.report(
              f"{self.layout.topology.name()}: weight version {inc.entry['version']} from "
              f"learner process {inc.entry['sender']} did not arrive within {waited:.0f} s.")
        return None
      self._incoming = None
    version = int(inc.entry["version"])
    seconds = time.monotonic() - inc.t0
    self._kv.set(f"ack/{inc.n}", {"ok": True, "replica": self.replica, "version": version,
                                  "seconds": seconds})
    self.received.append({"version": version, "transfer": inc.n, "seconds": seconds,
                          "sender": inc.entry["sender"]})
    return WeightUpdate(version, jax.tree_util.tree_unflatten(self.layout.treedef, inc.arrays),
                        donated=True,
                        checksum=np.asarray(inc.entry["checksum"], np.uint32))

  def drain(self, timeout_s: float) -> None:
    """At the end: acknowledges (and frees) whatever still arrives until the log ends."""
    def drained() -> bool:
      update = self.poll()
      if update is not None:
        delete_all(jax.tree.leaves(update.params))
      return self._monitor.error is not None or (self.log_ended(0.05) and self._incoming is None)
    messages.wait_for(drained, timeout_s, period_s=0.0)
