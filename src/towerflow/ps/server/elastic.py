"""The elastic workers of one ps shard: who joined an asynchronous job, and who left.

An elastic worker is a process that holds the cluster and its credentials
but has no task of its own in the ``ClusterSpec``. It joins a running
``async`` job with the ps service's ``Join`` call (the call sequence is in
:mod:`towerflow.ps.wire.calls`):

- **ids**: ps task 0 gives each joining worker the next id counted up from
  :data:`~towerflow.ps.wire.calls.ELASTIC_BASE` (ids below it are the
  cluster's replicas, so the two never clash, and one ps task never gives
  an id twice), with a random 128-bit ticket; the worker then names that id
  and ticket in its ``Join`` to every other ps task, which admits an id it
  does not hold only once ps task 0 confirms that it gave it, with that
  ticket, to that worker (a ``Join`` naming the id at ps task 0, which
  refuses any id it did not give). A ``Join`` sent again (its reply was
  lost) is answered with the same id. No ``Join`` moves ps task 0's count
  but its own giving, so no id named by a caller can use the ids up.
- **bounded**: a shard admits at most ``max_elastic_workers`` (the chief's
  :class:`~towerflow.ps.wire.messages.AggregationConfig`) at once. A member that
  has sent nothing for :data:`EXPIRY_SECONDS` (it died without ``Done``)
  gives its place up when a ``Join`` needs it, and is retired.
- **only async**: a sync step averages a fixed number of replicas' gradients
  and the ssp bound waits for a fixed set of replicas, so their shards refuse
  ``Join``.
- **leaving**: ``Done`` carrying the id's ticket retires the id (a ``Done``
  without it is refused, so no worker stops another): a later push from it
  is refused, as a push from an id that never joined is. The shard remembers the newest
  :data:`RETIRED_KEPT` retired members for the live view.

The job's end is not theirs: a ps task ends when the cluster's replicas
have finished (:mod:`towerflow.ps.server.lifecycle`), whether elastic workers are
still pushing or not; their next call then fails (the ps is gone).

Example:
    >>> from towerflow.ps.wire import ps_pb2 as pb
    >>> from towerflow.ps.wire.messages import AggregationConfig
    >>> members = ElasticMembers(0)
    >>> member, count = members.join(pb.JoinRequest(name="spare:42"), AggregationConfig())
    >>> member.worker_id, count, member.worker_id in members
    (1048576, 1, True)
    >>> members.leave(member.worker_id, member.ticket), member.worker_id in members
    (True, False)
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from towerflow.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from towerflow.ps.wire.calls import ELASTIC_BASE, ELASTIC_LIMIT, bounded
from towerflow.ps.wire.messages import AggregationConfig

__all__ = ["ElasticMembers", "Member", "EXPIRY_SECONDS", "RETIRED_KEPT", "confirm_with_task0"]

#: a member silent this long gives its place up when a Join needs it
EXPIRY_SECONDS = 300.0
#: retired members a shard remembers (for the live view)
RETIRED_KEPT = 256
#: characters of a worker's name a shard keeps
_NAME_LIMIT = 200

_WHY_FIXED = {
    "sync": "a sync step averages the gradients of a fixed number of replicas",
    "ssp": "the ssp staleness bound waits for a fixed set of replicas",
}


@dataclass(slots=True)
class Member:
    """One elastic worker as a shard knows it.

    Attributes:
        worker_id: its id (from ``ELASTIC_BASE`` up).
        name: the name its ``Join`` gave (e.g. ``host:pid``).
        incarnation: the incarnation its ``Join`` gave.
        joined: ``time.monotonic()`` of its ``Join``.
        last_seen: ``time.monotonic()`` of its last ``Join`` or push.
        left: how it left ("" while a member; "done", or "expired").
    """

    worker_id: int
    name: str
    incarnation: int
    joined: float
    last_seen: float
    left: str = ""
    ticket: bytes = field(default=b"", repr=False)


class ElasticMembers:
    """The elastic workers of one shard (see the module doc); safe across threads.

    Args:
        shard_index: this ps task's index (task 0 gives the ids).
        expiry: seconds of silence after which a member gives its place up.
        confirm: on a ps task other than 0, ``confirm(request)`` asks ps task 0
            whether it gave the request's id and ticket to that worker (raises
            when not); without it such a task admits no id it does not hold.
    """

    def __init__(self, shard_index: int, expiry: float = EXPIRY_SECONDS,
                 confirm: Callable[[Any], None] | None = None) -> None:
        self.shard_index = shard_index
        self.expiry = expiry
        self.confirm = confirm
        self._lock = threading.Lock()
        self._next = ELASTIC_BASE
        self._members: dict[int, Member] = {}
        self._left: OrderedDict[int, Member] = OrderedDict()

    def __contains__(self, worker_id: object) -> bool:
        """Whether ``worker_id`` is an admitted member now (one dict lookup, no lock)."""
        return worker_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    def known(self, worker_id: int) -> Member | None:
        """The member (admitted or retired and remembered) of ``worker_id``, or None."""
        return self._members.get(worker_id) or self._left.get(worker_id)

    def entries(self) -> list[Member]:
        """Every admitted and remembered retired member, by id."""
        with self._lock:
            return sorted((*self._members.values(), *self._left.values()),
                          key=lambda m: m.worker_id)

    def join(self, request: Any, config: AggregationConfig | None) -> tuple[Member, int]:
        """Admit the worker of ``request`` (a ``JoinRequest``); ``(its member, members now)``.

        Args:
            request: ``worker_id`` (0: ps task 0 gives one), ``name``, ``incarnation``.
            config: the shard's aggregation (None: not initialised yet).

        Raises:
            FailedPreconditionError: the shard is not initialised, or not async.
            InvalidArgumentError: a bad name or id, an id held by another
                worker or retired, or an id asked of a ps task other than 0.
            ResourceExhaustedError: ``max_elastic_workers`` are members already.
        """
        name = _check_name(request.name)
        where = f"ps shard {self.shard_index}"
        if config is None:
            raise FailedPreconditionError(
                f"Join of elastic worker {name!r} was refused: {where} is not initialised yet; "
                "an elastic worker joins a running job: wait until Status says it is initialised.")
        if config.mode != "async":
            raise FailedPreconditionError(
                f"Join of elastic worker {name!r} was refused: {where} trains in {config.mode} "
                f"mode, where {_WHY_FIXED[config.mode]} (total_num_replicas="
                f"{config.total_num_replicas}), so workers cannot come and go. Add the worker to "
                "the cluster as a task and restart the job, or train the job with mode='async'.")
        with self._lock:
            known = self._again(request, name) is not None
        if not known and request.worker_id != 0:
            self._confirmed(request, name)  # outside the lock: a call to ps task 0
        now = time.monotonic()
        with self._lock:
            member = self._again(request, name)
            if member is None:
                worker_id = self._new_id(request.worker_id, name)
                self._make_room(config.max_elastic_workers, name, now)
                ticket = secrets.token_bytes(16) if request.worker_id == 0 else request.ticket
                member = Member(worker_id, name, int(request.incarnation), now, now,
                                ticket=ticket)
                self._members[worker_id] = member
                if request.worker_id == 0:
                    self._next += 1
            member.last_seen = now
            return member, len(self._members)

    def _confirmed(self, request: Any, name: str) -> None:
        """Raise unless ps task 0 confirms it gave ``request``'s id and ticket to this worker."""
        worker_id = int(request.worker_id)
        if not ELASTIC_BASE <= worker_id < ELASTIC_LIMIT:
            return  # refused by _new_id with the range
        if self.shard_index == 0 or self.confirm is None:
            raise InvalidArgumentError(
                f"Join of elastic worker {name!r} as {worker_id} was refused: ps task "
                f"{self.shard_index} did not give that id (or it was given to another worker, "
                "or left); ask ps task 0 for an id (worker_id 0).")
        try:
            self.confirm(request)
        except Exception as exc:  # noqa: BLE001 - any failure to confirm is a refusal
            raise InvalidArgumentError(
                f"Join of elastic worker {name!r} as {worker_id} was refused: ps task 0 did not "
                f"confirm that it gave this id and ticket to this worker ({bounded(str(exc), 300)});"
                " ask ps task 0 for an id (worker_id 0) and name it with its ticket.") from None

    def seen(self, worker_id: int) -> None:
        """A member pushed (keeps it from expiring); no-op for another id."""
        member = self._members.get(worker_id)
        if member is not None:
            member.last_seen = time.monotonic()

    def leave(self, worker_id: int, ticket: bytes, how: str = "done") -> bool:
        """Retire member ``worker_id`` (its ``Done``, with its ticket); False when it is no member.

        Raises:
            InvalidArgumentError: ``ticket`` is not the member's (another worker's ``Done``).
        """
        with self._lock:
            member = self._members.get(worker_id)
            if member is None:
                return False
            if not hmac.compare_digest(member.ticket, bytes(ticket)):
                raise InvalidArgumentError(
                    f"Done for elastic worker {worker_id} ({member.name!r}) was refused: it does "
                    "not carry the ticket ps task 0 gave that worker, so it is not that worker's; "
                    "a worker says Done for its own id only.")
            del self._members[worker_id]
            self._retire(member, how)
            return True

    # -- under the lock -------------------------------------------------------------------
    def _again(self, request: Any, name: str) -> Member | None:
        """The member a repeated ``Join`` names (its reply was lost), or None for a new one."""
        worker_id, incarnation = int(request.worker_id), int(request.incarnation)
        if worker_id == 0:  # ps task 0: the same worker asking again
            return next((m for m in self._members.values()
                         if m.name == name and m.incarnation == incarnation), None)
        held = self._members.get(worker_id)
        if held is not None:
            if ((held.name, held.incarnation) == (name, incarnation)
                    and hmac.compare_digest(held.ticket, bytes(request.ticket))):
                return held
            raise InvalidArgumentError(
                f"Join of elastic worker {name!r} as {worker_id} was refused: that id is held by "
                f"elastic worker {held.name!r} (its name, incarnation and ticket must match); "
                "ask ps task 0 for an id (worker_id 0).")
        if worker_id in self._left:
            raise InvalidArgumentError(
                f"Join of elastic worker {name!r} as {worker_id} was refused: worker {worker_id} "
                "has left the job; a worker that joins again asks ps task 0 for a new id.")
        return None

    def _new_id(self, worker_id: int, name: str) -> int:
        if worker_id == 0:
            if self.shard_index != 0:
                raise InvalidArgumentError(
                    f"Join of elastic worker {name!r} was refused: ps task "
                    f"{self.shard_index} admits an elastic worker under the id ps task 0 gave "
                    "it; call Join on ps task 0 first, then here with that worker_id.")
            if self._next >= ELASTIC_LIMIT:
                raise ResourceExhaustedError(
                    f"Join of elastic worker {name!r} was refused: ps task 0 has given every "
                    "elastic worker id; restart the job to count them from the start again.")
            return self._next
        if not ELASTIC_BASE <= worker_id < ELASTIC_LIMIT:
            raise InvalidArgumentError(
                f"Join of elastic worker {name!r} as {worker_id} was refused: elastic worker "
                f"ids are {ELASTIC_BASE} .. {ELASTIC_LIMIT - 1}, as ps task 0 gives them; ask "
                "it for one (worker_id 0).")
        return worker_id

    def _make_room(self, limit: int, name: str, now: float) -> None:
        """Retire silent members while the shard is full; raise if it stays full."""
        if len(self._members) < limit:
            return
        for member in sorted(self._members.values(), key=lambda m: m.last_seen):
            if len(self._members) < limit or now - member.last_seen <= self.expiry:
                break
            del self._members[member.worker_id]
            self._retire(member, "expired")
        if len(self._members) >= limit:
            held = ", ".join(f"{m.worker_id} ({m.name})" for m in self._members.values())
            raise ResourceExhaustedError(
                f"Join of elastic worker {name!r} was refused: ps shard {self.shard_index} admits "
                f"at most {limit} elastic worker(s) at once (max_elastic_workers={limit})"
                f"{', and holds ' + bounded(held, 300) if held else ''}. Wait for one to leave, "
                "or raise the cap with the chief's ParameterServer(max_elastic_workers=N).")

    def _retire(self, member: Member, how: str) -> None:
        member.left = how
        self._left[member.worker_id] = member
        while len(self._left) > RETIRED_KEPT:
            self._left.popitem(last=False)


def _check_name(name: str) -> str:
    if not name or not name.isprintable():
        raise InvalidArgumentError(
            f"Join needs the worker's name for the live view (printable, e.g. host:pid), got "
            f"{bounded(repr(name), 100)}.")
    return name[:_NAME_LIMIT]


def confirm_with_task0(channel: Callable[[], Any], timeout: float = 10.0) -> Callable[[Any], None]:
    """The ``confirm`` of a ps task other than 0: a ``Join`` naming the id, sent to ps task 0.

    Ps task 0 answers it only for an id it gave, to the same name, incarnation
    and ticket (see :meth:`ElasticMembers.join`); ``channel()`` gives an
    authenticated channel to it.
    """

    def confirm(request: Any) -> None:
        from towerflow.cluster.transport import unary
        from towerflow.ps.wire import ps_pb2 as pb
        from towerflow.ps.wire.calls import method_path
        from towerflow.ps.wire.messages import parse_message

        data = unary(channel(), method_path("Join"), request.SerializeToString(), timeout=timeout)
        reply = parse_message(pb.JoinReply, data, "JoinReply")
        if reply.worker_id != request.worker_id:
            raise InvalidArgumentError(f"ps task 0 answered with id {reply.worker_id}")

    return confirm
