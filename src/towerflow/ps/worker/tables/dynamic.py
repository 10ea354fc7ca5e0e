"""A dynamic embedding table seen from a worker: any int64 id, no fixed size.

:class:`DynamicEmbedding` is a :class:`~towerflow.ps.worker.tables.embedding.ShardedEmbedding`
whose table has no ``num_rows``: every int64 id (negatives included) has a
row, the initializer's value for that id until the row is made on the ps
shard that owns it, at the id's first admitted update
(:mod:`towerflow.ps.server.tables.dynamic`). Ids are spread over the ps
tasks by a 64-bit mixing hash (``splitmix64(id) mod num_ps``,
:class:`~towerflow.ps.partition.HashPartitioner`), since raw ids are often
multiples of a stride; ``partitioner="mod"`` spreads them by ``id mod
num_ps``. Pulls, pushes, the aggregation modes, ``defer_push``, exactly-once
and checkpoints are the fixed table's; a dynamic table is never fused with
another (:mod:`towerflow.ps.worker.tables.fusion`).

Bound to a cluster by the ``ParameterServer`` strategy, as a
``ShardedEmbedding``; ``towerflow.DynamicEmbedding`` also runs in one process
with no ps (a local table with the same semantics, made on the first
forward; :mod:`towerflow._local_tables`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from towerflow.errors import FailedPreconditionError, InvalidArgumentError
from towerflow.ps.partition import HashPartitioner, ModPartitioner, Partitioner
from towerflow.ps.spec.tables import STAT_NAMES, TableConfig, check_options
from towerflow.ps.worker.tables.embedding import ShardedEmbedding, seeded_initializer

__all__ = ["DynamicEmbedding"]


class DynamicEmbedding(ShardedEmbedding):
    """An embedding table of any int64 id whose rows are made on first training touch.

    Behaves as ``nn.Embedding`` (``mode=None``: output ``ids.shape + (dim,)``)
    or ``nn.EmbeddingBag`` (``mode="sum" | "mean" | "max"``, with ``offsets``
    and ``per_sample_weights``) over the whole int64 id space.

    Args:
        embedding_dim: values per row.
        mode: None (one row per id), or ``sum`` / ``mean`` / ``max`` (bags).
        initializer: a row's value before its first update, a function of
            the id (``UniformRows`` / ``NormalRows`` / ``ConstantRows`` or
            their dicts); default uniform in [-0.05, 0.05), seeded by the
            table's name.
        optimizer: the row-wise optimizer (or its ``to_dict()``); None: the
            counterpart of the strategy's optimizer.
        admit_after: an id gets a row at its ``admit_after``-th push (counted
            on its shard over every worker); until then its gradients are
            dropped. 1: at its first.
        evict_after_steps: rows not updated in the last this many global
            steps are evicted (None: never).
        capacity: at most this many rows in the whole table (each shard keeps
            its share, ``ceil(capacity / num_ps)``), the least recently
            updated evicted first (None: no bound).
        name: the table's name on the ps (default: the module's path).
        dtype: ``torch.float32`` (default) or ``torch.float64``.
        defer_push: as ``ShardedEmbedding``'s.
        partitioner: ``"hash"`` (default: ``splitmix64(id) mod num_ps``) or
            ``"mod"`` (``id mod num_ps``).

    Ids are int64; int32 ids are widened (lossless), any other dtype is
    refused.

    Example::

        class Click(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = towerflow.DynamicEmbedding(16, mode="sum", admit_after=2,
                                                      capacity=10_000_000)
                self.out = nn.Linear(16, 1)
            def forward(self, ids):              # ids: (batch, ids per example), any int64
                return self.out(self.emb(ids)).squeeze(1)
    """

    def __init__(self, embedding_dim: int, *, mode: str | None = None, initializer: Any = None,
                 optimizer: Any = None, admit_after: int = 1,
                 evict_after_steps: int | None = None, capacity: int | None = None,
                 name: str | None = None, dtype: torch.dtype = torch.float32,
                 defer_push: bool | None = None, partitioner: str = "hash") -> None:
        if partitioner not in ("hash", "mod"):
            raise InvalidArgumentError(f"DynamicEmbedding: partitioner={partitioner!r}; use "
                                       "'hash' (splitmix64 of the id) or 'mod'.")
        super().__init__(1, embedding_dim, mode=mode, optimizer=optimizer,
                         initializer=initializer, name=name, dtype=dtype,
                         defer_push=defer_push)
        self.options = check_options({"admit_after": admit_after,
                                      "evict_after_steps": evict_after_steps,
                                      "capacity": capacity})
        self.num_rows = None  # type: ignore[assignment]
        self.partitioner_kind = partitioner

    @property
    def nbytes(self) -> int:
        """0: a dynamic table's size is the rows it holds (see :meth:`stats`)."""
        return 0

    def make_config(self, name: str, num_shards: int, optimizer: Mapping[str, Any]) -> TableConfig:
        """The :class:`TableConfig` of this table over ``num_shards`` ps tasks."""
        part: Partitioner = (HashPartitioner(num_shards) if self.partitioner_kind == "hash"
                             else ModPartitioner(num_shards))
        name = self.table_name or name
        return TableConfig(name=name, partitioner=part, dim=self.dim,
                           optimizer=self.optimizer or dict(optimizer),
                           initializer=self.initializer or seeded_initializer(name),
                           dtype=self.dtype, store={"kind": "dynamic", **self.options})

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,  # noqa: A002
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int64, torch.int32):
            got = input.dtype if isinstance(input, torch.Tensor) else type(input).__name__
            raise InvalidArgumentError(
                f"DynamicEmbedding takes int64 ids (int32 is widened), got {got}; a float "
                "cannot hold every 64-bit id exactly: keep ids as torch.int64 from the data on."
            )
        if self._client is None:
            self._bind_local()
        return super().forward(input, offsets, per_sample_weights)

    def _bind_local(self) -> None:
        """Bind to a table in this process (``towerflow.DynamicEmbedding`` does; here: refuse)."""
        raise FailedPreconditionError(
            "This DynamicEmbedding is not bound to ps tasks; train it under the "
            "ParameterServer strategy, or use towerflow.DynamicEmbedding, which also runs "
            "in one process."
        )

    def stats(self) -> dict[str, int]:
        """``{"rows", "admitted", "evicted", "filtered", "bytes"}`` summed over the shards.

        Deferred pushes are sent first, so the counts include them.
        """
        if self._client is None or self.config is None:
            raise FailedPreconditionError(
                "DynamicEmbedding.stats(): the table has no rows yet (not bound); run a forward "
                "first, or prepare the model with the ParameterServer strategy."
            )
        total = dict.fromkeys(STAT_NAMES, 0)
        for shard in range(self.config.partitioner.num_shards):
            reply = self._client.status(self.config, shard)
            for key, value in shard_stats(reply).items():
                total[key] += value
        return total


def shard_stats(reply: Any) -> dict[str, int]:
    """A ``TableStatusReply``'s dynamic-table counters by :data:`STAT_NAMES`."""
    return {"rows": int(reply.rows), "admitted": int(reply.admitted),
            "evicted": int(reply.evicted), "filtered": int(reply.filtered),
            "bytes": int(reply.nbytes)}
