"""How a ps shard turns pushed gradients into updates: async, sync and ssp.

==========  =================================================================
``async``   every gradient is applied when it arrives (article 000's
            asynchronous mode); workers see non-consecutive global steps.
``sync``    ``tf.train.SyncReplicasOptimizer``'s semantics: the first
            ``replicas_to_aggregate`` gradients computed on the current step
            are averaged and applied once; a gradient computed on an older
            step is stale, dropped and counted. With ``total_num_replicas``
            greater than ``replicas_to_aggregate`` the extra workers are
            backups, so a straggler does not hold the step. A push returns
            when its step has been applied.
``ssp``     stale-synchronous parallel: gradients are applied on arrival, but
            a worker's push returns only once it is at most ``staleness``
            pushes ahead of the slowest live worker.
==========  =================================================================

Memory does not grow with the number of workers. In async and ssp mode a
push whose sender declares it finite (``PushHeader.finite``: the
:class:`~towerflow.ps.client.PSClient` checks before it sends) is applied
chunk by chunk as it arrives, straight into the parameters, with no receive
buffer: concurrent pushes interleave chunk by chunk (each chunk is applied
under the shard's apply lock, each push counts one step, one ledger entry and
one optimizer update when its last chunk is in). Each chunk is still checked;
a NaN / inf, a truncated payload or a worker dying part way leaves the chunks
before it applied (as TensorFlow's ps applies each variable's update on its
own) and the push is refused or, when its sender retries it with the same
``(worker, incarnation, seq)``, resumed where it stopped, never applied twice.
Such a push is in the shard's ledger as *partial*, with the range of elements
it applied (:class:`~towerflow.ps.shard.LedgerRecord`); the retry that
completes it makes the same entry complete, so the ledger replays exactly
onto the parameters.
Any other push is staged: its received chunks are kept (not copied, one
staged push at a time) until the last is in and all are checked, so a refused
push leaves the parameters unchanged. Sync mode sums every gradient straight
into one accumulator per shard, one push at a time; a sync push refused part
way through (NaN / inf in a later chunk, or a worker dying mid-push) voids the
step's partial sum: the workers that contributed to it are told ``voided``
and compute again, so the parameters never see a refused gradient.

Example:
    >>> AggregationConfig(mode="sync", total_num_replicas=3, replicas_to_aggregate=2).backups
    1
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from towerflow.errors import DataLossError, DeadlineExceededError, InvalidArgumentError
from towerflow.ps.shard import (
    APPLIED,
    REFUSED,
    STALE,
    VOIDED,
    PayloadCutOff,
    PushHeader,
    PushOutcome,
    ShardState,
    receive_into,
)

__all__ = ["AggregationConfig", "Aggregator", "make_aggregator", "MODES"]

MODES = ("async", "sync", "ssp")


@dataclass(frozen=True, slots=True)
class AggregationConfig:
    """How gradients are combined on the ps.

    Attributes:
        mode: ``async``, ``sync`` or ``ssp``.
        total_num_replicas: number of workers pushing gradients.
        replicas_to_aggregate: gradients averaged per step in sync mode
            (default: all replicas).
        staleness: ssp bound: pushes a worker may be ahead of the slowest.
        timeout: seconds a push may wait for its step (sync) or for the
            slowest worker (ssp) before failing with DeadlineExceededError.
    """

    mode: str = "async"
    total_num_replicas: int = 1
    replicas_to_aggregate: int | None = None
    staleness: int = 2
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgumentError(
                f"Unknown ps mode {self.mode!r}; use one of {', '.join(MODES)}."
            )
        if self.total_num_replicas < 1:
            raise InvalidArgumentError(
                f"total_num_replicas must be >= 1, got {self.total_num_replicas}."
            )
        r = self.replicas_to_aggregate
        if r is not None and not 1 <= r <= self.total_num_replicas:
            raise InvalidArgumentError(
                f"replicas_to_aggregate={r} must be between 1 and total_num_replicas="
                f"{self.total_num_replicas}; extra replicas act as backup workers."
            )
        if self.staleness < 0:
            raise InvalidArgumentError(f"staleness must be >= 0, got {self.staleness}.")
        if not self.timeout > 0:
            raise InvalidArgumentError(f"timeout must be positive, got {self.timeout}.")

    @property
    def required(self) -> int:
        """Gradients averaged per sync step."""
        return self.replicas_to_aggregate or self.total_num_replicas

    @property
    def backups(self) -> int:
        """Number of backup workers (sync mode)."""
        return self.total_num_replicas - self.required


class Aggregator(abc.ABC):
    """Receives pushes for one :class:`ShardState` and applies them."""

    def __init__(self, state: ShardState, config: AggregationConfig) -> None:
        self.state = state
        self.config = config
        #: names a worker (and, on a ps task with heartbeats, its health) in messages
        self.describe_worker: Callable[[int], str] = _worker_label
        self._done: set[int] = set()
        self._closed = False

    def push(self, header: PushHeader, chunks: Iterable[bytes | memoryview]) -> PushOutcome:
        """Handle one push: de-duplicate, validate, receive, apply (or drop).

        A refused push returns a ``refused`` outcome (counted, parameters
        unchanged); a retry of a push already seen returns its outcome again.
        """
        state = self.state
        try:
            earlier = state.begin_push(header, self.config.timeout)
        except InvalidArgumentError as exc:
            return state.finish_push(header, PushOutcome(REFUSED, state.step, str(exc)))
        if earlier is not None:
            return earlier
        with state.cond:
            self._done.discard(header.worker_id)
        try:
            outcome = self._accept(header, chunks)
        except PayloadCutOff as exc:
            if state.resume_point(header)[0]:  # a streamed push cut off part way:
                state.forget_push(header)      # ledgered partial; its retry completes it
                raise
            outcome = PushOutcome(REFUSED, state.step, str(exc))
        except (InvalidArgumentError, DataLossError) as exc:
            outcome = PushOutcome(REFUSED, state.step, str(exc))
        except DeadlineExceededError:
            raise
        except BaseException:
            state.forget_push(header)
            raise
        outcome = state.finish_push(header, outcome)
        if outcome.status == APPLIED:
            self._after_applied(header)
        return outcome

    @abc.abstractmethod
    def _accept(self, header: PushHeader, chunks: Iterable[bytes | memoryview]) -> PushOutcome:
        """Receive the payload and apply or accumulate it."""

    def _after_applied(self, header: PushHeader) -> None:
        """Hook run after an applied push has been recorded (ssp waits here)."""

    def worker_done(self, worker_id: int) -> None:
        """Worker ``worker_id`` has finished: stop waiting for it."""
        with self.state.cond:
            self._done.add(worker_id)
            self.state.cond.notify_all()

    def close(self) -> None:
        """The shard was replaced (the chief re-initialised it): release waiting pushes."""
        with self.state.cond:
            self._closed = True
            self.state.cond.notify_all()

    def _live(self) -> int:
        return max(1, self.config.total_num_replicas - len(self._done))

    def _who(self, header: PushHeader) -> str:
        return f"worker {header.worker_id}"


class _AsyncAggregator(Aggregator):
    """Applies every gradient on arrival."""

    def __init__(self, state: ShardState, config: AggregationConfig) -> None:
        super().__init__(state, config)
        self._stage_lock = threading.Lock()  # one staged payload at a time

    def _accept(self, header: PushHeader, chunks: Iterable[bytes | memoryview]) -> PushOutcome:
        if header.finite:
            return self._stream(header, chunks)
        return self._staged(header, chunks)

    def _staged(self, header: PushHeader, chunks: Iterable[bytes | memoryview]) -> PushOutcome:
        """Keep every chunk (the received bytes, not a copy) until all are checked, then apply."""
        state = self.state
        done, update = state.resume_point(header)
        with self._stage_lock:
            parts: list[tuple[int, np.ndarray]] = []

            def keep(first: int, values: np.ndarray) -> None:
                bad = state.find_nonfinite(values, base=first)
                if bad is not None:
                    raise InvalidArgumentError(state.nonfinite_message(header, bad))
                parts.append(_unapplied(first, values, done))

            receive_into(None, chunks, header.numel, who=self._who(header), on_chunk=keep)
            if not update:
                self._before_apply(header)
                update = state.begin_update()
            for first, values in parts:
                state.apply_range(first, values, header.lr, update)
            parts.clear()
        return PushOutcome(APPLIED, state.commit_update())

    def _stream(self, header: PushHeader, chunks: Iterable[bytes | memoryview]) -> PushOutcome:
        """Apply each chunk as it arrives (the worker checked that the gradient is finite)."""
        state = self.state
        done, update = state.resume_point(header)

        def apply(first: int, values: np.ndarray) -> None:
            nonlocal done, update
            first, values = _unapplied(first, values, done)
            if not values.size:
                return
            bad = state.find_nonfinite(values, base=first)
            if bad is not None:
                raise InvalidArgumentError(state.nonfinite_message(header, bad, applied=done))
            if not update:
                self._before_apply(header)
                update = state.begin_update()
            state.apply_range(first, values, header.lr, update)
            done = first + values.size
            state.note_progress(header, done, update)

        receive_into(None, chunks, header.numel, who=self._who(header), on_chunk=apply)
        if not update:  # an empty shard
            self._before_apply(header)
            state.begin_update()
        return PushOutcome(APPLIED, state.commit_update())

    def _before_apply(self, header: PushHeader) -> None:
        """Hook run once per push before it changes the parameters (ssp records the lead)."""


class _SSPAggregator(_AsyncAggregator):
    """Async updates, but no worker more than ``staleness`` pushes ahead."""

    def __init__(self, state: ShardState, config: AggregationConfig) -> None:
        super().__init__(state, config)
        self._clocks: dict[int, int] = dict.fromkeys(range(config.total_num_replicas), 0)

    def _min_clock(self) -> int:
        live = [c for w, c in self._clocks.items() if w not in self._done]
        return min(live) if live else 0

    def _before_apply(self, header: PushHeader) -> None:
        with self.state.cond:
            clock = self._clocks.setdefault(header.worker_id, self._min_clock())
            lead = clock - self._min_clock()
            self.state.stats.max_lead = max(self.state.stats.max_lead, lead)
            self._clocks[header.worker_id] = clock + 1
            self.state.cond.notify_all()

    def _after_applied(self, header: PushHeader) -> None:
        state, bound = self.state, self.config.staleness
        deadline = time.monotonic() + self.config.timeout
        with state.cond:
            while self._clocks[header.worker_id] - self._min_clock() > bound and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    slowest = self._min_clock()
                    behind = sorted(w for w, c in self._clocks.items()
                                    if c == slowest and w not in self._done)
                    raise DeadlineExceededError(
                        f"Worker {header.worker_id} waited {self.config.timeout:.0f} s for the "
                        f"slowest workers ({', '.join(map(str, behind))}, at push {slowest}) "
                        f"to come within staleness {bound}; check that they are alive."
                    )
                state.cond.wait(remaining)


class _SyncAggregator(Aggregator):
    """Averages ``replicas_to_aggregate`` gradients of the current step, applies once."""

    def __init__(self, state: ShardState, config: AggregationConfig) -> None:
        super().__init__(state, config)
        self._recv_lock = threading.Lock()  # one payload summed at a time
        self._acc = np.zeros(state.layout.numel, np.float32)
        self._count = 0
        self._contributors: list[int] = []
        self._epoch = 0     # bumped when the step's sum is applied or voided
        self._dirty = False  # the accumulator holds part of a push not yet counted
        self._lr = 0.0

    def _accept(self, header: PushHeader, chunks: Iterable[bytes | memoryview]) -> PushOutcome:
        state = self.state
        with self._recv_lock:
            with state.cond:
                if header.token != state.step:
                    return PushOutcome(STALE, state.step, (
                        f"gradient of worker {header.worker_id} was computed on step "
                        f"{header.token} but shard {state.layout.index} is at step {state.step}"))
                epoch = self._epoch
            try:
                receive_into(None, chunks, header.numel, who=self._who(header),
                             on_chunk=lambda first, values: self._add(header, first, values))
            except BaseException:
                if self._dirty:
                    self._void()
                raise
            with state.cond:
                self._dirty = False
                self._count += 1
                self._contributors.append(header.worker_id)
                self._lr = header.lr
                if self._count >= min(self.config.required, self._live()):
                    self._complete()
                    return PushOutcome(APPLIED, state.step)
        return self._wait_for_step(header, epoch)

    def _add(self, header: PushHeader, first: int, values: np.ndarray) -> None:
        bad = self.state.find_nonfinite(values, base=first)
        if bad is not None:
            raise InvalidArgumentError(self.state.nonfinite_message(header, bad))
        self._dirty = True
        self._acc[first:first + values.size] += values

    def _complete(self) -> None:
        """Average and apply the step's sum (caller holds the receive lock and cond)."""
        self._acc *= np.float32(1.0 / self._count)
        self.state.apply(self._acc, self._lr)
        self._reset()

    def _reset(self) -> None:
        self._acc.fill(0.0)
        self._count = 0
        self._contributors.clear()
        self._dirty = False
        self._epoch += 1
        self.state.cond.notify_all()

    def _void(self) -> None:
        """Drop the step's partial sum (a push refused part way was summed into it)."""
        with self.state.cond:
            self._reset()

    def _wait_for_step(self, header: PushHeader, epoch: int) -> PushOutcome:
        state = self.state
        deadline = time.monotonic() + self.config.timeout
        with state.cond:
            while self._epoch == epoch and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceededError(self._missing_message(header))
                state.cond.wait(remaining)
            if state.step > header.token:
                return PushOutcome(APPLIED, state.step)
            return PushOutcome(VOIDED, state.step, (
                f"step {header.token} of shard {state.layout.index} was voided by a refused "
                "gradient; compute it again"))

    def _missing_message(self, header: PushHeader) -> str:
        state = self.state
        got = sorted(set(self._contributors))
        missing = [w for w in range(self.config.total_num_replicas)
                   if w not in got and w not in self._done]
        return (f"Step {header.token} of ps shard {state.layout.index} waited "
                f"{self.config.timeout:.0f} s for {self.config.required} gradients but received "
                f"{self._count} (from worker {', '.join(map(str, got)) or 'none'}); missing: "
                f"{', '.join(self.describe_worker(w) for w in missing) or 'none'}. "
                "Restart the missing workers or add backup workers.")

    def worker_done(self, worker_id: int) -> None:
        with self._recv_lock, self.state.cond:
            self._done.add(worker_id)
            if self._count and self._count >= min(self.config.required, self._live()):
                self._complete()
            self.state.cond.notify_all()


_KINDS: dict[str, type[Aggregator]] = {
    "async": _AsyncAggregator,
    "sync": _SyncAggregator,
    "ssp": _SSPAggregator,
}


def make_aggregator(state: ShardState, config: AggregationConfig,
                    describe_worker: Callable[[int], str] | None = None) -> Aggregator:
    """Return the aggregator of ``config.mode`` over ``state``.

    ``describe_worker(replica)`` names a worker in error messages (default
    ``/job:worker/task:<replica>``).
    """
    aggregator = _KINDS[config.mode](state, config)
    if describe_worker is not None:
        aggregator.describe_worker = describe_worker
    return aggregator


def _unapplied(first: int, values: np.ndarray, done: int) -> tuple[int, np.ndarray]:
    """The part of chunk ``values`` (elements ``first..``) from element ``done`` on."""
    skip = min(max(done - first, 0), values.size)
    return first + skip, values[skip:]


def _worker_label(worker_id: int) -> str:
    return f"/job:worker/task:{worker_id}"

