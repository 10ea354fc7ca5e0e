"""``towerflow.DynamicEmbedding``: a dynamic table that also runs in one process.

This module joins the two halves of the ps wing in one process (the worker's
module and a ps task's row store), which no package below the top may do.

Under the ``ParameterServer`` strategy the module is bound to the ps tasks
as any :class:`~towerflow.ps.worker.tables.dynamic.DynamicEmbedding`. With
no strategy, its first forward binds it to a :class:`LocalTableClient`: the
same row store a ps shard runs
(:class:`~towerflow.ps.server.tables.dynamic.DynamicRowStore`, one shard,
in this process), so lookups, first-touch rows, admission, eviction, the
row-wise optimizers and :meth:`DynamicEmbedding.stats` behave as on a
cluster. A step's row gradients are applied by
:meth:`DynamicEmbedding.apply_updates` (after ``loss.backward()``, beside the
dense optimizer's ``step()``), as the strategy pushes them on a cluster.

Example:
    >>> import torch, towerflow
    >>> emb = towerflow.DynamicEmbedding(2, initializer={"kind": "constant", "value": 0.0})
    >>> emb(torch.tensor([2**63 - 1])).sum().backward()
    >>> emb.apply_updates(lr=0.5)
    >>> emb(torch.tensor([2**63 - 1, -1])).tolist(), emb.stats()["rows"]
    ([[-0.5, -0.5], [0.0, 0.0]], 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from towerflow.errors import FailedPreconditionError, InvalidArgumentError
from towerflow.ps.partition import check_ids
from towerflow.ps.server.tables.stores import row_store_from_dict
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.wire import tables_pb2 as tpb
from towerflow.ps.wire.tables import describe_table_spec, table_spec
from towerflow.ps.worker.tables.dynamic import DynamicEmbedding as _ClusterDynamicEmbedding

__all__ = ["DynamicEmbedding", "LocalTableClient"]

#: the row-wise optimizer of a one-process table built without one
LOCAL_OPTIMIZER = {"name": "sgd", "hyper": {}}


class LocalTableClient:
    """The part of a table client a dynamic table needs, over row stores in this process.

    Args:
        config: the table (its partitioner's shards are all held here).
    """

    every_shard = False

    def __init__(self, config: TableConfig) -> None:
        self.config = config
        # each shard's store as a ps task builds it from the table's TableSpec message
        self.stores = [row_store_from_dict(describe_table_spec(table_spec(config, shard)))
                       for shard in range(config.partitioner.num_shards)]

    def pull(self, config: TableConfig, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (int64): held rows, or the initializer's values."""
        ids = check_ids(ids)
        out = torch.empty((ids.numel(), config.dim), dtype=config.dtype)
        for shard, (positions, shard_ids) in enumerate(config.partitioner.split(ids)):
            if shard_ids.numel():
                out.index_copy_(0, positions, self.stores[shard].lookup(shard_ids))
        return out

    def push_many(self, pushes: Sequence[tuple[TableConfig, torch.Tensor, torch.Tensor, bool]],
                  *, lr: float, step: int) -> None:
        """Apply each ``(config, ids, grads, _)``: every value checked before any is applied."""
        checked = []
        for config, ids, grads, _ in pushes:
            ids = check_ids(ids)
            if grads.numel() and not bool(torch.isfinite(grads).all()):
                bad = int((~torch.isfinite(grads)).any(dim=1).nonzero()[0, 0])
                raise InvalidArgumentError(
                    f"Table {config.name!r}: the row gradient of id {int(ids[bad])} holds "
                    f"{grads[bad].tolist()[:8]}, not finite; nothing was applied. Find where "
                    "the NaN or infinity comes from (lower the learning rate or clip gradients)."
                )
            checked.append((config.partitioner.split(ids), grads.to(config.dtype)))
        for parts, grads in checked:
            for shard, (positions, shard_ids) in enumerate(parts):
                store = self.stores[shard]
                store.observe(shard_ids)
                store.apply(shard_ids, grads.index_select(0, positions), lr, step)

    def status(self, config: TableConfig, shard: int) -> Any:
        """A ``TableStatusReply`` of one local shard."""
        store = self.stores[shard]
        counters = getattr(store, "counters", {})
        return tpb.TableStatusReply(rows=store.num_rows, nbytes=store.nbytes, **counters)

    def flush(self, config: TableConfig | None = None) -> list[Any]:
        """Nothing is deferred in one process."""
        return []


class DynamicEmbedding(_ClusterDynamicEmbedding):
    """:class:`towerflow.ps.worker.tables.dynamic.DynamicEmbedding`, runnable in one process.

    Unbound at its first forward (no ``ParameterServer`` strategy), it keeps
    its table in this process (see the module docstring); the optimizer is
    the one given, else plain SGD. Call :meth:`apply_updates` after each
    backward.
    """

    def _bind_local(self) -> None:
        config = self.make_config(self.table_name or "dynamic_embedding", 1, LOCAL_OPTIMIZER)
        self.bind(LocalTableClient(config), config)  # type: ignore[arg-type]
        self._local_step = 0

    def load_rows(self, ids: torch.Tensor, rows: torch.Tensor,
                  versions: torch.Tensor | None = None) -> None:
        """Set the rows of ``ids`` in this process's table (a ps checkpoint read for
        ``towerflow eval`` or a resume in one process; optimizer slots start afresh).

        Raises:
            FailedPreconditionError: the table is on ps tasks.
        """
        if self._client is None:
            self._bind_local()
        if not isinstance(self._client, LocalTableClient):
            raise FailedPreconditionError(
                "load_rows() is for a DynamicEmbedding in one process; on ps tasks a "
                "checkpoint's rows are restored by the strategy.")
        ids = check_ids(ids)
        for shard, (positions, shard_ids) in enumerate(self.config.partitioner.split(ids)):
            if shard_ids.numel():
                self._client.stores[shard].import_(  # type: ignore[call-arg]
                    shard_ids, rows.index_select(0, positions).to(self.dtype), None,
                    None if versions is None else versions.index_select(0, positions))

    def apply_updates(self, lr: float, step: int | None = None) -> None:
        """Apply the row gradients of the lookups since the last call (one process only).

        Args:
            lr: the learning rate.
            step: the update's number (the table's clock for eviction and lazy
                Adam); default: one more than the last.

        Raises:
            FailedPreconditionError: the table is on ps tasks (the strategy
                pushes its gradients).
            InvalidArgumentError: a gradient is NaN or infinite (nothing applied).
        """
        if self._client is None:
            self._bind_local()
        if not isinstance(self._client, LocalTableClient):
            raise FailedPreconditionError(
                "apply_updates() is for a DynamicEmbedding in one process; under the "
                "ParameterServer strategy its row gradients are pushed by the strategy's step."
            )
        step = self._local_step + 1 if step is None else step
        taken = self.take_row_grads()
        if taken is not None:
            self._client.push_many([(self.config, *taken, False)], lr=lr, step=step)
        self._local_step = step
