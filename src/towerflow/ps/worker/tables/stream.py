"""A worker's long-lived ``RowBatchStream`` call to one ps task's table service.

The tables' hot path (pulls, pushes and push-and-pulls of their rows, every
step) travels on one bidirectional stream per ps task, not one unary call per
request: the requests are ``RowBatchRequest`` messages (one per step for all
the tables the step touches; an item pulling no ids with a push is a push
alone), the replies ``RowBatchReply`` messages, one per request and in order. How the stream queues, authenticates and ages out is
:class:`~towerflow.cluster.transport.RequestStream`'s (the dense push stream is
one too). Exactly-once pushes do not depend on the stream: a request sent again
on a new stream carries the same ``(worker_id, incarnation, seq)`` and the ps
answers it from its push table.
"""

from __future__ import annotations

import grpc

from towerflow.cluster.transport import RequestStream
from towerflow.ps.wire import tables_pb2 as tpb

__all__ = ["RowStream", "STREAM_METHOD"]

#: the full name of the stream's method
STREAM_METHOD = f"/{tpb.DESCRIPTOR.services_by_name['Tables'].full_name}/RowBatchStream"


class RowStream(RequestStream):
    """One open ``RowBatchStream`` call to a ps task (a :class:`RequestStream`).

    Args:
        channel: an authenticated channel to the ps task.
        timeout: the longest one request may take (seconds).
        first: the first request.
    """

    __slots__ = ()

    def __init__(self, channel: grpc.Channel, timeout: float, first: bytes) -> None:
        super().__init__(channel, STREAM_METHOD, timeout, first)
