"""The messages between the learner lead and the other processes: a tagged union of frozen types.

Every message is one frozen dataclass whose class attribute `KIND` is its tag on the wire. The
wire format is the process links' (`rlax_pipe.cluster.links`): a pickled pair `(kind, payload)`;
here the payload is the message itself and the kind its tag (`wire`). Unpickling does not run
`__post_init__`, so the receiver checks each message again (`received`). Who sends which:
`TO_REPLICA`, `TO_LEARNER`, `TO_LEAD` (and each message's docstring).
"""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Any, Callable, ClassVar, TypeVar, Union

from rlax_pipe.cluster import FaultMonitor
from rlax_pipe.types import Rollout

T = TypeVar("T")


class ProtocolError(RuntimeError):
  """A message that is not what the receiver expects (wrong tag, type or field)."""


def _tuple_of(ok: Callable[[Any], bool] = lambda _: True) -> Callable[[Any], bool]:
  """A field check: the value is a tuple whose every item passes `ok`."""
  return lambda v: isinstance(v, tuple) and all(ok(x) for x in v)


@dataclasses.dataclass(frozen=True)
class _Message:
  """A message's tag and shared check: `KIND` is the class name in lower case unless the class
  sets it; `CHECKS` lists (field, predicate, what the field must be)."""
  KIND: ClassVar[str]
  CHECKS: ClassVar[tuple[tuple[str, Callable[[Any], bool], str], ...]] = ()

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    cls.KIND = cls.__dict__.get("KIND", cls.__name__.lower())

  def validate(self) -> None:
    """Raises ProtocolError naming the first field that fails its check in `CHECKS`."""
    for name, ok, what in self.CHECKS:
      value = getattr(self, name)
      if not ok(value):
        raise ProtocolError(f"{type(self).__name__} message: {name} must be {what}, got "
                            f"{value!r:.200}.")


@dataclasses.dataclass(frozen=True)
class Init(_Message):
  """Lead -> replica, once: the replica's sampling keys (`replica.replica_keys`'s input; None or
  the proxy's key data, not checked)."""
  rng: Any


@dataclasses.dataclass(frozen=True)
class Submit(_Message):
  """Lead -> replica: sample requests to start (`types.SampleRequest` or env episodes)."""
  CHECKS = (("requests", lambda v: _tuple_of()(v) and len(v) > 0, "a non-empty tuple"),)
  requests: tuple


@dataclasses.dataclass(frozen=True)
class Abort(_Message):
  """Lead -> replica: sample ids to abort (their aborted Rollouts come back in `Rollouts`)."""
  KIND: ClassVar[str] = "abort_samples"  # "abort" is the links' own (a fault)
  CHECKS = (("sample_ids", _tuple_of(lambda s: isinstance(s, int)), "a tuple of int"),)
  sample_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Stop(_Message):
  """Lead -> replica: finish (send the last rollouts, records and `Done`)."""


@dataclasses.dataclass(frozen=True)
class Train(_Message):
  """Lead -> learner follower: the groups of one learner step (the lead trains the same)."""
  CHECKS = (("groups", _tuple_of(), "a tuple"),)
  groups: tuple


@dataclasses.dataclass(frozen=True)
class End(_Message):
  """Lead -> learner follower: no more steps (send the last records and `Done`)."""


@dataclasses.dataclass(frozen=True)
class Rollouts(_Message):
  """Replica -> lead: finished (or aborted) samples and the replica's status dict."""
  CHECKS = (("rollouts", _tuple_of(lambda r: isinstance(r, Rollout)), "a tuple of types.Rollout"),
            ("status", lambda v: isinstance(v, dict), "a dict"))
  rollouts: tuple[Rollout, ...]
  status: dict


@dataclasses.dataclass(frozen=True)
class Spans(_Message):
  """Any process -> lead: timeline spans, each the 6 arguments of `Timeline.record`."""
  CHECKS = (("spans", _tuple_of(lambda s: isinstance(s, tuple) and len(s) == 6),
             "a tuple of 6-tuples (lane, name, t0, t1, sample id, detail)"),)
  spans: tuple[tuple, ...]


@dataclasses.dataclass(frozen=True)
class Rows(_Message):
  """Any process -> lead: record rows (dicts with a "kind") for the run directory."""
  CHECKS = (("rows", _tuple_of(lambda r: isinstance(r, dict)), "a tuple of dict"),)
  rows: tuple[dict, ...]


