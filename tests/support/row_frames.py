"""Framed ``RowBatch`` messages for tests that speak the wire directly.

:func:`frame` turns ``PushPullRowsRequest`` items written with their ids and
gradients inside (as a reader of ``tables.proto`` would write them) into the
framed request the ps reads: the header with those fields emptied, then the
buffers end to end. :func:`unframe` puts a framed reply's rows back into its
items, and returns the dense reply, if any.
"""

from __future__ import annotations

from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.framing import pack_parts, split_parts, unpack


def frame(items, dense: bytes = b"") -> bytes:
    request = tpb.RowBatchRequest(dense=bool(dense))
    parts: list[bytes] = []
    for item in items:
        entry = request.items.add()
        entry.CopyFrom(item)
        parts.append(entry.pull.ids)
        entry.pull.ids = b""
        if entry.HasField("push"):
            parts += [entry.push.ids, entry.push.grads]
            entry.push.ids = entry.push.grads = b""
    if dense:
        parts.append(dense)
    request.parts.extend(len(p) for p in parts)
    return pack_parts(request.SerializeToString(), parts)


def unframe(data: bytes) -> tuple[tpb.RowBatchReply, bytes]:
    head, payload = unpack(data)
    reply = tpb.RowBatchReply.FromString(head)
    parts = split_parts(payload, reply.parts, "RowBatchReply")
    for answer, part in zip(reply.items, parts, strict=False):
        answer.pull.rows = bytes(part)
    return reply, bytes(parts[-1]) if reply.dense else b""
