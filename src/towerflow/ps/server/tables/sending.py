"""A table push's copies to the replicas, sent before the push is answered (``replicas=1``).

- :func:`forward` — return once the copies of the table shards a push changed hold it;
- :class:`CopySender` — a ``RowBatch`` that carries a dense push too sends its rows'
  copies while the dense step runs (its own copy included), so the two copies' round
  trips to the replica's task overlap instead of following each other.

This module imports no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["CopySender", "forward"]

_T = TypeVar("_T")
#: rows' copies sent at once beside dense steps (one per RowBatch in flight)
_SENDERS = 8


def forward(*shards: Any) -> None:
    """Return once the replicas of ``shards`` (``TableShard``) hold what was applied to them
    (no effect on a shard without a replica)."""
    for shard in dict.fromkeys(shards):
        if shard.replica is not None:
            shard.replica.forward()


class CopySender:
    """Sends table shards' copies beside another step of the same request (see the module
    doc); its threads start with the first copy and end with :meth:`close`."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def beside(self, shards: list[Any], step: Callable[[], _T]) -> _T:
        """Run ``step()`` while the copies of ``shards`` are sent; its result, once they are
        held (an error of either is raised, the copies' after the step ended)."""
        shards = [shard for shard in shards if shard.replica is not None]
        if not shards:
            return step()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_SENDERS, thread_name_prefix="towerflow-ps-copy")
            copied = self._pool.submit(forward, *shards)
        try:
            return step()
        finally:
            copied.result()

    def close(self) -> None:
        """Stop the threads (once the copies under way were sent)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