@dataclasses.dataclass(frozen=True)
class Costs(_Message):
  """Replica -> lead, before `Done`: the replica's timed operations for the run's cost model.

  `records` are `costs.CostRecord.to_dict()` dicts (op, duration_s, start_s, features) and
  `compiles` the (start, end) intervals in which XLA compiled on the replica, both on the lead's
  clock (the replica's perf_counter + the link's offset), so the lead's `CostRecorder` flags
  every record that overlapped a compile in any process (`CostRecorder.records`).
  """
  CHECKS = (("records", _tuple_of(lambda r: isinstance(r, dict) and {"op", "duration_s"} <= set(r)),
             "a tuple of CostRecord.to_dict() dicts (op, duration_s, ...)"),
            ("compiles", _tuple_of(lambda c: isinstance(c, tuple) and len(c) == 2
                                   and all(isinstance(x, (int, float)) for x in c)),
             "a tuple of (start_s, end_s) pairs"))
  records: tuple[dict, ...]
  compiles: tuple[tuple[float, float], ...]


@dataclasses.dataclass(frozen=True)
class Done(_Message):
  """Any process -> lead: this process has sent its last message."""


Message = Union[Init, Submit, Abort, Stop, Train, End, Rollouts, Spans, Rows, Costs, Done]
TO_REPLICA: tuple[type, ...] = (Init, Submit, Abort, Stop)
TO_LEARNER: tuple[type, ...] = (Train, End)
TO_LEAD: tuple[type, ...] = (Rollouts, Spans, Rows, Costs, Done)
MESSAGES: tuple[type, ...] = TO_REPLICA + TO_LEARNER + TO_LEAD


def wire(msg: Message) -> tuple[str, Message]:
  """`(kind, payload)` for a link's `send`: the message's tag and the message, checked first.

  Raises:
    ProtocolError: `msg` is not a message type or a field has the wrong type.
  """
  if not isinstance(msg, MESSAGES):
    raise ProtocolError(f"{type(msg).__name__} is not a multihost message; use one of "
                        f"{[m.__name__ for m in MESSAGES]}.")
  msg.validate()
  return msg.KIND, msg


def received(kind: str, payload: Any, expected: tuple[type, ...]) -> Message:
  """The message of a received `(kind, payload)` pair, checked.

  Args:
    kind: the tag read from the link.
    payload: the unpickled message.
    expected: the message types this receiver handles (e.g. `TO_REPLICA`).

  Raises:
    ProtocolError: the payload is not a message, its tag is not `kind`, its type is not in
      `expected`, or a field has the wrong type.
  """
  if not isinstance(payload, MESSAGES) or payload.KIND != kind:
    raise ProtocolError(f"received kind {kind!r} with a {type(payload).__name__} payload; "
                        "every message is a multihost.messages type sent with `wire`.")
  if not isinstance(payload, expected):
    raise ProtocolError(f"received a {type(payload).__name__} message here; this process "
                        f"handles only {[m.__name__ for m in expected]}.")
  payload.validate()
  return payload


def receive(inbox: queue.Queue, expected: tuple[type, ...], timeout_s: float = 0.0
            ) -> Message | None:
  """The next message in a `Link`'s `inbox`, checked as `received` does.

  Args:
    inbox: the link's queue of `(kind, payload)` pairs.
    expected: the message types this receiver handles.
    timeout_s: seconds to wait for a message (0: take one only if it is there).

  Returns:
    The message, or None when none came within `timeout_s`.

  Raises:
    ProtocolError: as `received`.
  """
  try:
    kind, payload = inbox.get(timeout=timeout_s)
  except queue.Empty:
    return None
  return received(kind, payload, expected)


def wait_for(ready: Callable[[], T], timeout_s: float, monitor: FaultMonitor | None = None,
             period_s: float = 0.01) -> T | None:
  """Polls `ready()` until it returns a true value or `timeout_s` has passed.

  Args:
    ready: called once per poll, on the calling thread.
    timeout_s: the limit, seconds.
    monitor: when given, checked before every poll (a fault of the job ends the wait).
    period_s: seconds slept between polls (0 when `ready` itself blocks a while).

  Returns:
    The first true value `ready()` returned, or None at the limit.

  Raises:
    ProcessFault: from `monitor.check()`, before every call, once the job failed.
  """
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if monitor is not None:
      monitor.check()
    value = ready()
    if value:
      return value
    time.sleep(period_s)
  return None
