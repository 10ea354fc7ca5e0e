"""How a table shard turns row pushes into updates: async, sync and ssp.

The job's aggregation mode (:class:`~towerflow.ps.wire.messages.AggregationConfig`,
sent by the chief with ``InitTable``) applies to sparse pushes as to dense
ones, per row:

==========  =================================================================
``async``   every push is applied when it arrives.
``sync``    ``tf.train.SyncReplicasOptimizer`` over a
            ``SparseConditionalAccumulator``: the pushes of
            ``replicas_to_aggregate`` distinct replicas computed on the step
            being aggregated (``PushRowsRequest.step - 1``, the global step
            the worker computed on) are summed per row; each row is averaged
            over the replicas that pushed it (TensorFlow's ``MEAN``
            reduction) and the result is applied once, as one update. Each of
            those pushes is answered when that update is applied. A push
            computed on an older step is ``stale``: answered at once, not
            applied. A replica counts once per step. With
            ``total_num_replicas`` above ``replicas_to_aggregate`` the others
            are backup workers.
``ssp``     pushes are applied on arrival; a push is answered only once its
            worker is at most ``staleness`` pushes ahead of the slowest
            worker that has not said it is done.
==========  =================================================================

In ``sync`` and ``ssp`` every worker pushes to every shard each step (an
empty push when its batch touched no row there), so that a shard counts each
replica's step. A worker that says it is done (``Tables.Done``) is no longer
waited for. A push that waits stops waiting after the mode's ``timeout``
(``DeadlineExceededError`` naming the missing workers) or once its call has
ended; a sync push stays counted in its step and its retry (the same
``(worker, incarnation, seq)``) waits for the same answer.

The aggregators run with their shard's condition held and wait on it, so a
waiting push holds no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from typing import Any

import torch

from towerflow.errors import DeadlineExceededError, InvalidArgumentError, ResourceExhaustedError
from towerflow.ps.partition import coalesce
from towerflow.ps.server.pushes import (
    APPLIED,
    LIVENESS_SECONDS,
    STALE,
    VOIDED,
    Pending,
    PushHeader,
    PushOutcome,
)
from towerflow.ps.server.tables.records import MAX_PUSHES_IN_FLIGHT, JobWorkers

__all__ = ["RowAggregator", "make_row_aggregator", "wait_for"]



def wait_for(cond: Any, done: Callable[[], bool], timeout: float | None,
             message: Callable[[], str], active: Callable[[], bool] | None) -> None:
    """Wait on ``cond`` (held) until ``done()``; raise after ``timeout`` s or when ``active()`` fails.

    Raises:
        DeadlineExceededError: ``message()``, when the time is up or the call has ended.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done():
        left = None if deadline is None else deadline - time.monotonic()
        if (left is not None and left <= 0) or (active is not None and not active()):
            raise DeadlineExceededError(message())
        cond.wait(LIVENESS_SECONDS if left is None else min(LIVENESS_SECONDS, left))


