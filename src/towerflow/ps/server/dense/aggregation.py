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

A push is atomic. Its payload is staged as it arrives (the received bytes
are kept, not copied) and every chunk is checked; no lock that another push or
pull needs is held meanwhile, so a peer that stalls half way through its
payload delays nobody else. Only when the whole payload is in and valid is it
applied (async / ssp: under the shard's apply lock, in one step) or summed
into the step's accumulator (sync). A NaN / inf, a truncated payload or a
sender that goes away leaves the parameters and the sum unchanged, and the
push's retry (same ``(worker, incarnation, seq)``) is handled afresh. The
payload bytes a shard holds at once are bounded by its staging limit
(:func:`~towerflow.ps.server.dense.shard.default_staging_limit`).

Example:
    >>> AggregationConfig(mode="sync", total_num_replicas=3, replicas_to_aggregate=2).backups
    1
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Container, Iterable, Iterator

import numpy as np

from towerflow.errors import DataLossError, DeadlineExceededError, InvalidArgumentError
from towerflow.ps.buffers import receive_into
from towerflow.ps.protocol import (
    APPLIED,
    CHUNK_BYTES,
    DEFAULT_TIMEOUT,
    MODES,
    REFUSED,
    STALE,
    VOIDED,
    AggregationConfig,
    PushHeader,
    PushOutcome,
    bounded,
)
from towerflow.ps.server.dense.shard import ShardState
from towerflow.ps.server.pushes import Pending

__all__ = ["AggregationConfig", "Aggregator", "make_aggregator", "MODES", "DEFAULT_TIMEOUT"]

class Aggregator(abc.ABC):
    """Receives pushes for one :class:`ShardState` and applies them."""

    def __init__(self, state: ShardState, config: AggregationConfig) -> None:
        self.state = state
        self.config = config
        #: names a worker (and, on a ps task with heartbeats, its health) in messages
        self.describe_worker: Callable[[int], str] = _worker_label
        #: the elastic workers admitted now (async: their pushes count too)
        self.elastic: Container[int] = ()
        self._done: set[int] = set()
        self._closed = False

    def push(self, header: PushHeader, chunks: Iterable[bytes | memoryview],
             active: Callable[[], bool] | None = None) -> PushOutcome:
        """Handle one push: check, de-duplicate, stage, validate, apply (or drop).

        A refused push returns a ``refused`` outcome (counted, parameters
        unchanged); a retry of a push already answered returns its outcome again.
        ``active()`` (the call's ``is_active``) ends a wait of a push whose call
        has ended with ``DeadlineExceededError``: a sync push stays counted in its
        step, whose answer its retry gets from the push table.
        """
        state = self.state
        begun = self._begin(header, active)
        if isinstance(begun, PushOutcome):
            return begun
        try:
            outcome = self._accept(header, begun, chunks, active)
        except (InvalidArgumentError, DataLossError) as exc:  # nothing was applied
            state.drop_push(header)
            return state.refuse(PushOutcome(REFUSED, state.step, bounded(str(exc))))
        except DeadlineExceededError:
            raise  # a sync push counted in its step: the step answers it (and its retry)
        except BaseException:
            state.drop_push(header)
            raise
        outcome = state.finish_push(header, outcome)
        if outcome.status == APPLIED:
            self._after_applied(header, active)
        return outcome

    def push_pull(self, header: PushHeader, chunks: Iterable[bytes | memoryview],
                  active: Callable[[], bool] | None = None,
                  chunk_bytes: int = CHUNK_BYTES) -> tuple[PushOutcome, Iterable[bytes]]:
        """:meth:`push`, then the parameters to send back (nothing when refused).

        The parameters are read after the push was handled; the async
        aggregator overrides this to overlap its update with the reply.
        """
        return self._reply(self.push(header, chunks, active), chunk_bytes)

    def _reply(self, outcome: PushOutcome, chunk_bytes: int
               ) -> tuple[PushOutcome, Iterable[bytes]]:
        if outcome.status == REFUSED:
            return outcome, ()
        return outcome, self.state.read_chunks("params", chunk_bytes)

    def _begin(self, header: PushHeader,
               active: Callable[[], bool] | None) -> PushOutcome | Pending:
        """Check a push's sender and header and register it (see :meth:`push`)."""
        state = self.state
        try:
            self.config.check_replica(header.worker_id, f"Push {header.seq}", self.elastic)
            begun = state.begin_push(header, self.config.timeout, active)
        except InvalidArgumentError as exc:
            return state.refuse(PushOutcome(REFUSED, state.step, bounded(str(exc))))
        if not isinstance(begun, PushOutcome):
            with state.locked():
                self._done.discard(header.worker_id)
        return begun

    @contextlib.contextmanager
    def _staged(self, header: PushHeader, chunks: Iterable[bytes | memoryview]
                ) -> Iterator[tuple[list[tuple[int, np.ndarray]], float]]:
        """The whole payload as ``(first element, values)`` parts, each checked finite, and a
        bound of the gradient's magnitudes (the root of its squares' sum).

        The parts are read-only views of the received chunks (no copy); their
        bytes count against the shard's staging limit until the block ends.
        """
        parts, held, bound = self._receive(header, chunks)
        try:
            yield parts, bound
        finally:
            parts.clear()
            self.state.release(held)

    def _receive(self, header: PushHeader, chunks: Iterable[bytes | memoryview]
                 ) -> tuple[list[tuple[int, np.ndarray]], int, float]:
        """The whole payload as checked parts, the staging bytes they hold and a bound of its
        magnitudes (the root of its squares' sum, from the same scan).

        On a bad or cut-off payload the bytes held so far are released and the
        error raised: nothing was applied.
        """
        state, who = self.state, self._who(header)
        parts: list[tuple[int, np.ndarray]] = []
        held, squares = 0, 0.0

        def keep(first: int, values: np.ndarray) -> None:
            nonlocal held, squares
            state.reserve(values.nbytes, who)
            held += values.nbytes
            bad, part_squares = state.scan(values, base=first)
            if bad is not None:
                raise InvalidArgumentError(state.nonfinite_message(header, bad))
            squares += part_squares
            parts.append((first, values))

        try:
            receive_into(None, chunks, header.numel, who=who, on_chunk=keep)
        except BaseException:
            parts.clear()
            state.release(held)
            raise
        return parts, held, math.sqrt(squares)

    @abc.abstractmethod
    def _accept(self, header: PushHeader, pending: Pending, chunks: Iterable[bytes | memoryview],
                active: Callable[[], bool] | None) -> PushOutcome:
        """Receive the payload and apply or accumulate it."""

    def _after_applied(self, header: PushHeader, active: Callable[[], bool] | None) -> None:
        """Hook run after an applied push has been recorded (ssp waits here)."""

    def worker_done(self, worker_id: int) -> None:
        """Worker ``worker_id`` has finished: stop waiting for it.

        Raises:
            InvalidArgumentError: ``worker_id`` is not one of the replicas.
        """
        self.config.check_replica(worker_id, "Done")
        with self.state.locked():
            self._done.add(worker_id)
            self.state.notify()

    def close(self) -> None:
        """The shard was replaced (the chief re-initialised it): release waiting pushes."""
        with self.state.locked():
            self._closed = True
            self.state.notify()

    def _live(self) -> int:
        return max(1, self.config.total_num_replicas - len(self._done))

    def _who(self, header: PushHeader) -> str:
        return f"worker {header.worker_id}"


class _AsyncAggregator(Aggregator):
    """Applies every gradient once all of it has arrived."""

    _streams_reply = True

    def _accept(self, header: PushHeader, pending: Pending, chunks: Iterable[bytes | memoryview],
                active: Callable[[], bool] | None) -> PushOutcome:
        with self._staged(header, chunks) as (parts, bound):
            self.state.check_update(parts, header.lr, f"push {header.seq} of {self._who(header)}",
                                    bound)
            self._before_apply(header)
            step = self.state.apply_parts(parts, header.lr)
        return PushOutcome(APPLIED, step)

    def _before_apply(self, header: PushHeader) -> None:
        """Hook run once per push before it changes the parameters (ssp records the lead)."""

    def push_pull(self, header: PushHeader, chunks: Iterable[bytes | memoryview],
                  active: Callable[[], bool] | None = None,
                  chunk_bytes: int = CHUNK_BYTES) -> tuple[PushOutcome, Iterable[bytes]]:
        """Receive and check the whole gradient, then apply it while the parameters stream back.

        Each range of the reply is updated just before it is sent, so the
        update overlaps the reply instead of preceding it. Once the gradient
        has arrived whole and finite it is applied whole, even when the reply
        is cut off (:class:`~towerflow.ps.server.dense.shard.StreamedApply`).
        """
        if not self._streams_reply:  # ssp: a push may wait after its update, before the reply
            return super().push_pull(header, chunks, active, chunk_bytes)
        state = self.state
        begun = self._begin(header, active)
        if isinstance(begun, PushOutcome):
            return self._reply(begun, chunk_bytes)
        try:
            parts, held, bound = self._receive(header, chunks)
        except (InvalidArgumentError, DataLossError) as exc:  # nothing was applied
            state.drop_push(header)
            return state.refuse(PushOutcome(REFUSED, state.step, bounded(str(exc)))), ()
        except BaseException:
            state.drop_push(header)
            raise
        try:
            state.check_update(parts, header.lr, f"push {header.seq} of {self._who(header)}",
                               bound)
        except InvalidArgumentError as exc:  # nothing was applied
            parts.clear()
            state.release(held)
            state.drop_push(header)
            return state.refuse(PushOutcome(REFUSED, state.step, bounded(str(exc)))), ()

        def done(step: int) -> None:
            state.release(held)
            state.finish_push(header, PushOutcome(APPLIED, step))

        stream = state.begin_streamed(parts, header.lr, chunk_bytes, done)
        return PushOutcome(APPLIED, stream.step), stream


class _SSPAggregator(_AsyncAggregator):
    """Async updates, but no worker more than ``staleness`` pushes ahead."""

    _streams_reply = False

    def __init__(self, state: ShardState, config: AggregationConfig) -> None:
        super().__init__(state, config)
        self._clocks: dict[int, int] = dict.fromkeys(range(config.total_num_replicas), 0)

    def _min_clock(self) -> int:
        live = [c for w, c in self._clocks.items() if w not in self._done]
        return min(live) if live else 0

    def _before_apply(self, header: PushHeader) -> None:
        with self.state.locked():
            clock = self._clocks[header.worker_id]
            lead = clock - self._min_clock()
            self.state.record_lead(lead)
            self._clocks[header.worker_id] = clock + 1
            self.state.notify()

    def _after_applied(self, header: PushHeader, active: Callable[[], bool] | None) -> None:
        state, bound, timeout = self.state, self.config.staleness, self.config.timeout
        deadline = state.deadline(timeout)

        def message() -> str:
            slowest = self._min_clock()
            behind = sorted(w for w, c in self._clocks.items()
                            if c == slowest and w not in self._done)
            return (f"Worker {header.worker_id} waited {timeout:.0f} s for the slowest workers "
                    f"({', '.join(map(str, behind))}, at push {slowest}) to come within "
                    f"staleness {bound}; check that they are alive.")

        with state.locked():
            while self._clocks[header.worker_id] - self._min_clock() > bound and not self._closed:
                state.wait_once(deadline, message, active)


class _SyncAggregator(Aggregator):
    """Averages the gradients of ``replicas_to_aggregate`` distinct replicas, applies once."""

    def __init__(self, state: ShardState, config: AggregationConfig) -> None:
        super().__init__(state, config)
        self._acc = np.zeros(state.layout.numel, np.float32)
        #: replicas whose gradient is in the step's sum
        self._counted: set[int] = set()
        #: the pushes the step answers when it is applied, with their waiters
        self._waiting: list[tuple[PushHeader, Pending]] = []
        self._lr = 0.0

    def _accept(self, header: PushHeader, pending: Pending, chunks: Iterable[bytes | memoryview],
                active: Callable[[], bool] | None) -> PushOutcome:
        state = self.state
        with state.locked():
            if header.token != state.step:
                return self._stale(header)
        with self._staged(header, chunks) as (parts, _), state.locked():
            if header.token != state.step:  # the step was applied while this arrived
                return self._stale(header)
            if header.worker_id not in self._counted:  # a replica counts once per step
                for first, values in parts:
                    self._acc[first:first + values.size] += values
                self._counted.add(header.worker_id)
                self._lr = header.lr
            self._waiting.append((header, pending))
            if len(self._counted) >= self._needed():
                self._complete()
        return state.wait_outcome(pending, self.config.timeout,
                                  lambda: self._missing_message(header), active)

    @property
    def counted(self) -> int:
        """Replicas whose gradient is in the current step's sum."""
        with self.state.locked():
            return len(self._counted)

    def _stale(self, header: PushHeader) -> PushOutcome:
        return PushOutcome(STALE, self.state.step, (
            f"gradient of worker {header.worker_id} was computed on step {header.token} but "
            f"shard {self.state.layout.index} is at step {self.state.step}"))

    def _needed(self) -> int:
        return min(self.config.required, self._live())

    def _complete(self) -> None:
        """Average and apply the step's sum; answer its pushes (caller holds the shard's lock)."""
        self._acc *= np.float32(1.0 / len(self._counted))
        try:
            self.state.check_update([(0, self._acc)], self._lr, "the step's averaged gradient")
        except InvalidArgumentError as exc:  # the step is not applied; its pushes are answered
            self._answer(PushOutcome(VOIDED, self.state.step,
                                     bounded(f"step {self.state.step} was not applied: {exc}")))
            return
        step = self.state.apply(self._acc, self._lr)
        self._answer(PushOutcome(APPLIED, step))

    def _answer(self, outcome: PushOutcome) -> None:
        waiting, self._waiting = self._waiting, []
        self._acc.fill(0.0)
        self._counted.clear()
        for header, pending in waiting:
            self.state.finish_push(header, outcome)
            if pending.outcome is None:
                # a replica's incarnation superseded by its restart while its push waited:
                # the push table no longer holds it, but its gradient is in the step
                pending.outcome = outcome
        self.state.notify()

    def _missing_message(self, header: PushHeader) -> str:
        state = self.state
        got = sorted(self._counted)
        missing = [w for w in range(self.config.total_num_replicas)
                   if w not in got and w not in self._done]
        timeout = self.config.timeout or 0.0
        return (f"Step {header.token} of ps shard {state.layout.index} waited "
                f"{timeout:.0f} s for {self.config.required} gradients but received "
                f"{len(got)} (from worker {', '.join(map(str, got)) or 'none'}); missing: "
                f"{', '.join(self.describe_worker(w) for w in missing) or 'none'}. "
                "Restart the missing workers or add backup workers.")

    def worker_done(self, worker_id: int) -> None:
        self.config.check_replica(worker_id, "Done")
        with self.state.locked():
            self._done.add(worker_id)
            if self._counted and len(self._counted) >= self._needed():
                self._complete()
            self.state.notify()

    def close(self) -> None:
        with self.state.locked():
            self._closed = True
            self._answer(PushOutcome(VOIDED, self.state.step, (
                f"ps shard {self.state.layout.index} was re-initialised before step "
                f"{self.state.step} was applied; compute it again")))


_KINDS: dict[str, type[Aggregator]] = {
    "async": _AsyncAggregator,
    "sync": _SyncAggregator,
    "ssp": _SSPAggregator,
}


def make_aggregator(state: ShardState, config: AggregationConfig,
                    describe_worker: Callable[[int], str] | None = None,
                    elastic: Container[int] = ()) -> Aggregator:
    """Return the aggregator of ``config.mode`` over ``state``.

    ``describe_worker(replica)`` names a worker in error messages (default
    ``/job:worker/task:<replica>``); ``elastic``: the elastic workers admitted
    now, whose pushes an async aggregator takes too.
    """
    aggregator = _KINDS[config.mode](state, config)
    aggregator.elastic = elastic
    if describe_worker is not None:
        aggregator.describe_worker = describe_worker
    return aggregator


def _worker_label(worker_id: int) -> str:
    return f"/job:worker/task:{worker_id}"
