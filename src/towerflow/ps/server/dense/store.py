"""The state one ps task keeps: a flat parameter buffer and what updates it.

A :class:`ShardState` holds the parameters of the variables placed on this ps
task in **one contiguous float32 buffer** (layout in
:class:`~towerflow.ps.placement.ShardLayout`), the server-side optimizer and
its state buffers, the step counter (on ps task 0 it is the global step), the
de-duplication table of pushes, and the counters a ps reports
(:mod:`~towerflow.ps.server.dense.records`); a push's header is checked
against the layout by :mod:`~towerflow.ps.server.dense.checks`.

The buffer is guarded by one lock per partition of :data:`PARTITION`
elements, not by one lock for the shard: an update, a sum into a sync
accumulator or a pull's copy of a range takes the locks of that range only
(in ascending order), so several workers' pushes to one shard proceed side by
side and each range a pull copies is never half updated.

Everything here is plain numpy and threads, so the shard logic is tested
in-process; :mod:`towerflow.ps.server.dense.service` puts it behind gRPC.

Example:
    >>> import numpy as np
    >>> from towerflow.ps.placement import plan_placement
    >>> from towerflow.ps.server.dense.optimizers import make_optimizer
    >>> layout = plan_placement({"w": (2,)}, 1).shards[0]
    >>> state = ShardState(layout, np.zeros(2, np.float32), make_optimizer("sgd", 2))
    >>> state.apply(np.ones(2, np.float32), lr=0.5)
    1
    >>> state.params.tolist()
    [-0.5, -0.5]
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace

import numpy as np

from towerflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from towerflow.ps.buffers import CHECK_BLOCK, ITEM, first_nonfinite, scan_gradient
from towerflow.ps.placement import ShardLayout
from towerflow.ps.protocol import (
    APPLIED,
    CHUNK_BYTES,
    REFUSED,
    STALE,
    VOIDED,
    PushHeader,
    PushOutcome,
    bounded,
)
from towerflow.ps.server.dense import checks
from towerflow.ps.server.dense.optimizers import RESULT_LIMIT, ServerOptimizer, absmax
from towerflow.ps.server.dense.records import LedgerRecord, ShardFigures, ShardStats
from towerflow.ps.server.pushes import LIVENESS_SECONDS, Pending, PushTable

__all__ = [
    "ShardState",
    "PARTITION",
    "STAGING_FLOOR",
    "default_staging_limit",
]

#: applied pushes a shard's ledger remembers (the newest; about 13 MiB at most)
LEDGER_CAPACITY = 1 << 16
#: refusal messages a shard keeps for its Status reply (the newest)
REFUSALS_KEPT = 10
#: the least a shard's staging limit ever is (bytes of pushed chunks being handled)
STAGING_FLOOR = 64 << 20
#: elements per range lock of the flat buffer (one streamed chunk)
PARTITION = CHUNK_BYTES // ITEM


def default_staging_limit(replicas: int) -> int:
    """Bytes of pushed chunks a shard may hold at once while they are handled.

    A push holds one received chunk at a time (checked, applied or summed,
    then freed), so this bounds chunk buffers, not whole pushes: four chunks
    for every replica and two more pushes (a retry overtaking its stalled
    first attempt, a peer's stray call), never less than :data:`STAGING_FLOOR`
    (whatever the shard's size: no push is held whole).
    """
    return max(STAGING_FLOOR, (replicas + 2) * 4 * CHUNK_BYTES)


class ShardState:
    """Parameters, optimizer, step and push bookkeeping of one ps task.

    The shard owns its locks and counters; other modules read them through
    :attr:`step`, :attr:`staged`, :attr:`stats` and :meth:`figures` and change
    them only through its methods. An aggregator whose own bookkeeping (a sync
    step's sum, the ssp clocks) must change together with the step holds the
    shard's lock with :meth:`locked`, waits with :meth:`wait_once` and wakes
    the waiters with :meth:`notify`. A range lock (:meth:`ranges`) may be
    taken while the shard's lock is held, never the other way round.

    Args:
        layout: the segments this shard holds.
        params: the initial values, ``layout.numel`` float32 elements (owned).
        optimizer: the server-side optimizer over the same number of elements.
        step: the initial step (restored from a checkpoint, else 0).
        staging_limit: bytes of pushed chunks this shard may hold at once
            while they are handled (default :func:`default_staging_limit` of one replica).
    """

    def __init__(self, layout: ShardLayout, params: np.ndarray, optimizer: ServerOptimizer,
                 step: int = 0, *, staging_limit: int | None = None) -> None:
        if params.dtype != np.float32 or params.ndim != 1 or params.size != layout.numel:
            raise InvalidArgumentError(
                f"Shard {layout.index} needs {layout.numel} float32 initial values in a flat "
                f"buffer, got {params.size} {params.dtype} values of shape {list(params.shape)}."
            )
        if optimizer.numel != layout.numel:
            raise InvalidArgumentError(
                f"The optimizer covers {optimizer.numel} elements but shard {layout.index} "
                f"holds {layout.numel}."
            )
        self.layout = layout
        self.params = params
        self.optimizer = optimizer
        self._step = int(step)
        self._stats = ShardStats()
        #: guards step, stats, the push table and staging; waiters wait on it
        self._cond = threading.Condition(threading.RLock())
        #: one lock per PARTITION elements: guards those values of params, slots and sums
        self._range_locks = [threading.Lock()
                             for _ in range(max(1, -(-layout.numel // PARTITION)))]
        #: guards the optimizer's update count and its magnitude bounds
        self._optimizer_lock = threading.Lock()
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
        self._zeros = np.zeros(min(layout.numel, CHECK_BLOCK) or 1, np.float32)

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
        """Hold the shard's lock (reentrant): the step and the counters stay as they are."""
        with self._cond:
            yield

    def notify(self) -> None:
        """Wake every waiter (:meth:`wait_once`); the caller holds :meth:`locked`."""
        self._cond.notify_all()

    def count_bytes_in(self, nbytes: int) -> None:
        """Count ``nbytes`` of pushed payload received (whether applied or not)."""
        with self._cond:
            self._stats.bytes_in += nbytes

    def _count_out(self, nbytes: int, whole: bool) -> None:
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

    def push_rows(self) -> list[tuple[int, int, int, str]]:
        """The push table: ``(worker, incarnation, highest answered seq, its status)``."""
        with self._cond:
            return self._table.rows()

    def figures(self) -> ShardFigures:
        """The step, counters, staging and push table, read together."""
        with self._cond:
            return ShardFigures(self._step, self.optimizer.step, self._stats.as_dict(),
                                tuple(self._stats.refusals), self._staged, tuple(self._table.rows()))

    # -- updates ----------------------------------------------------------------
    @contextlib.contextmanager
    def ranges(self, first: int, stop: int) -> Iterator[None]:
        """Hold the range locks of elements ``first .. stop - 1`` (taken in ascending order)."""
        locks = self._range_locks[first // PARTITION:max(first, stop - 1) // PARTITION + 1]
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            yield

    def apply(self, grad: np.ndarray, lr: float) -> int:
        """Apply the whole gradient ``grad`` with rate ``lr``; return the new step.

        Each partition is updated under its range lock: a pull never sees
        part of the update applied to a range it copies.
        """
        update = self.begin_update()
        for start in range(0, grad.size, PARTITION):
            self.apply_range(start, grad[start:start + PARTITION], lr, update)
        return self.commit_update()

    def begin_update(self) -> int:
        """Number one more update of the optimizer (a gradient applied in pieces takes one)."""
        with self._optimizer_lock:
            return self.optimizer.begin()

    def apply_range(self, first: int, values: np.ndarray, lr: float, update: int) -> None:
        """Apply ``values`` to elements ``first ..`` as part of update number ``update``."""
        with self.ranges(first, first + values.size):
            self.optimizer.apply_range(self.params, first, values, lr, update)

    def add_range(self, into: np.ndarray, first: int, values: np.ndarray) -> None:
        """Add ``values`` to elements ``first ..`` of ``into`` (a sum over this shard's layout)."""
        with self.ranges(first, first + values.size):
            into[first:first + values.size] += values

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

    # -- validation ---------------------------------------------------------------
    def validate_header(self, header: PushHeader) -> None:
        """Raise :class:`InvalidArgumentError` unless the push matches the layout
        (:func:`~towerflow.ps.server.dense.checks.check_header`)."""
        checks.check_header(self.layout, self._expected, header)

    def find_nonfinite(self, values: np.ndarray, base: int = 0) -> int | None:
        """Index (in the shard buffer) of the first NaN / inf of ``values``, else None.

        ``values`` holds the buffer's elements from ``base`` on. The scan is a
        dot product with zeros (``x * 0`` is 0 for every finite ``x`` and NaN
        otherwise), which reads the values once and writes nothing.
        """
        bad = first_nonfinite(values, self._zeros)
        return None if bad is None else base + bad

    def check_update(self, parts: Sequence[tuple[int, np.ndarray]], lr: float, who: str,
                     grad_bound: float | None = None, applied: str = "nothing was applied"
                     ) -> None:
        """Raise unless applying ``parts`` with ``lr`` keeps every parameter and slot finite.

        ``grad_bound``: an upper bound of the gradient's magnitudes known already
        (the root of its squares' sum, from :meth:`scan`); else it is measured.
        An async push is checked chunk by chunk, each chunk as one update (the
        bounds kept are then looser than the buffers, and measured again when
        too loose); ``applied`` says in the refusal what of the push was applied.

        Raises:
            InvalidArgumentError: the update could overflow float32 (finite
                inputs, non-finite result); ``parts`` were not applied.
        """
        def measured() -> float:
            return max((absmax(values) for _, values in parts), default=0.0)

        loose = grad_bound is not None and math.isfinite(grad_bound)
        grad_max = grad_bound if loose else measured()
        with self._optimizer_lock:
            bound = self.optimizer.check_result(self.params, grad_max, lr)
            if bound is not None and loose:  # the root of the squares' sum was too loose
                grad_max = measured()
                bound = self.optimizer.check_result(self.params, grad_max, lr)
        if bound is not None:
            raise InvalidArgumentError(
                f"The update of {who} to ps shard {self.layout.index} (learning rate {lr:g}, "
                f"largest gradient {grad_max:.3g}) could take a parameter or optimizer slot of "
                f"{self.optimizer.name} to {bound:.3g}, past {RESULT_LIMIT:.3g} (float32 ends at "
                f"3.4e38); it was refused and {applied}. Lower the learning rate or clip the "
                "gradients."
            )

    def scan(self, values: np.ndarray, base: int = 0) -> tuple[int | None, float]:
        """:meth:`find_nonfinite` and the sum of the squares of ``values``, in one pass
        (:func:`~towerflow.ps.buffers.scan_gradient`)."""
        bad, squares = scan_gradient(values, self._zeros)
        return (None if bad is None else base + bad), squares

    def nonfinite_message(self, header: PushHeader, index: int, applied: int = 0) -> str:
        """The refusal message for a NaN / inf at buffer ``index`` (``applied`` elements of the
        push were applied before it)."""
        return checks.nonfinite_message(self.layout, header, index, applied)

    # -- reads ----------------------------------------------------------------------
    def buffer(self, name: str) -> np.ndarray:
        """``params`` or one optimizer slot buffer by name."""
        if name == "params":
            return self.params
        slot = self.optimizer.slots.get(name)
        if slot is None:
            raise InvalidArgumentError(
                f"Shard {self.layout.index} has no buffer {bounded(repr(name), 100)}; it has "
                f"params{''.join(', ' + k for k in self.optimizer.slots)}."
            )
        return slot

    def read_chunks(self, name: str = "params", chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """Yield a copy of buffer ``name`` in chunks, each copied under its range locks.

        The ``bytes`` of a chunk are the one copy a reply needs (gRPC sends
        ``bytes``): each is a consistent snapshot of its range.
        """
        raw = self.buffer(name).view(np.uint8)
        sent = 0
        try:
            for start in range(0, raw.size, chunk_bytes):
                stop = min(start + chunk_bytes, raw.size)
                with self.ranges(start // ITEM, -(-stop // ITEM)):
                    data = raw[start:stop].tobytes()
                sent += len(data)
                yield data
        finally:
            self._count_out(sent, sent == raw.size)