class RowAggregator:
    """``async``: each push applied on arrival (the base of the other modes).

    Args:
        shard: the table shard (its ``cond``, ``name``, ``apply_rows`` and
            ``settle`` are used, with ``cond`` held).
        config: the job's ``AggregationConfig``; None: async, from the job's
            current workers (``workers``).
        workers: the job's current workers
            (:class:`~towerflow.ps.server.tables.records.JobWorkers`; None: any id).
    """

    mode = "async"

    def __init__(self, shard: Any, config: Any = None, workers: JobWorkers | None = None
                 ) -> None:
        self.shard = shard
        self.config = config
        self.workers = JobWorkers() if workers is None else workers
        self.done: set[int] = set()
        self.max_lead = 0

    def _elastic(self) -> Container[int]:
        """The elastic workers whose pushes count (async only)."""
        return self.workers.view()[1] if self.config.mode == "async" else ()

    def check(self, worker_id: int) -> None:
        """Refuse a push from a worker that is not one of the job's current workers
        (:class:`~towerflow.ps.server.tables.records.JobWorkers`; the table's own
        ``AggregationConfig`` when it has one)."""
        what = f"A push to table {self.shard.name!r}"
        if self.config is None:
            self.workers.check(worker_id, what)
        else:
            self.config.check_replica(worker_id, what, self._elastic())

    def knows_job(self) -> bool:
        """Whether the job's workers are known (else any id is current: nothing to drop)."""
        return self.config is not None or self.workers.view()[0] is not None

    def current(self, worker_id: int) -> bool:
        """Whether ``worker_id`` is one of the job's current workers (its records are kept)."""
        if self.config is None:
            return worker_id in self.workers
        return 0 <= worker_id < self.config.total_num_replicas or worker_id in self._elastic()

    def accept(self, header: PushHeader, pending: Pending, ids: torch.Tensor,
               grads: torch.Tensor, lr: float, step: int,
               active: Callable[[], bool] | None) -> PushOutcome:
        """Handle a new, checked push (registered as ``pending``); its outcome."""
        self.done.discard(header.worker_id)  # a restarted worker pushes again
        outcome = PushOutcome(APPLIED, self.shard.apply_rows(ids, grads, lr, step,
                                                             checked=True))
        self.shard.settle(header, outcome)
        return outcome

    def wait(self, header: PushHeader, pending: Pending,
             active: Callable[[], bool] | None) -> PushOutcome:
        """The outcome of a push in progress (a sync push: once its step is applied)."""
        timeout = None if self.config is None else self.config.timeout
        wait_for(self.shard.cond, lambda: pending.outcome is not None, timeout,
                 lambda: self._missing(header), active)
        return pending.outcome  # type: ignore[return-value]

    def _missing(self, header: PushHeader) -> str:
        return (f"Push {header.seq} of worker {header.worker_id} to table "
                f"{self.shard.name!r} was not answered in time; send it again.")

    def worker_done(self, worker_id: int) -> None:
        """Worker ``worker_id`` has finished: stop waiting for it (async waits for nobody).

        Raises:
            InvalidArgumentError: sync / ssp, ``worker_id`` is not one of the replicas.
        """
        if self.config is None:
            return
        self.config.check_replica(worker_id, f"Done to table {self.shard.name!r}")
        self.done.add(worker_id)
        self.shard.cond.notify_all()

    @property
    def sync_step(self) -> int:
        """The step a sync shard aggregates (0 in the other modes)."""
        return 0

    def _live(self) -> list[int]:
        total = self.config.total_num_replicas if self.config is not None else 0
        return [w for w in range(total) if w not in self.done]


class _SSPRows(RowAggregator):
    """Applied on arrival; answered once at most ``staleness`` pushes ahead of the slowest."""

    mode = "ssp"

    def __init__(self, shard: Any, config: Any, workers: JobWorkers | None = None) -> None:
        super().__init__(shard, config, workers)
        self.clocks = dict.fromkeys(range(config.total_num_replicas), 0)

    def _slowest(self) -> int:
        return min((self.clocks[w] for w in self._live()), default=0)

    def accept(self, header: PushHeader, pending: Pending, ids: torch.Tensor,
               grads: torch.Tensor, lr: float, step: int,
               active: Callable[[], bool] | None) -> PushOutcome:
        worker = header.worker_id
        self.max_lead = max(self.max_lead, self.clocks[worker] - self._slowest())
        outcome = super().accept(header, pending, ids, grads, lr, step, active)
        self.clocks[worker] += 1
        self.shard.cond.notify_all()
        bound = self.config.staleness

        def message() -> str:
            slowest = self._slowest()
            behind = [w for w in self._live() if self.clocks[w] == slowest]
            return (f"Worker {worker} waited {self.config.timeout} s on table "
                    f"{self.shard.name!r} for the slowest workers ({behind}, at push {slowest}) "
                    f"to come within staleness {bound}; its push was applied. Check that they "
                    "are alive.")

        wait_for(self.shard.cond, lambda: self.clocks[worker] - self._slowest() <= bound,
                 self.config.timeout, message, active)
        return outcome


