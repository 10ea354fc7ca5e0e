"""The sync aggregator of a dense shard (``tf.train.SyncReplicasOptimizer``'s semantics).

:class:`SyncAggregator` sums the pushes of a step chunk by chunk into one
accumulator, averages and applies the step once, and answers its pushes; the
rules (admission, stale and stalled pushes, voided steps) are those of
:mod:`~towerflow.ps.server.dense.aggregation`'s module doc, whose
:func:`~towerflow.ps.server.dense.shard.make_aggregator` makes it.

With ``replicas=1`` the step is applied, counted and its pushes answered in
the push table under the admission's lock, where the replica link reads its
copy (:class:`SyncAggregator.gated` is False): every worker of a step is
answered after the copy holding it reached the replica
(:meth:`~towerflow.ps.server.dense.replication.ReplicaLink.forward`). A step
cut off by the primary's end is not on the copy: its workers send their pushes
again to the replica that took over, which sums them afresh. With two replicas
the sum is the same, bit for bit, in either order (float addition commutes);
with more, it is summed in the order the pushes arrive, as without a fault.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

import numpy as np

from towerflow.errors import DeadlineExceededError, InvalidArgumentError
from towerflow.ps.server.dense import checks
from towerflow.ps.server.dense.admission import Admission
from towerflow.ps.server.dense.aggregation import STALL_SECONDS, Aggregator
from towerflow.ps.server.dense.store import DenseStore
from towerflow.ps.server.pushes import Pending
from towerflow.ps.wire.calls import APPLIED, STALE, VOIDED, bounded
from towerflow.ps.wire.framing import receive_into
from towerflow.ps.wire.messages import AggregationConfig, PushHeader, PushOutcome

__all__ = ["SyncAggregator"]


class SyncAggregator(Aggregator):
    """Averages the gradients of ``replicas_to_aggregate`` distinct replicas, applies once.

    Pushes are summed chunk by chunk into one accumulator (see the module doc). The step
    changes the shard in :meth:`_complete`, under the admission's lock: a replica's copy
    is read under it (no gate).
    """

    gated = False

    def __init__(self, store: DenseStore, admission: Admission,
                 config: AggregationConfig) -> None:
        super().__init__(store, admission, config)
        self._acc = np.zeros(store.layout.numel, np.float32)
        #: replicas whose whole gradient is in the step's sum
        self._counted: set[int] = set()
        #: replicas admitted to the step -> elements of their gradient summed (a prefix)
        self._summed: dict[int, int] = {}
        #: admitted replicas whose push is arriving now -> that push's record
        self._arriving: dict[int, Pending] = {}
        #: admitted replicas -> time.monotonic() of their last chunk summed (or admission)
        self._progress: dict[int, float] = {}
        #: chunks being summed now (outside the admission's lock)
        self._summing = 0
        #: the step's attempts: a push sums into the attempt it was admitted to only
        self._attempt = 0
        #: the pushes the step answers when it is applied, with their waiters
        self._waiting: list[tuple[PushHeader, Pending]] = []
        self._lr = 0.0

    def _accept(self, header: PushHeader, pending: Pending, chunks: Iterable[bytes | memoryview],
                active: Callable[[], bool] | None) -> PushOutcome:
        admission, worker = self.admission, header.worker_id
        with admission.locked():
            try:
                admitted = self._admit(header, pending, active)
            except DeadlineExceededError:
                admission.drop_push(header)  # nothing of it was summed: its retry starts afresh
                raise
            if admitted is None:
                return self._stale(header)
            attempt = self._attempt
        if admitted:
            try:
                receive_into(None, chunks, header.numel, who=self._who(header),
                             on_chunk=lambda first, values: self._sum(
                                 header, pending, attempt, first, values))
            except _StepEnded:
                pass  # the step was voided meanwhile: the push is answered
            except BaseException:
                with admission.locked():
                    self._leave(header, pending)
                raise
            with admission.locked():
                if self._arriving.get(worker) is pending:
                    del self._arriving[worker]
                    if pending.outcome is None and attempt == self._attempt:
                        self._counted.add(worker)
                        self._lr = header.lr
                        if self._ready():
                            self._complete()
                admission.notify()
        return admission.wait_outcome(pending, self.config.timeout,
                                  lambda: self._missing_message(header), active)

    def _admit(self, header: PushHeader, pending: Pending,
               active: Callable[[], bool] | None) -> bool | None:
        """Whether the push sums its gradient into the step (caller holds the admission's lock).

        True: admitted (it joins the step's waiting pushes); False: its replica's
        gradient is in the step already, it waits with it; None: stale. Waits
        while the step has all the replicas it admits, or while another push of
        the same replica arrives.
        """
        admission, worker = self.admission, header.worker_id
        deadline = admission.deadline(self.config.timeout)
        while True:
            if header.token != admission.step:
                return None
            if worker in self._counted:  # a replica counts once per step
                self._waiting.append((header, pending))
                return False
            if worker not in self._arriving and (
                    worker in self._summed or len(self._summed) < self._needed()):
                self._summed.setdefault(worker, 0)
                self._arriving[worker] = pending
                self._progress[worker] = time.monotonic()
                self._waiting.append((header, pending))
                return True
            if worker not in self._summed and self._void_stalled(header):
                continue
            admission.wait_once(deadline, lambda: self._missing_message(header), active,
                            most=STALL_SECONDS / 4)

    def _void_stalled(self, header: PushHeader) -> bool:
        """Void the step when an admitted replica's part sum holds it while ``header``'s replica
        waits to be admitted (caller holds the admission's lock); True when it did."""
        now = time.monotonic()
        for worker, summed in self._summed.items():
            if worker in self._counted or not summed:
                continue
            idle = now - self._progress.get(worker, now)
            if idle >= STALL_SECONDS:
                self._void(
                    f"step {self.admission.step} of ps shard {self.store.layout.index} was voided: "
                    f"the push of worker {worker} stopped after {summed} of "
                    f"{self.store.layout.numel} values were summed (no chunk for {idle:.0f} s) "
                    f"while worker {header.worker_id} waited; compute the step again, and check "
                    f"worker {worker} and its network")
                return True
        return False

    def _sum(self, header: PushHeader, pending: Pending, attempt: int, first: int,
             values: np.ndarray) -> None:
        """Check one chunk and add it to the step's sum (skipping what was summed already)."""
        store, admission, worker = self.store, self.admission, header.worker_id
        with admission.locked():
            if pending.outcome is not None or attempt != self._attempt:
                raise _StepEnded
            done = self._summed[worker]
            if first + values.size <= done:
                return
            if first < done:
                values, first = values[done - first:], done
            self._summing += 1
        bad = None
        try:
            with admission.holding(values.nbytes, self._who(header)):
                bad = store.find_nonfinite(values, first)
                if bad is None:
                    store.add_range(self._acc, first, values)
        finally:
            with admission.locked():
                self._summing -= 1
                if bad is None and attempt == self._attempt:
                    self._summed[worker] = first + values.size
                    self._progress[worker] = time.monotonic()
                admission.notify()
        if bad is not None:
            with admission.locked():
                if attempt == self._attempt:
                    self._void(checks.voided_message(store.layout, header, bad, admission.step))
            raise _StepEnded

    def _leave(self, header: PushHeader, pending: Pending) -> None:
        """A push cut off: its replica's prefix stays in the sum for its retry (caller holds
        the admission's lock); a replica with nothing summed gives its place up."""
        worker = header.worker_id
        if self._arriving.get(worker) is pending:
            del self._arriving[worker]
            if not self._summed.get(worker):
                self._summed.pop(worker, None)
        with contextlib.suppress(ValueError):
            self._waiting.remove((header, pending))
        self.admission.notify()

    def _ready(self) -> bool:
        """Enough replicas counted and no gradient summed in part (caller holds the lock)."""
        return (len(self._counted) >= self._needed() and not self._arriving
                and all(w in self._counted for w, n in self._summed.items() if n))

    def _void(self, message: str) -> None:
        """Answer every push of the step ``voided`` and reset the sum (caller holds the lock)."""
        self._attempt += 1  # no chunk sums into this attempt any more
        while self._summing:
            self.admission.wait_once(None, lambda: "")
        self._answer(PushOutcome(VOIDED, self.admission.step, bounded(message)))

    @property
    def counted(self) -> int:
        """Replicas whose gradient is in the current step's sum."""
        with self.admission.locked():
            return len(self._counted)

    def _stale(self, header: PushHeader) -> PushOutcome:
        return PushOutcome(STALE, self.admission.step, (
            f"gradient of worker {header.worker_id} was computed on step {header.token} but "
            f"shard {self.store.layout.index} is at step {self.admission.step}"))

    def _needed(self) -> int:
        return min(self.config.required, self._live())

    def _complete(self) -> None:
        """Average and apply the step's sum; answer its pushes (caller holds the admission's
        lock)."""
        self._attempt += 1
        self._acc *= np.float32(1.0 / len(self._counted))
        try:
            self.store.check_update([(0, self._acc)], self._lr, "the step's averaged gradient")
        except InvalidArgumentError as exc:  # the step is not applied; its pushes are answered
            self._answer(PushOutcome(VOIDED, self.admission.step,
                                     bounded(f"step {self.admission.step} was not applied: {exc}")))
            return
        self.store.apply(self._acc, self._lr)
        step = self.admission.commit_update()
        self._answer(PushOutcome(APPLIED, step))

    def _answer(self, outcome: PushOutcome) -> None:
        waiting, self._waiting = self._waiting, []
        self._acc.fill(0.0)
        self._counted.clear()
        self._summed.clear()
        self._arriving.clear()
        self._progress.clear()
        for header, pending in waiting:
            self.admission.finish_push(header, outcome)
            if pending.outcome is None:
                # a replica's incarnation superseded by its restart while its push waited:
                # the push table no longer holds it, but its gradient is in the step
                pending.outcome = outcome
        self.admission.notify()

    def _missing_message(self, header: PushHeader) -> str:
        got = sorted(self._counted)
        missing = [w for w in range(self.config.total_num_replicas)
                   if w not in got and w not in self._done]
        timeout = self.config.timeout or 0.0
        return (f"Step {header.token} of ps shard {self.store.layout.index} waited "
                f"{timeout:.0f} s for {self.config.required} gradients but received "
                f"{len(got)} (from worker {', '.join(map(str, got)) or 'none'}); missing: "
                f"{', '.join(self.describe_worker(w) for w in missing) or 'none'}. "
                "Restart the missing workers or add backup workers.")

    def worker_done(self, worker_id: int) -> None:
        self.config.check_replica(worker_id, "Done")
        with self.admission.locked():
            self._done.add(worker_id)
            if self._counted and self._ready():
                self._complete()
            self.admission.notify()

    def close(self) -> None:
        with self.admission.locked():
            self._closed = True
            self._void(f"ps shard {self.store.layout.index} was re-initialised before step "
                       f"{self.admission.step} was applied; compute it again")


class _StepEnded(Exception):
    """The sync step a push was summing into was voided: the push is answered already."""
