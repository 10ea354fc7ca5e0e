"""Where a worker's table calls of each shard go, and their switch to the shard's replica.

With ``replicas=1`` (the job's ``AggregationConfig``) every ``RowBatch`` names
the term of its shard, and a shard whose primary is gone is switched to its
replica as the dense client does
(:class:`~towerflow.ps.worker.failover.ShardRoute`): the calls in flight are
sent again there (a pushed ``(worker_id, incarnation, seq)`` applies once),
re-framed with the new term (the dense push a batch carries too). With
``replicas=0`` the calls go to ps task ``shard`` as they are.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from towerflow.cluster.transport import unary
from towerflow.errors import DeadlineExceededError, FailedPreconditionError, UnavailableError
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.framing import pack_parts, split_parts, unpack
from towerflow.ps.worker.failover import ShardRoute, routed_push
from towerflow.ps.worker.tables.batch import Call

__all__ = ["TableRouting", "send_calls"]

logger = logging.getLogger("towerflow.ps")

_ROW_BATCH = f"/{tpb.DESCRIPTOR.services_by_name['Tables'].full_name}/RowBatch"


class TableRouting:
    """The ps task and term of every shard for the table calls.

    Args:
        channels: the worker's channel to each ps task.
        replicas: the job's live copies of each shard (0: every call to ps task ``shard``).
    """

    def __init__(self, channels: Sequence[Any], replicas: int = 0) -> None:
        self.channels = channels
        self.routes = [ShardRoute(i, len(channels), channels.__getitem__)
                       for i in range(len(channels))] if replicas else None

    def adopt(self, routes: Sequence[ShardRoute]) -> None:
        """Share ``routes`` (one per shard, the worker's dense client's): a switch one client
        makes serves the other's calls at once. No effect without replicas."""
        if self.routes is not None and len(routes) == len(self.routes):
            self.routes = list(routes)

    def channel(self, shard: int) -> Any:
        """The channel to the task serving ``shard`` now."""
        return self.channels[shard if self.routes is None else self.routes[shard].task]

    def where(self, shard: int) -> tuple[int, int] | None:
        """``(task, term)`` of ``shard`` now (None: no replicas)."""
        return None if self.routes is None else self.routes[shard].where()

    def payload(self, call: Call) -> bytes:
        """``call``'s request naming its shard's term now (re-framed when it names another)."""
        if self.routes is None:
            return call.payload
        term = self.routes[call.shard].term
        head, payload = unpack(call.payload)
        request = tpb.RowBatchRequest.FromString(head)
        parts = split_parts(payload, request.parts, "RowBatchRequest")
        dense = routed_push(parts[-1], call.shard, term) if request.dense else None
        if request.term == term and (dense is None or dense is parts[-1]):
            return call.payload
        request.term = term
        if dense is not None:
            parts[-1] = dense
            request.parts[-1] = len(dense)
        return pack_parts(request.SerializeToString(), parts)

    def switch(self, shard: int, before: tuple[int, int] | None, exc: Exception) -> bool:
        """After a call of ``shard`` sent at ``before`` failed with ``exc``: whether the
        shard is served elsewhere now (send the call again there)."""
        return before is not None and self.routes[shard].fail_over(before, exc)

    def refusal(self, shard: int) -> str:
        """Why ``shard`` could not be switched ("" when nothing was refused)."""
        return "" if self.routes is None else self.routes[shard].refusal


def send_calls(queue: list[Call], routing: TableRouting, *, timeout: float, retries: int,
               wait_forever: bool) -> list[bytes]:
    """The replies of ``queue``'s calls, sent one after the other as unary ``RowBatch``
    calls, each sent again on UNAVAILABLE / DEADLINE_EXCEEDED up to ``retries`` times (for
    ever with ``wait_forever`` on a deadline), and on the shard's replica once its primary
    is gone (a row stream still open to the old task fails, and is dropped, by itself)."""
    replies = []
    for call in queue:
        attempt = itertools.count()
        while True:
            before = routing.where(call.shard)
            try:
                replies.append(unary(routing.channel(call.shard), _ROW_BATCH,
                                     routing.payload(call), timeout=timeout))
                break
            except (UnavailableError, DeadlineExceededError, FailedPreconditionError) as exc:
                if routing.switch(call.shard, before, exc):
                    continue
                if isinstance(exc, FailedPreconditionError):
                    raise
                tries = next(attempt)
                forever = wait_forever and isinstance(exc, DeadlineExceededError)
                if not call.retry or (tries >= retries and not forever):
                    why = routing.refusal(call.shard)
                    if why:
                        raise type(exc)(f"{exc} {why}") from None
                    raise
                if forever:
                    logger.warning("a push to ps task %d still waits for the other workers "
                                   "(step_timeout=None); sent again (retry %d, the ps "
                                   "applies it once)", call.shard, tries + 1)
                time.sleep(min(2.0, 0.1 * 2**tries))
    return replies
