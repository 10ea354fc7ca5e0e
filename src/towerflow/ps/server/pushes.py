"""The table that applies each push at most once (server side).

What a push says (:class:`~towerflow.ps.wire.messages.PushHeader`) and what
became of it (:class:`~towerflow.ps.wire.messages.PushOutcome`, with the
status codes of :mod:`towerflow.ps.wire.calls`) are the wire contract's, in
:mod:`towerflow.ps.wire.messages`; they are imported here for the shard
modules.

Every push carries ``(worker_id, incarnation, seq)``: the replica that sent
it, that replica's incarnation (a restarted worker takes a larger one: its
start time in nanoseconds) and the push's number within the incarnation. A
:class:`PushTable` keeps, per replica, its newest incarnation, the highest
``seq`` that reached a final outcome and the pushes still in progress, so:

- a retry of a push already answered gets the same answer, not a second update;
- a retry of a push still in progress waits for that push's answer;
- a push cut off before it changed anything (cancelled, its payload short) is
  forgotten, so its retry is handled afresh while older pushes stay answered;
- a push cut off after part of it was applied (an async push is applied chunk
  by chunk: :attr:`Pending.applied` counts the elements) is suspended: its
  retry resumes it and skips the elements applied already, so nothing is
  applied twice; a push refused after part of it was applied keeps its answer
  like a final one (its retry gets the refusal, not a second update);
- a push from a superseded incarnation is refused, naming both incarnations;
- a push from an incarnation more than :data:`INCARNATION_AHEAD_NS` ahead of
  this ps's clock is refused and remembers nothing (an incarnation is a start
  time: no honest worker starts in the future), so no push, even one signed
  with the cluster secret, can claim an incarnation that no honest restart
  would ever exceed. A row with such an incarnation in a checkpoint is
  dropped when it is read back;
- the table is small (one row per replica, at most :data:`MAX_REPLICAS_TRACKED`:
  a push from one more worker id is refused) and travels with the checkpoint
  (:meth:`PushTable.rows` / :meth:`PushTable.merge`), so a ps restarted from
  a checkpoint still refuses the retries of the pushes it had applied.

The table does no locking: its owner (a dense shard's
:class:`~towerflow.ps.server.dense.admission.Admission`, a table shard)
calls it with its own lock held.

Example:
    >>> table = PushTable()
    >>> head = PushHeader(worker_id=0, seq=1, token=0, lr=0.1, numel=4, incarnation=7)
    >>> table.lookup(head).kind, table.register(head)[1]
    ('new', [])
    >>> table.settle(head, PushOutcome(APPLIED, 1))
    True
    >>> table.lookup(head).kind, table.rows()
    ('done', [(0, 7, 1, 'applied')])
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from towerflow.ps.wire.calls import APPLIED, FINAL, REFUSED, STALE, VOIDED
from towerflow.ps.wire.messages import PushHeader, PushOutcome

__all__ = [
    "APPLIED",
    "STALE",
    "REFUSED",
    "VOIDED",
    "PushHeader",
    "PushOutcome",
    "PushTable",
    "Pending",
    "Lookup",
    "LIVENESS_SECONDS",
    "INCARNATION_AHEAD_NS",
    "MAX_REPLICAS_TRACKED",
]

#: most worker ids a push table keeps a row for (the replicas and elastic workers of a job)
MAX_REPLICAS_TRACKED = 4096

#: how far (ns) a push's incarnation (its worker's start time) may be ahead of this ps's clock:
#: the same bound as the clock skew a call's credentials tolerate (300 s)
INCARNATION_AHEAD_NS = 300 * 10**9

#: a push that waits (sync step, ssp bound, a retry of a push in progress; dense or rows)
#: looks this often whether its call is still active, and stops waiting when it is not
LIVENESS_SECONDS = 0.25

@dataclass(slots=True)
class Pending:
    """A push in progress; ``outcome`` is set when it is answered.

    ``applied``: elements of its payload applied so far (a prefix; async);
    ``update``: the optimizer's number of its update (0: not begun);
    ``active``: False while it is suspended (cut off part way, awaiting its retry).
    """

    outcome: PushOutcome | None = None
    applied: int = 0
    update: int = 0
    active: bool = True


@dataclass(slots=True)
class _Replica:
    incarnation: int
    done_seq: int = 0
    outcome: PushOutcome | None = None
    pending: dict[int, Pending] = field(default_factory=dict)


class Lookup(NamedTuple):
    """What the table knows of a push.

    ``kind``: ``new`` (never seen), ``pending`` (in progress: ``pending``),
    ``resume`` (cut off part way: ``pending`` holds how much of it was applied),
    ``done`` (answered: ``outcome``), ``superseded`` (``message`` says by
    which incarnation) or ``refused`` (an incarnation ahead of the clock:
    ``message``).
    """

    kind: str  # new, pending, resume, done, superseded or refused
    pending: Pending | None = None
    outcome: PushOutcome | None = None
    message: str = ""


class PushTable:
    """``(worker, incarnation, seq)`` bookkeeping of one shard (see the module doc)."""

    __slots__ = ("_replicas", "_clock")

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self._replicas: dict[int, _Replica] = {}
        self._clock = clock

    def _latest_incarnation(self) -> int:
        return self._clock() + INCARNATION_AHEAD_NS

    def lookup(self, header: PushHeader, step: int = 0) -> Lookup:
        """Classify ``header``'s push (``step``: the shard's step, for a stale answer)."""
        rec = self._replicas.get(header.worker_id)
        if rec is None or header.incarnation > rec.incarnation:
            if header.incarnation > self._latest_incarnation():
                return Lookup("refused", message=(
                    f"Push {header.seq} of worker {header.worker_id} comes from incarnation "
                    f"{header.incarnation}, more than {INCARNATION_AHEAD_NS // 10**9} s ahead of "
                    f"this ps's clock ({self._clock()} ns): an incarnation is the worker's start "
                    "time; it was refused and not applied. Synchronise the clocks (NTP), or let "
                    "the worker take its default incarnation."))
            if rec is None and len(self._replicas) >= MAX_REPLICAS_TRACKED:
                return Lookup("refused", message=(
                    f"Push {header.seq} of worker {header.worker_id} was refused: this shard "
                    f"already keeps the pushes of {MAX_REPLICAS_TRACKED} worker ids, its bound; "
                    "push with the id of one of the job's replicas (or an elastic worker's)."))
            return Lookup("new")
        if header.incarnation < rec.incarnation:
            return Lookup("superseded", message=(
                f"Push {header.seq} of worker {header.worker_id} comes from its incarnation "
                f"{header.incarnation}, superseded by incarnation {rec.incarnation} (the worker "
                "restarted); it was refused and not applied. Only the newest incarnation of a "
                "worker may push."))
        pending = rec.pending.get(header.seq)
        if pending is not None:
            return Lookup("pending" if pending.active else "resume", pending=pending)
        if header.seq == rec.done_seq and rec.outcome is not None:
            return Lookup("done", outcome=rec.outcome)
        if header.seq < rec.done_seq:
            return Lookup("done", outcome=PushOutcome(STALE, step, (
                f"push {header.seq} of worker {header.worker_id} was superseded by its push "
                f"{rec.done_seq}; it is not applied again")))
        return Lookup("new")

    def register(self, header: PushHeader) -> tuple[Pending, list[tuple[int, int, Pending]]]:
        """Start ``header``'s push (a new incarnation replaces the older one's row).

        Returns its record and the ``(incarnation, seq, record)`` of the pushes
        the replaced row had suspended part applied: no retry resumes them now.
        """
        rec = self._replicas.get(header.worker_id)
        abandoned: list[tuple[int, int, Pending]] = []
        if rec is None or header.incarnation > rec.incarnation:
            if rec is not None:
                abandoned = [(rec.incarnation, seq, p) for seq, p in rec.pending.items()
                             if not p.active and p.applied]
            rec = self._replicas[header.worker_id] = _Replica(header.incarnation)
        pending = rec.pending[header.seq] = Pending()
        return pending, abandoned

    def drop(self, header: PushHeader) -> None:
        """Forget an unanswered push that changed nothing (its retry is handled afresh)."""
        rec = self._replicas.get(header.worker_id)
        if rec is not None and rec.incarnation == header.incarnation:
            rec.pending.pop(header.seq, None)

    def suspend(self, header: PushHeader) -> None:
        """Keep a push cut off part way for its retry to resume (see :class:`Pending`)."""
        rec = self._replicas.get(header.worker_id)
        if rec is not None and rec.incarnation == header.incarnation:
            pending = rec.pending.get(header.seq)
            if pending is not None:
                pending.active = False

    def settle(self, header: PushHeader, outcome: PushOutcome) -> bool:
        """Answer ``header``'s push with ``outcome``; False when it was answered already.

        A refused push is answered but not remembered (its retry is checked
        again), unless part of it was applied: then its retry gets the refusal.
        """
        rec = self._replicas.get(header.worker_id)
        if rec is None or rec.incarnation != header.incarnation:
            return True  # a superseded incarnation's push still in flight
        pending = rec.pending.pop(header.seq, None)
        if pending is None:
            return False  # answered already (a sync step answers all its pushes)
        pending.outcome = outcome
        if (outcome.status in FINAL or pending.applied) and header.seq > rec.done_seq:
            rec.done_seq, rec.outcome = header.seq, outcome
        return True

    def rows(self) -> list[tuple[int, int, int, str]]:
        """``(worker, incarnation, highest answered seq, its status)`` of every replica."""
        return [(w, r.incarnation, r.done_seq, r.outcome.status if r.outcome else APPLIED)
                for w, r in sorted(self._replicas.items())]

    def merge(self, rows: list[tuple[int, int, int, str]], step: int) -> None:
        """Take in ``rows`` (from a checkpoint or a replaced shard); newer facts win.

        A row whose incarnation is ahead of the clock (no honest push could have
        made it) is dropped, so it cannot lock its replica out.
        """
        latest = self._latest_incarnation()
        for worker, incarnation, seq, status in rows:
            if incarnation > latest:
                continue
            rec = self._replicas.get(worker)
            if rec is None and len(self._replicas) >= MAX_REPLICAS_TRACKED:
                continue
            if rec is not None and (rec.incarnation, rec.done_seq) >= (incarnation, seq):
                continue
            if rec is None or incarnation > rec.incarnation:
                rec = self._replicas[worker] = _Replica(incarnation)
            rec.done_seq = seq
            rec.outcome = PushOutcome(status if status in (*FINAL, REFUSED) else APPLIED, step,
                                      "answered before the ps was restored")

    def __len__(self) -> int:
        return len(self._replicas)
