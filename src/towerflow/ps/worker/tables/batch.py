"""The wire pieces of a worker's table requests: raw buffers, items and batched calls.

A step's table traffic to one ps task is one framed ``RowBatchRequest``
(``tables.proto``): one :class:`Item` per table shard pulled and / or pushed,
gathered into :class:`Call`s of at most ``max_call_bytes`` (:func:`group_calls`).
Ids, row gradients and rows travel as raw little-endian buffers after the
header (:func:`~towerflow.ps.wire.tensors.raw_bytes` out,
:func:`~towerflow.ps.wire.tensors.decode` in: a view of the received bytes).
"""

from __future__ import annotations

from typing import Any

import torch

from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.framing import pack_parts
from towerflow.ps.wire.tensors import raw_bytes

__all__ = ["Call", "Item", "Push", "batch_call", "group_calls"]


class Item:
    """One ``PushPullRowsRequest`` of a batch: a pull of the ``count`` ids ``ids`` of one table
    shard (``count`` 0: a push alone), maybe with a push (its ``PushRowsRequest`` header, ids
    and row gradients), and where its rows go (``out`` at ``positions``, rows of ``dim``
    values of ``dtype``)."""

    __slots__ = ("table", "shard", "ids", "count", "push", "out", "positions")

    def __init__(self, table: str, shard: int, *, ids: torch.Tensor | None = None,
                 count: int = 0, push: Push | None = None, out: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None) -> None:
        self.table, self.shard, self.ids, self.count, self.push = table, shard, ids, count, push
        self.out, self.positions = out, positions

    def nbytes(self) -> int:
        """Bytes of the ids and rows it asks for or pushes (what a call's size counts)."""
        pulled = 0 if self.out is None else self.count * (8 + self.out[0:0].element_size()
                                                          * self.out.shape[1])
        return pulled + (0 if self.push is None else self.push.nbytes())


class Push:
    """A push of row gradients as it travels in a framed batch: the ``PushRowsRequest``
    header (its ``ids`` and ``grads`` fields empty) and the two tensors."""

    __slots__ = ("header", "ids", "grads")

    def __init__(self, header: Any, ids: torch.Tensor, grads: torch.Tensor) -> None:
        self.header, self.ids, self.grads = header, ids, grads

    def nbytes(self) -> int:
        return self.ids.numel() * 8 + self.grads.numel() * self.grads.element_size()


def batch_call(shard: int, items: list[Item], dense: bytes = b"") -> Call:
    """The framed ``RowBatchRequest`` of ``items`` (all of ``shard``) as one call: the header,
    then the ids and gradients as raw buffers (each copied once, into the request), and the
    ps task's ``dense`` push-and-pull request when given."""
    request = tpb.RowBatchRequest(dense=bool(dense))
    parts: list[bytes | memoryview] = []
    pulls = pushes = False
    for item in items:
        entry = request.items.add()
        entry.pull.table, entry.pull.shard = item.table, item.shard
        if item.count:
            entry.pull.num_ids = item.count
            pulls = True
        parts.append(raw_bytes(item.ids) if item.count else b"")
        if item.push is not None:
            entry.push.CopyFrom(item.push.header)
            parts += [raw_bytes(item.push.ids), raw_bytes(item.push.grads)]
            pushes = True
    if dense:
        parts.append(dense)
    request.parts.extend(len(part) for part in parts)
    kind = "PushPullRows" if pulls and pushes else "PullRows" if pulls else \
        "PushRows" if pushes else "Dense"
    return Call(shard, kind, pack_parts(request.SerializeToString(), parts), True, items)


def group_calls(shard: int, items: list[Item], limit: int, dense: bytes = b"") -> list[Call]:
    """``items`` of one shard in calls of at most ``limit`` bytes of rows (in order); the
    first carries ``dense`` (a call of no item when there are none)."""
    calls: list[Call] = []
    batch: list[Item] = []
    size = 0
    for item in items:
        n = item.nbytes()
        if batch and size + n > limit:
            calls.append(batch_call(shard, batch, b"" if calls else dense))
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch or not calls and dense:
        calls.append(batch_call(shard, batch, b"" if calls else dense))
    return calls


class Call:
    """One request to one ps task: its kind (``PullRows``, ``PushRows``, ``PushPullRows``,
    ``Dense``: only a dense push-and-pull; the
    ``wire`` counters' key), its ``RowBatchRequest`` bytes, whether it may be sent again, and
    the items it carries."""

    __slots__ = ("shard", "method", "payload", "retry", "items")

    def __init__(self, shard: int, method: str, payload: bytes, retry: bool,
                 items: list[Item]) -> None:
        self.shard, self.method, self.payload, self.retry = shard, method, payload, retry
        self.items = items