class _SyncRows(RowAggregator):
    """Per-row averages of ``replicas_to_aggregate`` replicas' pushes, applied once a step."""

    mode = "sync"

    def __init__(self, shard: Any, config: Any, workers: JobWorkers | None = None) -> None:
        super().__init__(shard, config, workers)
        self._step = 0
        self._newest = 0  # the newest step counted (a push may be ahead of self._step)
        #: per replica counted in the step: (ids, row gradients), coalesced
        self._parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._waiting: list[tuple[PushHeader, Pending]] = []
        self._lr = 0.0

    @property
    def sync_step(self) -> int:
        return self._step

    def check(self, worker_id: int) -> None:
        """Also refuse a push while the step holds :data:`MAX_PUSHES_IN_FLIGHT` per replica."""
        super().check(worker_id)
        limit = MAX_PUSHES_IN_FLIGHT * self.config.total_num_replicas
        if len(self._waiting) >= limit:
            raise ResourceExhaustedError(
                f"A push to table {self.shard.name!r} from worker {worker_id} was refused: step "
                f"{self._step} holds {len(self._waiting)} pushes waiting, the most for "
                f"{self.config.total_num_replicas} replicas ({MAX_PUSHES_IN_FLIGHT} each); "
                "answer the waiting ones first (start the missing replicas)."
            )

    def accept(self, header: PushHeader, pending: Pending, ids: torch.Tensor,
               grads: torch.Tensor, lr: float, step: int,
               active: Callable[[], bool] | None) -> PushOutcome:
        token, worker = step - 1, header.worker_id
        if token < self._step:
            outcome = PushOutcome(STALE, self._step, (
                f"row gradients of worker {worker} were computed on step {token} but table "
                f"{self.shard.name!r} aggregates step {self._step}; not applied"))
            self.shard.settle(header, outcome)
            return outcome
        self.done.discard(worker)
        if not self._parts:
            self._step = token
        self._newest = max(self._newest, token)
        if worker not in self._parts:  # a replica counts once per step (a restarted
            self._parts[worker] = coalesce(ids, grads)  # incarnation's push waits with it)
            self._lr = lr
        self._waiting.append((header, pending))
        if len(self._parts) >= self._needed():
            self._complete()
        return self.wait(header, pending, active)

    def _needed(self) -> int:
        return max(1, min(self.config.required, len(self._live())))

    def _average(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, each row's gradient summed over the replicas and divided by how many pushed it)."""
        every = torch.cat([ids for ids, _ in self._parts.values()])
        values = torch.cat([grads for _, grads in self._parts.values()])
        if not every.numel():
            return every, values
        unique, inverse = torch.unique(every, return_inverse=True)
        sums = values.new_zeros((unique.numel(), values.shape[1])).index_add_(0, inverse, values)
        count = values.new_zeros(unique.numel()).index_add_(0, inverse,
                                                            values.new_ones(every.numel()))
        return unique, sums.div_(count.unsqueeze(1))

    def _complete(self) -> None:
        """Average each row over the replicas that pushed it, apply once, answer the step."""
        ids, grads = self._average()
        try:  # a step whose replicas touched no row here is applied as an empty update
            outcome = PushOutcome(APPLIED, self.shard.apply_rows(ids, grads, self._lr,
                                                                 self._newest + 1))
        except InvalidArgumentError as exc:  # e.g. an average that overflowed
            outcome = PushOutcome(VOIDED, self._step, f"step {self._step} was not applied: {exc}")
        waiting, self._waiting = self._waiting, []
        self._parts.clear()
        self._step = self._newest + 1
        for header, pending in waiting:
            self.shard.settle(header, outcome)
            if pending.outcome is None:  # a superseded incarnation's push, counted in the step
                pending.outcome = outcome
        self.shard.cond.notify_all()

    def _missing(self, header: PushHeader) -> str:
        got = sorted(self._parts)
        missing = [w for w in self._live() if w not in got]
        return (f"Step {self._step} of table {self.shard.name!r} shard {self.shard.shard} waited "
                f"{self.config.timeout} s for {self.config.required} replicas' row gradients "
                f"but has {len(got)} (from worker {', '.join(map(str, got)) or 'none'}); missing: "
                f"worker {', '.join(map(str, missing)) or 'none'}. Restart the missing workers or "
                "add backup workers; the push of worker "
                f"{header.worker_id} stays counted and its retry waits for the step.")

    def worker_done(self, worker_id: int) -> None:
        super().worker_done(worker_id)
        if self._parts and len(self._parts) >= self._needed():
            self._complete()
        self.shard.cond.notify_all()


_KINDS: dict[str, type[RowAggregator]] = {"async": RowAggregator, "sync": _SyncRows,
                                          "ssp": _SSPRows}


def make_row_aggregator(shard: Any, config: Any = None, workers: JobWorkers | None = None
                        ) -> RowAggregator:
    """The aggregator of ``config.mode`` (async when ``config`` is None) for ``shard``;
    ``workers``: the job's current workers (None: any id)."""
    kind = RowAggregator if config is None else _KINDS[config.mode]
    return kind(shard, config, workers)
