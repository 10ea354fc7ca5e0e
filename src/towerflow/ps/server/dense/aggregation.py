"""How a ps shard turns pushed gradients into updates: async, sync and ssp.

==========  =================================================================
``async``   every gradient is applied when it arrives (article 000's
            asynchronous mode); workers see non-consecutive global steps.
``sync``    ``tf.train.SyncReplicasOptimizer``'s semantics: the gradients of
            ``replicas_to_aggregate`` distinct replicas computed on the
            current step are averaged and applied once; a gradient computed
            on an older step is stale, dropped and counted. With
            ``total_num_replicas`` greater than ``replicas_to_aggregate`` the
            extra workers are backups, so a straggler does not hold the step.
            A push returns when its step has been applied.
``ssp``     stale-synchronous parallel: gradients are applied on arrival, but
            a worker's push returns only once it is at most ``staleness``
            pushes ahead of the slowest live worker.
==========  =================================================================

Only the cluster's replicas count (and, in async mode, the elastic workers
admitted now: :mod:`~towerflow.ps.server.elastic`): a push or a ``Done`` from
another worker id is refused before it changes anything,
and a replica's gradient counts once per sync step (a second push of the same
step waits for it instead of being summed again). A replica that dies while
its push waits for the step and comes back as a new incarnation joins the
same step: the dead incarnation's gradient stays counted, the new one's push
waits with it, and both are answered when the step is applied.

A push that waits (for its sync step, for the ssp bound, or as a retry of a
push still in progress) stops waiting once its call has ended (its deadline
passed, or its caller went away), so a worker that sends a push again after
each attempt's deadline (``step_timeout=None``) holds one handler thread, not
one per attempt: the step still counts the push, and the push table keeps its
answer for the retry.

A push is handled chunk by chunk: a ps holds its parameters, optimizer
slots, one accumulator in sync, and the chunks being handled (bounded by its
staging limit, :func:`~towerflow.ps.server.dense.admission.default_staging_limit`),
nothing per worker at full size. Each received chunk (a read-only view of
the received bytes) is checked finite, then

- async / ssp: checked against the magnitude bound (the update of that chunk
  may not take a parameter or slot past
  :data:`~towerflow.ps.server.dense.optimizers.RESULT_LIMIT`) and applied
  under the locks of its range only, so several workers' pushes proceed side
  by side. The push table's record counts the elements applied (a prefix): a
  push cut off (its call cancelled, its payload short) keeps what was applied,
  and its retry (same ``(worker, incarnation, seq)``) skips those elements and
  continues, so nothing is applied twice. A NaN / inf (or a chunk past the
  magnitude bound) ends the push: the chunks before it stay applied, the
  parameters never hold a NaN, and the push is answered ``refused`` with a
  sentence saying how many of its values were applied (its retry gets the
  same answer). The update is counted (the step moves) when the whole push
  was applied.
- sync: summed into the step's one accumulator under the locks of its range.
  The first ``replicas_to_aggregate`` replicas (fewer when some are done) to
  push on the current step are admitted to it; another push for the step
  waits before any of its bytes is summed, and is stale once the step is
  applied, so a backup's late gradient is never summed into the next step. A
  replica counts once its whole push was summed; a push cut off keeps its
  replica's prefix in the sum and its retry (or the replica's next
  incarnation) continues after it, and the step waits for it, unless another
  replica waits to be admitted while no chunk of it arrived for
  :data:`STALL_SECONDS`: then the step is voided (its part sum cannot be taken
  out again), naming the stalled worker, so a peer that stalls half way
  through its push holds the others for that long at most. A NaN / inf
  voids the step: every push of it is answered ``voided`` naming the worker
  and the element, the accumulator is reset, and the workers compute the
  step again. The averaged gradient is checked against the magnitude bound
  as a whole before it is applied (``voided`` when past it).

A push that is stale (computed on an older step) is refused before any of
its bytes are summed.

Example:
    >>> AggregationConfig(mode="sync", total_num_replicas=3, replicas_to_aggregate=2).backups
    1
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Container, Iterable

import numpy as np

from towerflow.errors import DataLossError, DeadlineExceededError, InvalidArgumentError
from towerflow.ps.server.dense import checks
from towerflow.ps.server.dense.admission import Admission
from towerflow.ps.server.dense.store import DenseStore
from towerflow.ps.server.pushes import Pending
from towerflow.ps.wire.calls import APPLIED, REFUSED, bounded
from towerflow.ps.wire.framing import receive_into
from towerflow.ps.wire.messages import AggregationConfig, PushHeader, PushOutcome

__all__ = ["AggregationConfig", "Aggregator", "AsyncAggregator", "ChunkRefused", "SSPAggregator",
           "STALL_SECONDS"]

#: sync: seconds an admitted push may send no chunk, part summed, while another replica waits
#: to be admitted, before the step is voided
STALL_SECONDS = 2.0

class Aggregator(abc.ABC):
    """Receives pushes for one dense shard and applies them: it asks the shard's
    :class:`~towerflow.ps.server.dense.admission.Admission` whether, and when, a push is
    taken, and applies or sums it into the shard's
    :class:`~towerflow.ps.server.dense.store.DenseStore`."""

    def __init__(self, store: DenseStore, admission: Admission,
                 config: AggregationConfig) -> None:
        self.store = store
        self.admission = admission
        self.config = config
        #: names a worker (and, on a ps task with heartbeats, its health) in messages
        self.describe_worker: Callable[[int], str] = _worker_label
        #: the elastic workers admitted now (async: their pushes count too)
        self.elastic: Container[int] = ()
        self._done: set[int] = set()
        self._closed = False

    #: whether a push changes the shard inside the replica link's gate (``applying``, see
    #: :meth:`push`); a sync step changes it under the admission's lock instead
    gated = True

    def push(self, header: PushHeader, chunks: Iterable[bytes | memoryview],
             active: Callable[[], bool] | None = None,
             applying: Callable[[], contextlib.AbstractContextManager] | None = None
             ) -> PushOutcome:
        """Handle one push: check, de-duplicate, then apply or sum it chunk by chunk.

        A refused push returns a ``refused`` outcome (counted; its message says
        what of it was applied); a retry of a push already answered returns its
        outcome again, and a retry of a push cut off part way continues it.
        ``active()`` (the call's ``is_active``) ends a wait of a push whose call
        has ended with ``DeadlineExceededError``: a sync push stays counted in its
        step, whose answer its retry gets from the push table.

        ``applying()`` (a replica link's
        :meth:`~towerflow.ps.server.dense.replication.ApplyGate.applying`) is held
        while an async or ssp push changes the shard, not while it waits (the ssp
        bound), so a copy of the shard never waits for a push that waits for a peer.
        """
        gate = applying if applying is not None and self.gated else contextlib.nullcontext
        with gate():
            outcome, waits = self._handle(header, chunks, active)
        if waits:
            self._after_applied(header, active)
        return outcome

    def _handle(self, header: PushHeader, chunks: Iterable[bytes | memoryview],
                active: Callable[[], bool] | None) -> tuple[PushOutcome, bool]:
        """:meth:`push` but the ssp wait: ``(outcome, whether the wait follows)``."""
        admission = self.admission
        begun = self._begin(header, active)
        if isinstance(begun, PushOutcome):
            return begun, False
        try:
            outcome = self._accept(header, begun, chunks, active)
        except ChunkRefused as exc:  # a bad chunk ended the push; what came before stays
            outcome = PushOutcome(REFUSED, admission.step, bounded(str(exc)))
        except (InvalidArgumentError, DataLossError) as exc:  # the payload did not fit
            admission.suspend_push(header, begun)
            return admission.refuse(PushOutcome(REFUSED, admission.step, bounded(
                str(exc) + self._resumable(header, begun)))), False
        except DeadlineExceededError:
            raise  # a sync push counted in its step: the step answers it (and its retry)
        except BaseException:
            admission.suspend_push(header, begun)
            raise
        outcome = admission.finish_push(header, outcome, begun.applied)
        return outcome, outcome.status == APPLIED

    def round_state(self) -> tuple[list[int], list[int]]:
        """``(clocks, done)``: the state of the aggregation a replica's copy keeps with the
        parameters (ssp's clocks, the replicas that said Done); the caller holds the
        admission's lock. A step's part sum is not kept: its pushes are unanswered, and their
        workers send them again to the replica that takes over."""
        return [], sorted(self._done)

    def adopt_round(self, clocks: Iterable[int], done: Iterable[int]) -> None:
        """A replica takes its primary's :meth:`round_state` (checked by
        :func:`~towerflow.ps.server.dense.initspec.check_round`)."""
        with self.admission.locked():
            self._done = set(done)
            self.admission.notify()

    @staticmethod
    def _resumable(header: PushHeader, pending: Pending) -> str:
        if not pending.applied:
            return ""
        return (f" Its first {pending.applied} of {header.numel} values were applied; a retry "
                f"of push {header.seq} continues after them.")

    def _begin(self, header: PushHeader,
               active: Callable[[], bool] | None) -> PushOutcome | Pending:
        """Check a push's sender and header and register it (see :meth:`push`)."""
        admission = self.admission
        try:
            self.config.check_replica(header.worker_id, f"Push {header.seq}", self.elastic)
            begun = admission.begin_push(header, self.config.timeout, active)
        except InvalidArgumentError as exc:
            return admission.refuse(PushOutcome(REFUSED, admission.step, bounded(str(exc))))
        if not isinstance(begun, PushOutcome):
            with admission.locked():
                self._done.discard(header.worker_id)
        return begun

    @abc.abstractmethod
    def _accept(self, header: PushHeader, pending: Pending, chunks: Iterable[bytes | memoryview],
                active: Callable[[], bool] | None) -> PushOutcome:
        """Receive the payload and apply or accumulate it chunk by chunk.

        Raises:
            ChunkRefused: a chunk was refused (the push is answered ``refused``).
        """

    def _after_applied(self, header: PushHeader, active: Callable[[], bool] | None) -> None:
        """Hook run after an applied push has been recorded (ssp waits here)."""

    def worker_done(self, worker_id: int) -> None:
        """Worker ``worker_id`` has finished: stop waiting for it.

        Raises:
            InvalidArgumentError: ``worker_id`` is not one of the replicas.
        """
        self.config.check_replica(worker_id, "Done")
        with self.admission.locked():
            self._done.add(worker_id)
            self.admission.notify()

    def close(self) -> None:
        """The shard was replaced (the chief re-initialised it): release waiting pushes."""
        with self.admission.locked():
            self._closed = True
            self.admission.notify()

    def _live(self) -> int:
        return max(1, self.config.total_num_replicas - len(self._done))

    def _who(self, header: PushHeader) -> str:
        return f"worker {header.worker_id}"


class AsyncAggregator(Aggregator):
    """Applies every gradient chunk by chunk as it arrives."""

    def _accept(self, header: PushHeader, pending: Pending, chunks: Iterable[bytes | memoryview],
                active: Callable[[], bool] | None) -> PushOutcome:
        store, admission, who = self.store, self.admission, self._who(header)
        what = f"push {header.seq} of {who}"

        def take(first: int, values: np.ndarray) -> None:
            stop = first + values.size
            if stop <= pending.applied:  # applied by the attempt this one retries
                return
            if first < pending.applied:
                values, first = values[pending.applied - first:], pending.applied
            with admission.holding(values.nbytes, who):
                bad, squares = store.scan(values, base=first)
                if bad is not None:
                    raise ChunkRefused(checks.nonfinite_message(store.layout, header, bad,
                                                                pending.applied))
                try:
                    store.check_update([(first, values)], header.lr, what, math.sqrt(squares),
                                       self._applied_phrase(header, pending))
                except InvalidArgumentError as exc:
                    raise ChunkRefused(str(exc)) from None
                self._begin_update(header, pending)
                store.apply_range(first, values, header.lr, pending.update)
            pending.applied = stop

        receive_into(None, chunks, header.numel, who=who, on_chunk=take)
        self._begin_update(header, pending)  # an empty shard's push is an update too
        return PushOutcome(APPLIED, admission.commit_update())

    @staticmethod
    def _applied_phrase(header: PushHeader, pending: Pending) -> str:
        if not pending.applied:
            return "nothing was applied"
        return (f"its first {pending.applied} of {header.numel} values were applied before "
                "that chunk, the rest was not")

    def _begin_update(self, header: PushHeader, pending: Pending) -> None:
        """Number the push's update once, before its first change (a retry keeps it)."""
        if not pending.update:
            self._before_apply(header)
            pending.update = self.store.begin_update()

    def _before_apply(self, header: PushHeader) -> None:
        """Hook run once per push before it changes the parameters (ssp records the lead)."""


class SSPAggregator(AsyncAggregator):
    """Async updates, but no worker more than ``staleness`` pushes ahead."""

    def __init__(self, store: DenseStore, admission: Admission,
                 config: AggregationConfig) -> None:
        super().__init__(store, admission, config)
        self._clocks: dict[int, int] = dict.fromkeys(range(config.total_num_replicas), 0)

    def _min_clock(self) -> int:
        live = [c for w, c in self._clocks.items() if w not in self._done]
        return min(live) if live else 0

    def round_state(self) -> tuple[list[int], list[int]]:
        return [self._clocks[w] for w in sorted(self._clocks)], sorted(self._done)

    def adopt_round(self, clocks: Iterable[int], done: Iterable[int]) -> None:
        with self.admission.locked():
            for worker, clock in enumerate(clocks):
                self._clocks[worker] = int(clock)
        super().adopt_round(clocks, done)

    def _before_apply(self, header: PushHeader) -> None:
        with self.admission.locked():
            clock = self._clocks[header.worker_id]
            lead = clock - self._min_clock()
            self.admission.record_lead(lead)
            self._clocks[header.worker_id] = clock + 1
            self.admission.notify()

    def _after_applied(self, header: PushHeader, active: Callable[[], bool] | None) -> None:
        admission, bound, timeout = self.admission, self.config.staleness, self.config.timeout
        deadline = admission.deadline(timeout)

        def message() -> str:
            slowest = self._min_clock()
            behind = sorted(w for w, c in self._clocks.items()
                            if c == slowest and w not in self._done)
            return (f"Worker {header.worker_id} waited {timeout:.0f} s for the slowest workers "
                    f"({', '.join(map(str, behind))}, at push {slowest}) to come within "
                    f"staleness {bound}; check that they are alive.")

        with admission.locked():
            while self._clocks[header.worker_id] - self._min_clock() > bound and not self._closed:
                admission.wait_once(deadline, message, active)


class ChunkRefused(Exception):
    """A chunk of an async push was refused (NaN / inf, or past the magnitude bound): the push
    ends, answered ``refused`` with this message; the chunks before it stay applied."""


def _worker_label(worker_id: int) -> str:
    return f"/job:worker/task:{worker_id}"
