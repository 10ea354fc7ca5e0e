"""A hybrid worker's row traffic in the background (``embedding_staleness`` >= 1).

One thread sends, in order, what the steps hand it: a step's row pushes once
its all-reduce is done, and the next step's pull (its rows pulled while this
step runs, :meth:`~towerflow.ps.worker.tables.prefetch.Prefetcher.feed`). A
step's pushes ride with the pull that follows them when there is one (one
request per ps task and step, as with ``embedding_staleness=0``; the ps
applies a request's pushes before it reads its rows); else they leave alone.
So the rows of step ``s + 1``, pulled during step ``s``, hold every push of
this worker up to step ``s - 1``: at most one step behind, whatever the bound.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["RowTraffic"]


class RowTraffic:
    """The background thread of a hybrid worker's pushes and pulls ahead.

    Args:
        tables: the model's :class:`~towerflow.ps.worker.tables.sparse_tables.SparseTables`.
        outcome: ``outcome(result)`` calls ``result`` (a future's) and says what failed
            (the strategy's: a missing ps task leaves the worker unfinished).
    """

    def __init__(self, tables: Any, outcome: Callable[[Callable[[], Any]], Any]) -> None:
        self._tables = tables
        self._outcome = outcome
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="towerflow-hybrid-rows")
        #: (step, the future that sends its pushes), oldest first
        self._pushes: collections.deque[tuple[int, Future]] = collections.deque()
        self._riding: int | None = None  # a step whose pushes wait for the next pull ahead

    def pushed(self, step: int, *, ride: bool) -> None:
        """Step ``step``'s pushes are deferred in the table client: they ride with the next
        pull ahead (``ride``: the next step will pull one) or leave now."""
        self.send_riding()
        if ride:
            self._riding = step
        else:
            self._pushes.append((step, self._thread.submit(self._tables.flush)))

    def pull_later(self, lookups: list[Any]) -> Future:
        """Pull a later forward's rows on the thread, with the pushes that wait for it."""
        future = self._tables.pull_later(lookups, self._thread.submit)
        if self._riding is not None:
            self._pushes.append((self._riding, future))
            self._riding = None
        return future

    def send_riding(self) -> None:
        """The pushes waiting for a pull ahead leave now (no pull came)."""
        if self._riding is not None:
            self._pushes.append((self._riding, self._thread.submit(self._tables.flush)))
            self._riding = None

    def bound(self, oldest: int) -> None:
        """Wait until this worker's pushes of steps up to ``oldest`` are applied."""
        if self._riding is not None and self._riding <= oldest:
            self.send_riding()
        pushes = self._pushes
        while pushes and pushes[0][0] <= oldest:
            self._outcome(pushes.popleft()[1].result)

    def drain(self) -> None:
        """Everything handed to the thread done: the pushes sent, a pull ahead returned."""
        self.send_riding()
        self._thread.submit(lambda: None).result()

    def close(self, *, wait: bool) -> None:
        """Stop the thread; ``wait``: for the pushes' outcomes first (raising their errors)."""
        try:
            if wait:
                self.send_riding()
            pushes, self._pushes = self._pushes, collections.deque()
            for _, push in pushes:
                if wait:
                    push.result()
        finally:
            self._thread.shutdown(wait=True)
