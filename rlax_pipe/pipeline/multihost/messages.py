"""The messages between the learner lead and the other processes: a tagged union of frozen types.

Every message is one frozen dataclass whose class attribute `KIND` is its tag on the wire. The
wire format is the process links' (`rlax_pipe.cluster.links`): a pickled pair `(kind, payload)`;
here the payload is the message itself and the kind its tag (`wire`). Unpickling does not run
`__post_init__`, so the receiver checks each message again (`received`): the tag must name the
payload's type, the type must be one the receiver expects, and the fields must have their types.

Lead -> sampler replica: `Init`, `Submit`, `Abort`, `Stop`.
Lead -> learner follower: `Train`, `End`.
Any process -> lead: `Rollouts` (replicas), `Spans`, `Rows`, `Costs` (replicas), `Done`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Union

from rlax_pipe.types import Rollout


class ProtocolError(RuntimeError):
  """A message that is not what the receiver expects (wrong tag, type or field)."""


def _check(ok: bool, msg: "Message", what: str) -> None:
  if not ok:
    raise ProtocolError(f"{type(msg).__name__} message: {what}.")


@dataclasses.dataclass(frozen=True)
class Init:
  """Lead -> replica, once: the replica's sampling keys (`replica.replica_keys`'s input)."""
  KIND: ClassVar[str] = "init"
  rng: Any

  def validate(self) -> None:
    """No field constraint: `rng` is None or the proxy's key data."""


@dataclasses.dataclass(frozen=True)
class Submit:
  """Lead -> replica: sample requests to start (`types.SampleRequest` or env episodes)."""
  KIND: ClassVar[str] = "submit"
  requests: tuple

  def validate(self) -> None:
    """Raises ProtocolError unless `requests` is a non-empty tuple."""
    _check(isinstance(self.requests, tuple) and len(self.requests) > 0, self,
           f"requests must be a non-empty tuple, got {type(self.requests).__name__}")


@dataclasses.dataclass(frozen=True)
class Abort:
  """Lead -> replica: sample ids to abort (their aborted Rollouts come back in `Rollouts`)."""
  KIND: ClassVar[str] = "abort_samples"
  sample_ids: tuple[int, ...]

  def validate(self) -> None:
    """Raises ProtocolError unless `sample_ids` is a tuple of ints."""
    _check(isinstance(self.sample_ids, tuple)
           and all(isinstance(s, int) for s in self.sample_ids), self,
           f"sample_ids must be a tuple of int, got {self.sample_ids!r}")


@dataclasses.dataclass(frozen=True)
class Stop:
  """Lead -> replica: finish (send the last rollouts, records and `Done`)."""
  KIND: ClassVar[str] = "stop"

  def validate(self) -> None:
    """No fields."""


@dataclasses.dataclass(frozen=True)
class Train:
  """Lead -> learner follower: the groups of one learner step (the lead trains the same)."""
  KIND: ClassVar[str] = "train"
  groups: tuple

  def validate(self) -> None:
    """Raises ProtocolError unless `groups` is a tuple."""
    _check(isinstance(self.groups, tuple), self,
           f"groups must be a tuple, got {type(self.groups).__name__}")


@dataclasses.dataclass(frozen=True)
class End:
  """Lead -> learner follower: no more steps (send the last records and `Done`)."""
  KIND: ClassVar[str] = "end"

  def validate(self) -> None:
    """No fields."""


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """Replica -> lead: finished (or aborted) samples and the replica's status dict."""
  KIND: ClassVar[str] = "rollouts"
  rollouts: tuple[Rollout, ...]
  status: dict

  def validate(self) -> None:
    """Raises ProtocolError unless rollouts is a tuple of Rollout and status a dict."""
    _check(isinstance(self.rollouts, tuple)
           and all(isinstance(r, Rollout) for r in self.rollouts), self,
           "rollouts must be a tuple of types.Rollout")
    _check(isinstance(self.status, dict), self,
           f"status must be a dict, got {type(self.status).__name__}")


@dataclasses.dataclass(frozen=True)
class Spans:
  """Any process -> lead: timeline spans, each the 6 arguments of `Timeline.record`."""
  KIND: ClassVar[str] = "spans"
  spans: tuple[tuple, ...]

  def validate(self) -> None:
    """Raises ProtocolError unless every span is a 6-tuple."""
    _check(isinstance(self.spans, tuple)
           and all(isinstance(s, tuple) and len(s) == 6 for s in self.spans), self,
           "spans must be a tuple of 6-tuples (lane, name, t0, t1, sample id, detail)")


@dataclasses.dataclass(frozen=True)
class Rows:
  """Any process -> lead: record rows (dicts with a "kind") for the run directory."""
  KIND: ClassVar[str] = "rows"
  rows: tuple[dict, ...]

  def validate(self) -> None:
    """Raises ProtocolError unless rows is a tuple of dicts."""
    _check(isinstance(self.rows, tuple) and all(isinstance(r, dict) for r in self.rows), self,
           "rows must be a tuple of dict")


@dataclasses.dataclass(frozen=True)
class Costs:
  """Replica -> lead, before `Done`: the replica's timed operations for the run's cost model.

  `records` are `costs.CostRecord.to_dict()` dicts (op, duration_s, start_s, features) and
  `compiles` the (start, end) intervals in which XLA compiled on the replica, both on the lead's
  clock (the replica's perf_counter + the link's offset), so the lead's `CostRecorder` flags
  every record that overlapped a compile in any process (`CostRecorder.records`).
  """
  KIND: ClassVar[str] = "costs"
  records: tuple[dict, ...]
  compiles: tuple[tuple[float, float], ...]

  def validate(self) -> None:
    """Raises ProtocolError unless records are dicts with "op" and "duration_s" and compiles
    (start, end) pairs of numbers."""
    _check(isinstance(self.records, tuple) and all(
        isinstance(r, dict) and "op" in r and "duration_s" in r for r in self.records), self,
        "records must be a tuple of CostRecord.to_dict() dicts (op, duration_s, ...)")
    _check(isinstance(self.compiles, tuple) and all(
        isinstance(c, tuple) and len(c) == 2 and all(isinstance(x, (int, float)) for x in c)
        for c in self.compiles), self, "compiles must be a tuple of (start_s, end_s) pairs")


@dataclasses.dataclass(frozen=True)
class Done:
  """Any process -> lead: this process has sent its last message."""
  KIND: ClassVar[str] = "done"

  def validate(self) -> None:
    """No fields."""


Message = Union[Init, Submit, Abort, Stop, Train, End, Rollouts, Spans, Rows, Costs, Done]
MESSAGES: tuple[type, ...] = (Init, Submit, Abort, Stop, Train, End, Rollouts, Spans, Rows, Costs,
                              Done)
TO_REPLICA: tuple[type, ...] = (Init, Submit, Abort, Stop)
TO_LEARNER: tuple[type, ...] = (Train, End)
TO_LEAD: tuple[type, ...] = (Rollouts, Spans, Rows, Costs, Done)


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
