"""The dense shard's admission: who may push, exactly once, and when.

An :class:`Admission` keeps what a ps shard knows about the pushes it is
sent, apart from the values they change (those are its
:class:`~towerflow.ps.server.dense.store.DenseStore`):

- the step (on ps task 0 the global step): the updates counted so far, which
  a sync push must have computed on and a waiter watches;
- the de-duplication table of pushes
  (:class:`~towerflow.ps.server.pushes.PushTable`): each
  ``(worker, incarnation, seq)`` is applied at most once, its retry gets the
  same answer or continues where it was cut off;
- the staging memory: bytes of pushed chunks being handled, bounded by the
  staging limit;
- the ledger of the pushes in the parameters and the counters a ps reports
  (:mod:`~towerflow.ps.server.dense.records`);
- the condition every wait of a push waits on (its retry's first attempt,
  its sync step, the ssp bound), with the call's liveness and deadline.

A push's header is checked against the layout here, by
:mod:`~towerflow.ps.server.dense.checks`, before the push is registered.

Example:
    >>> from towerflow.ps.placement import plan_placement
    >>> admission = Admission(plan_placement({"w": (2,)}, 1).shards[0])
    >>> admission.commit_update(), admission.step
    (1, 1)
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

from towerflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from towerflow.ps.placement import ShardLayout
from towerflow.ps.server.dense import checks
from towerflow.ps.server.dense.records import LedgerRecord, ShardFigures, ShardStats
from towerflow.ps.server.pushes import LIVENESS_SECONDS, Pending, PushTable
from towerflow.ps.wire.calls import APPLIED, REFUSED, STALE, VOIDED
from towerflow.ps.wire.framing import CHUNK_BYTES
from towerflow.ps.wire.messages import PushHeader, PushOutcome

__all__ = ["Admission", "STAGING_FLOOR", "default_staging_limit"]

#: applied pushes a shard's ledger remembers (the newest; about 13 MiB at most)
LEDGER_CAPACITY = 1 << 16
#: refusal messages a shard keeps for its Status reply (the newest)
REFUSALS_KEPT = 10
#: the least a shard's staging limit ever is (bytes of pushed chunks being handled)
STAGING_FLOOR = 64 << 20


def default_staging_limit(replicas: int) -> int:
    """Bytes of pushed chunks a shard may hold at once while they are handled.

    A push holds one received chunk at a time (checked, applied or summed,
    then freed), so this bounds chunk buffers, not whole pushes: four chunks
    for every replica and two more pushes (a retry overtaking its stalled
    first attempt, a peer's stray call), never less than :data:`STAGING_FLOOR`
    (whatever the shard's size: no push is held whole).
    """
    return max(STAGING_FLOOR, (replicas + 2) * 4 * CHUNK_BYTES)


class Admission:
    """The step, push table, staging, ledger and waits of one ps shard.

    The admission owns its lock and counters; other modules read them through
    :attr:`step`, :attr:`staged`, :attr:`stats` and :meth:`figures` and change
    them only through its methods. An aggregator whose own bookkeeping (a sync
    step's sum, the ssp clocks) must change together with the step holds the
    lock with :meth:`locked`, waits with :meth:`wait_once` and wakes the
    waiters with :meth:`notify`. A range lock of the store
    (:meth:`~towerflow.ps.server.dense.store.DenseStore.ranges`) may be taken
    while this lock is held, never the other way round.

    Args:
        layout: the segments the shard holds (a push's header must match them).
        step: the initial step (restored from a checkpoint, else 0).
        staging_limit: bytes of pushed chunks the shard may hold at once while
            they are handled (default :func:`default_staging_limit` of one replica).
    """

    def __init__(self, layout: ShardLayout, step: int = 0, *,
                 staging_limit: int | None = None) -> None:
        self.layout = layout
        self._step = int(step)
        self._stats = ShardStats()
        #: guards step, stats, the push table and staging; waiters wait on it
        self._cond = threading.Condition(threading.RLock())
        #: the (worker, incarnation, seq) table: each push applied at most once
        self._table = PushTable()
        #: the newest ledger records, oldest first (see :meth:`ledger_since`)
        self._records: deque[LedgerRecord] = deque(maxlen=LEDGER_CAPACITY)
        #: records ever made (the absolute index of the next one)
        self.ledger_total = 0
        self.staging_limit = staging_limit or default_staging_limit(1)
        #: bytes of pushed chunks being handled (received, not yet applied or summed)
        self._staged = 0
        self._expected = layout.signature

    # -- the lock and the counters ---------------------------------------------------
    @property
    def step(self) -> int:
        """The shard's step (on ps task 0 the global step): updates applied."""
        return self._step

    @property
    def staged(self) -> int:
        """Bytes of pushed chunks received and not yet applied or summed."""
        return self._staged

    @property
    def stats(self) -> ShardStats:
        """A copy of the shard's counters, read at once."""
        with self._cond:
            return replace(self._stats, refusals=list(self._stats.refusals))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the admission's lock (reentrant): the step and the counters stay as they are."""
        with self._cond:
            yield

    def notify(self) -> None:
        """Wake every waiter (:meth:`wait_once`); the caller holds :meth:`locked`."""
        self._cond.notify_all()

    def count_bytes_in(self, nbytes: int) -> None:
        """Count ``nbytes`` of pushed payload received (whether applied or not)."""
        with self._cond:
            self._stats.bytes_in += nbytes

    def count_out(self, nbytes: int, whole: bool) -> None:
        """Count ``nbytes`` of a buffer sent (a whole buffer counts as a pull)."""
        with self._cond:
            self._stats.bytes_out += nbytes
            self._stats.pulls += whole

    def record_lead(self, lead: int) -> None:
        """Keep the largest lead (pushes ahead of the slowest replica) seen."""
        with self._cond:
            self._stats.max_lead = max(self._stats.max_lead, lead)

    def merge_pushes(self, rows: Iterable[tuple[int, int, int, str]], step: int) -> None:
        """Take push-table rows (from a checkpoint or a replaced shard) in; newer facts win."""
        with self._cond:
            self._table.merge(list(rows), step)

    def adopt(self, step: int, rows: Iterable[tuple[int, int, int, str]]) -> None:
        """A replica takes its primary's step and push table (newer facts win)."""
        with self._cond:
            self._step = max(self._step, int(step))
            self._table.merge(list(rows), self._step)
            self._cond.notify_all()

    def push_rows(self) -> list[tuple[int, int, int, str]]:
        """The push table: ``(worker, incarnation, highest answered seq, its status)``."""
        with self._cond:
            return self._table.rows()

    def figures(self, optimizer_step: int) -> ShardFigures:
        """The step, counters, staging and push table, read together (with the store's
        ``optimizer_step``)."""
        with self._cond:
            return ShardFigures(self._step, optimizer_step, self._stats.as_dict(),
                                tuple(self._stats.refusals), self._staged,
                                tuple(self._table.rows()))

    def commit_update(self) -> int:
        """Count one applied update; return the new step (waking waiters)."""
        with self._cond:
            self._step += 1
            self._stats.updates += 1
            self._cond.notify_all()
            return self._step

    # -- staging ------------------------------------------------------------------
    @contextlib.contextmanager
    def holding(self, nbytes: int, who: str) -> Iterator[None]:
        """Count a received chunk of ``nbytes`` against the staging limit while it is handled."""
        self.reserve(nbytes, who)
        try:
            yield
        finally:
            self.release(nbytes)

    def reserve(self, nbytes: int, who: str) -> None:
        """Count ``nbytes`` more of received chunks held before they are applied or summed.

        Raises:
            ResourceExhaustedError: the shard's staging limit would be exceeded.
        """
        with self._cond:
            if self._staged + nbytes > self.staging_limit:
                raise ResourceExhaustedError(
                    f"ps shard {self.layout.index} holds {self._staged} bytes of pushed chunks "
                    f"being handled; {nbytes} more from {who} would pass its staging limit of "
                    f"{self.staging_limit} bytes. The push stopped there; retry it (its retry "
                    "continues where it stopped)."
                )
            self._staged += nbytes

    def release(self, nbytes: int) -> None:
        """Chunk bytes applied, summed or dropped."""
        with self._cond:
            self._staged -= nbytes

    # -- push bookkeeping ---------------------------------------------------------
    def begin_push(self, header: PushHeader, timeout: float | None,
                   active: Callable[[], bool] | None = None) -> PushOutcome | Pending:
        """Check ``header`` against the push table and the layout; register the push.

        Returns:
            The earlier outcome (``duplicate``) when this push was answered
            already (a retry: the gradient is not applied twice), after waiting
            for it when it is still in progress; the suspended push's
            :class:`~towerflow.ps.server.pushes.Pending` record when it was cut
            off part way (the retry resumes it after ``pending.applied``
            elements); else the new push's record.

        Raises:
            InvalidArgumentError: a superseded incarnation, or a header that
                does not match the layout (nothing is registered).
            DeadlineExceededError: a retry whose first attempt is still in
                progress after ``timeout`` seconds (None: no limit), or whose
                call ended meanwhile (``active``: see :meth:`wait_once`).
        """
        deadline = self.deadline(timeout)
        with self._cond:
            while True:
                found = self._table.lookup(header, self._step)
                if found.kind in ("superseded", "refused"):
                    raise InvalidArgumentError(found.message)
                if found.kind == "done":
                    self._stats.duplicates += 1
                    return replace(found.outcome, duplicate=True)
                if found.kind == "resume":  # cut off part way: this retry continues it
                    self.validate_header(header)
                    found.pending.active = True
                    return found.pending
                if found.kind == "new":
                    break
                self.wait_once(deadline, lambda: (
                    f"Push {header.seq} of worker {header.worker_id} is a retry of a push still "
                    f"in progress on shard {self.layout.index} after {timeout:.0f} s; retry "
                    "later."), active)
            self.validate_header(header)
            self._stats.pushes += 1
            pending, abandoned = self._table.register(header)
            for incarnation, seq, cut in abandoned:  # its worker restarted: part applied
                self._records.append(LedgerRecord(
                    header.worker_id, incarnation, seq, self._step, partial=True,
                    applied_stop=cut.applied))
                self.ledger_total += 1
            return pending

    @staticmethod
    def deadline(timeout: float | None) -> float | None:
        """The monotonic time ``timeout`` seconds from now (None: no deadline)."""
        return None if timeout is None else time.monotonic() + timeout

    def wait_once(self, deadline: float | None, message: Callable[[], str],
                  active: Callable[[], bool] | None = None, most: float | None = None) -> None:
        """Wait on the condition once (caller holds it) or raise DeadlineExceededError.

        ``active()`` says whether the call that waits is still going (its gRPC
        context's ``is_active``); once it has ended (its caller's deadline
        passed, or the caller went away) the wait stops, so it holds no handler
        thread for nobody. What it waited for still happens: a sync step
        answers the push in the push table, and the retry gets that answer.
        ``most``: seconds this wait lasts at most (the caller looks again).
        """
        if active is not None and not active():
            raise DeadlineExceededError(
                f"A call waiting on ps shard {self.layout.index} ended (its caller's deadline "
                "passed, or it went away); its retry gets the answer.")
        slice_ = None if active is None else LIVENESS_SECONDS
        if most is not None:
            slice_ = most if slice_ is None else min(slice_, most)
        if deadline is None:
            self._cond.wait(slice_)
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceededError(message())
        self._cond.wait(remaining if slice_ is None else min(remaining, slice_))

    def wait_outcome(self, pending: Pending, timeout: float | None,
                     message: Callable[[], str],
                     active: Callable[[], bool] | None = None) -> PushOutcome:
        """Wait until ``pending`` is answered (a sync step completes it); ``active``: see
        :meth:`wait_once` (the push stays in its step and in the push table)."""
        deadline = self.deadline(timeout)
        with self._cond:
            while pending.outcome is None:
                self.wait_once(deadline, message, active)
            return pending.outcome

    def drop_push(self, header: PushHeader) -> None:
        """A push cut off before it changed anything: forget it, so its retry is handled afresh."""
        with self._cond:
            self._table.drop(header)
            self._cond.notify_all()

    def suspend_push(self, header: PushHeader, pending: Pending) -> None:
        """A push cut off: forget it when nothing of it was applied, else keep it for its
        retry to resume after ``pending.applied`` elements (nothing is applied twice)."""
        with self._cond:
            if pending.applied:
                self._table.suspend(header)
            else:
                self._table.drop(header)
            self._cond.notify_all()

    def refuse(self, outcome: PushOutcome) -> PushOutcome:
        """Count a refusal that registered nothing; keep its (bounded) message."""
        with self._cond:
            self._stats.refused += 1
            self._stats.refusals = [*self._stats.refusals[-(REFUSALS_KEPT - 1):], outcome.message]
        return outcome

    def finish_push(self, header: PushHeader, outcome: PushOutcome,
                    applied: int = 0) -> PushOutcome:
        """Answer ``header``'s push with ``outcome`` (answers its retries); return it.

        An answer given already (a sync step answers all its pushes) is not
        counted again. ``applied``: elements of a refused push applied before
        it was refused (its ledger record is then partial).
        """
        with self._cond:
            if not self._table.settle(header, outcome):
                return outcome
            if outcome.status == APPLIED or applied:
                self._stats.applied += outcome.status == APPLIED
                partial = outcome.status != APPLIED
                self._records.append(LedgerRecord(
                    header.worker_id, header.incarnation, header.seq, outcome.step,
                    partial=partial, applied_stop=applied if partial else self.layout.numel))
                self.ledger_total += 1
            if outcome.status == REFUSED:
                self.refuse(outcome)
            elif outcome.status == STALE:
                self._stats.stale += 1
            elif outcome.status == VOIDED:
                self._stats.voided += 1
            self._cond.notify_all()
        return outcome

    @property
    def ledger(self) -> list[tuple[int, int, int, int]]:
        """``(worker_id, incarnation, seq, step)`` of each push in the parameters, oldest first
        (applied, or part applied: :meth:`ledger_since` tells which).

        Of the newest :data:`LEDGER_CAPACITY` records.
        """
        with self._cond:
            return [(r.worker_id, r.incarnation, r.seq, r.step) for r in self._records]

    def ledger_since(self, since: int) -> tuple[int, list[LedgerRecord]]:
        """``(index of the first record returned, records)`` of the ledger from ``since`` on.

        Records are in the order the pushes were applied. Records older than
        the newest :data:`LEDGER_CAPACITY` are forgotten; the returned index
        then exceeds ``since``.
        """
        with self._cond:
            first = self.ledger_total - len(self._records)
            start = max(first, since)
            return start, list(itertools.islice(self._records, start - first, None))

    def validate_header(self, header: PushHeader) -> None:
        """Raise :class:`InvalidArgumentError` unless the push matches the layout
        (:func:`~towerflow.ps.server.dense.checks.check_header`)."""
        checks.check_header(self.layout, self._expected, header)
