"""Sparse embedding tables on the ps tasks, seen from a worker.

A table of ``num_rows x dim`` rows is row-sharded over the ps tasks by a
:class:`~towerflow.ps.partition.Partitioner` (``id % num_ps`` by default) and
never materialised on a worker. For a batch, :class:`ShardedEmbedding`:

1. takes the batch's unique ids and each id's place among them (:func:`unique_ids`);
2. splits them by owning shard and pulls each shard's rows with one
   ``PullRows`` call per shard, the shards in parallel;
3. puts the rows in a leaf tensor that requires grad and gathers the batch
   from it with the inverse indices (``index_select``, summed or averaged per
   bag; ``F.embedding_bag`` for ``max`` bags, offsets and weights);
4. after backward, the leaf's gradient *is* the summed gradient of each
   unique row: (unique ids, row gradients) go to the owning shards with one
   ``PushRows`` call per shard, in parallel, applied there once by the
   table's row-wise optimizer (:mod:`towerflow.ps.spec.row_optimizers`). With
   ``defer_push=True`` they travel instead with the next step's pull of the
   same shard (one ``PushPullRows`` round trip per shard and step).

Bytes on the wire per step are ``unique rows x row bytes`` (+ 8 bytes per id)
each way, whatever the table's size. The requests to a ps task travel on one
long-lived stream (:mod:`towerflow.ps.worker.tables.stream`).

The strategy's mode applies to the tables as to the dense parameters
(:mod:`towerflow.ps.server.tables.aggregation`): ``async`` applies each push on
arrival; ``sync`` averages each row over the replicas that pushed it on the
step and applies that once (a push returns when its step is applied);
``ssp`` applies on arrival but holds a worker more than ``staleness`` pushes
ahead of the slowest. In sync and ssp every table pushes to every shard each
step (empty where the step touched no row), and a finished worker says so
(:meth:`~towerflow.ps.worker.tables.sparse_tables.SparseTables.done`) so that nobody waits for it.

Two ways in, and why both. TensorFlow 1 users write ``embedding_lookup`` on a
partitioned variable: the table is declared as sharded. The PyTorch user's
model says ``nn.Embedding(10_000_000, 32)``, which allocates the whole weight
(1.28 GB) when it is built, before any strategy sees it. So:

- :class:`ShardedEmbedding` ``(num_rows, dim, ...)`` is the explicit module: it
  owns no weight at all, so a table larger than the worker's memory can be
  declared and trained; its optimizer, initializer and partitioner are
  chosen per table.
- The ``ParameterServer`` strategy swaps every ``nn.Embedding`` /
  ``nn.EmbeddingBag`` declared ``sparse=True`` or at least
  ``sparse_threshold_bytes`` large (64 MiB by default) for a
  :class:`ShardedEmbedding` of the same shape
  (:func:`~towerflow.ps.worker.tables.swap.swap_embeddings`), which starts
  from the module's own values and uses the row-wise counterpart of the
  model's optimizer (sgd, adagrad, adam -> lazy Adam).

This module and :mod:`towerflow.ps.worker.tables.client` speak to the ps through the
generated ``tables_pb2`` messages and the cluster transport only; they import
no server module.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention
from torch import nn

from towerflow.errors import FailedPreconditionError, InvalidArgumentError
from towerflow.ps.partition import ModPartitioner, Partitioner, RangePartitioner
from towerflow.ps.spec.tables import DEFAULT_INITIALIZER, TableConfig, describe
from towerflow.ps.worker.tables.client import TableClient
from towerflow.ps.worker.tables.groups import (
    Pulled,
    RowGroup,
    bag_of,
    grouped_lookup,
    host_ready,
    kept_rows,
    plain_gather,
    to_host,
)
from towerflow.ps.worker.tables.prefetch import host_copy, recording

__all__ = ["ShardedEmbedding", "unique_ids",
           "seeded_initializer"]

log = logging.getLogger("towerflow.ps")

_BAG_MODES = ("sum", "mean", "max")
#: a lookup of at most this many values gathers its rows with ``index_select`` (whose
#: backward is an ``index_add_``); larger ones use ``F.embedding`` / ``F.embedding_bag``,
#: which sort the ids in backward but need no ``(ids, dim)`` temporary
_GATHER_LIMIT = 1 << 22


def unique_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted unique values of 1-D int64 CPU ``ids`` and each id's index among them.

    ``torch.unique(ids, return_inverse=True)``'s result, from numpy's
    ``unique``, which is 2.5x faster on CPU (106 vs 264 us for 8,192 Zipf ids).

    Example:
        >>> u, inverse = unique_ids(torch.tensor([7, 3, 7]))
        >>> u.tolist(), inverse.tolist()
        ([3, 7], [1, 0, 1])
    """
    unique, inverse = np.unique(ids.numpy(), return_inverse=True)
    return torch.from_numpy(unique), torch.from_numpy(inverse.reshape(-1))


class ShardedEmbedding(nn.Module):
    """An embedding table held by the ps tasks, looked up row by row.

    Behaves as ``nn.Embedding(num_rows, dim)`` (``mode=None``) or
    ``nn.EmbeddingBag(num_rows, dim, mode=mode)``, but owns no weight: each
    forward pulls the batch's unique rows from the ps tasks into a leaf tensor
    that requires grad, and the strategy pushes that leaf's gradient (the
    summed gradient of each unique row) after backward. It runs under the
    ``ParameterServer`` strategy, which binds it to the cluster in
    ``prepare()``.

    Args:
        num_rows: rows of the table (ids are in ``[0, num_rows)``).
        dim: values per row.
        mode: None (one row per id), or ``sum`` / ``mean`` / ``max`` (bags).
        optimizer: the row-wise optimizer (one of ``towerflow.ps.spec``, e.g. ``SparseAdagrad()``,
            or its ``to_dict()``); None: the counterpart of the
            strategy's optimizer.
        initializer: the rows' start (``towerflow.ps.spec.UniformRows`` /
            ``NormalRows`` / ``ConstantRows`` or their dicts); default uniform in
            [-0.05, 0.05), its seed drawn from the table's name (two tables
            start apart).
        partitioner: ``mod`` (default; ``id % num_ps``, even under skewed ids)
            or ``range`` (contiguous rows, as ``tf.fixed_size_partitioner``).
        name: the table's name on the ps (default: the module's path in the model).
        dtype: ``torch.float32`` (default) or ``torch.float64``.
        defer_push: send a step's row gradients with the next pull of this
            table (one round trip per ps task and step instead of a pull and
            a push). The ps applies them before it reads
            the rows of that pull, so this worker's next lookup sees its own
            update as without deferral; the other workers see it one step
            later (when this worker's next step starts, not when its step
            ends). Each push still applies exactly once. A deferred push is
            sent alone before a later push of the same table, before an
            export or import of the table (checkpoints hold it) and when the
            strategy shuts down (before it tells the ps tasks it is done);
            an error of a deferred push is raised by the call that sends it.
            False: each step's push is sent and answered within the step.
            None (default): the strategy's mode decides: deferred in async
            mode (where no worker waits for another's update), not in sync
            and ssp (whose steps count each push).
        padding_idx: an id whose row keeps its value (no update reaches it),
            as ``nn.Embedding(padding_idx=)``.
        trainable: False: the rows are served and never updated (no row
            gradient is pushed), as a frozen ``nn.Embedding``.

    Example::

        class Click(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = towerflow.ps.ShardedEmbedding(10_000_000, 32, mode="sum")
                self.out = nn.Linear(32, 1)
            def forward(self, ids):                   # ids: (batch, ids per example)
                return self.out(self.emb(ids)).squeeze(1)
    """

    def __init__(self, num_rows: int, dim: int, *, mode: str | None = None,
                 optimizer: Any = None, initializer: Any = None, partitioner: str = "mod",
                 name: str | None = None, dtype: torch.dtype = torch.float32,
                 defer_push: bool | None = None, padding_idx: int | None = None,
                 trainable: bool = True) -> None:
        super().__init__()
        for what, value in (("num_rows", num_rows), ("dim", dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"ShardedEmbedding: {what} must be an integer >= 1, "
                                           f"got {value!r}.")
        if mode is not None and mode not in _BAG_MODES:
            raise InvalidArgumentError(f"ShardedEmbedding: mode={mode!r}; use None or one of "
                                       f"{list(_BAG_MODES)}.")
        if partitioner not in ("mod", "range"):
            raise InvalidArgumentError(f"ShardedEmbedding: partitioner={partitioner!r}; use "
                                       "'mod' or 'range'.")
        if dtype not in (torch.float32, torch.float64):
            raise InvalidArgumentError(f"ShardedEmbedding: dtype={dtype}; use torch.float32 or "
                                       "torch.float64.")
        self.num_rows, self.dim, self.mode, self.dtype = num_rows, dim, mode, dtype
        if padding_idx is not None and not (isinstance(padding_idx, int)
                                            and 0 <= padding_idx < num_rows):
            raise InvalidArgumentError(f"ShardedEmbedding: padding_idx={padding_idx!r} is not an "
                                       f"id of the table; use an id in [0, {num_rows}) or None.")
        self.optimizer = None if optimizer is None else describe(optimizer, "optimizer")
        #: None: towerflow's initializer, seeded by the table's name (make_config)
        self.initializer = None if initializer is None else describe(initializer, "initializer")
        self.partitioner_kind, self.table_name = partitioner, name
        #: None until the strategy binds the table (its mode decides, see ``defer_push``)
        self.defer_push = None if defer_push is None else bool(defer_push)
        self.padding_idx, self.trainable = padding_idx, bool(trainable)
        self._start: tuple[torch.Tensor | None, torch.Tensor] | None = None
        self._client: TableClient | None = None
        self.config: TableConfig | None = None
        self._touched: list[tuple[torch.Tensor | None, torch.Tensor | tuple[RowGroup, int]]] = []
        #: rows pulled ahead for this forward's lookups, in order: (ids, Pulled) or (ids,
        #: (RowGroup, member)) for tables fused on the ps (:mod:`.groups`)
        self.prefetched: list[tuple[torch.Tensor, Pulled | tuple[RowGroup, int]]] = []
        #: called when a lookup's ids were not those pulled ahead for it
        self.on_miss: Callable[[], None] | None = None

    def start_from(self, rows: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        """Rows the table starts from, shipped once when the chief creates it.

        Args:
            rows: ``(num_rows, dim)`` (``ids`` None: the whole table, e.g. a
                module's weight; kept by reference, not copied) or
                ``(len(ids), dim)``.
            ids: the ids of ``rows``; the other rows keep the initializer's values.
        """
        want = (self.num_rows if ids is None else ids.numel(), self.dim)
        if tuple(rows.shape) != want:
            raise InvalidArgumentError(f"ShardedEmbedding.start_from: rows of shape "
                                       f"{tuple(rows.shape)}, expected {want}.")
        self._start = (ids, rows)

    @property
    def holds_start(self) -> bool:
        """Whether rows given by :meth:`start_from` wait to be shipped."""
        return self._start is not None

    def take_start(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """The ``(ids, rows)`` of :meth:`start_from`, forgotten here (shipped or not needed)."""
        start, self._start = self._start, None
        return start

    def extra_repr(self) -> str:
        bag = "" if self.mode is None else f", mode={self.mode!r}"
        defer = "" if self.defer_push is None else f", defer_push={self.defer_push}"
        return f"{self.num_rows}, {self.dim}{bag}, partitioner={self.partitioner_kind!r}{defer}"

    @property
    def nbytes(self) -> int:
        """Bytes the whole table's rows take (on the ps tasks, not here)."""
        return self.num_rows * self.dim * torch.empty((), dtype=self.dtype).element_size()

    def make_config(self, name: str, num_shards: int, optimizer: Mapping[str, Any]) -> TableConfig:
        """The :class:`TableConfig` of this table over ``num_shards`` ps tasks."""
        part: Partitioner = (ModPartitioner(num_shards, num_rows=self.num_rows)
                             if self.partitioner_kind == "mod"
                             else RangePartitioner(self.num_rows, num_shards))
        name = self.table_name or name
        return TableConfig(name=name, partitioner=part, dim=self.dim,
                           optimizer=self.optimizer or dict(optimizer),
                           initializer=self.initializer or seeded_initializer(name),
                           dtype=self.dtype)

    def bind(self, client: TableClient, config: TableConfig) -> None:
        """Attach to the ps tasks (the strategy's ``prepare()`` does this)."""
        self._client, self.config = client, config

    @property
    def client(self) -> TableClient | None:
        """The client of the ps tasks this table is bound to (None before ``prepare()``)."""
        return self._client

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,  # noqa: A002
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self._client is None or self.config is None:
            raise FailedPreconditionError(
                "ShardedEmbedding is not bound to ps tasks; train the model with the "
                "ParameterServer strategy (its prepare() binds every ShardedEmbedding)."
            )
        if input.dtype not in (torch.int64, torch.int32):
            raise InvalidArgumentError(
                f"ShardedEmbedding expects integer ids, got {input.dtype}; pass ids.long()."
            )
        if self.mode is None and (offsets is not None or per_sample_weights is not None):
            raise InvalidArgumentError(
                "offsets and per_sample_weights need a bag mode; build "
                "ShardedEmbedding(..., mode='sum'|'mean'|'max')."
            )
        recorder = recording()
        if recorder is None:
            return self._lookup(input, offsets, per_sample_weights)
        recorder.site(self, input)
        recorder.suspended += 1
        try:
            out = self._lookup(input, offsets, per_sample_weights)
        finally:
            recorder.suspended -= 1
        recorder.table_output(out)
        return out

    def _ahead(self, input: torch.Tensor) -> Pulled | tuple[RowGroup, int] | None:  # noqa: A002
        """The rows pulled ahead for this lookup, when its ids are those: a
        :class:`~towerflow.ps.worker.tables.groups.Pulled`, or ``(RowGroup, member)``."""
        if not self.prefetched:
            return None
        ids, rows = self.prefetched.pop(0)
        if ids is input or _same_ids(ids, input):
            return rows
        self.prefetched.clear()
        if self.on_miss is not None:
            self.on_miss()
        return None

    def _lookup(self, input: torch.Tensor, offsets: torch.Tensor | None,  # noqa: A002
                per_sample_weights: torch.Tensor | None) -> torch.Tensor:
        ahead = self._ahead(input)
        if isinstance(ahead, tuple) and not isinstance(ahead, Pulled):
            group, member = ahead
            picked = None if not self.trainable else grouped_lookup(
                group, member, self.mode, self.dim, input, offsets, per_sample_weights,
                _GATHER_LIMIT)
            if picked is not None:
                if torch.is_grad_enabled():
                    self._touched.append((None, ahead))
                return picked
            ahead = group.apart(member)
        if ahead is None:  # the ids from the batch's host copy when there is one
            host = host_copy(input)
            ids = input if host is None else host
            unique, inverse = unique_ids(ids.reshape(-1).to("cpu", torch.int64))
            rows = self._client.pull(self.config, unique)  # type: ignore[union-attr, arg-type]
        else:
            unique, inverse, rows = ahead
        rows = rows.to(input.device, non_blocking=True)  # pulled into pinned memory for a GPU
        if torch.is_grad_enabled() and self.trainable:
            rows.requires_grad_(True)
            self._touched.append((unique, rows))
        index = inverse.to(input.device).view(input.shape)
        if index.numel() * self.dim <= _GATHER_LIMIT \
                and plain_gather(self.mode, index, offsets, per_sample_weights):
            picked = rows.index_select(0, index.reshape(-1)).view(*index.shape, self.dim)
            return bag_of(picked, self.mode)
        if self.mode is None:
            return F.embedding(index, rows)
        return F.embedding_bag(index, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights)

    @property
    def touched(self) -> list[tuple[torch.Tensor | None, torch.Tensor | tuple[RowGroup, int]]]:
        """The lookups since the last :meth:`take_row_grads`: ``(unique ids, rows leaf)``, or
        ``(None, (RowGroup, member))`` for one looked up with the tables fused with it."""
        return self._touched

    def take_row_grads(self, *, wait: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, row gradients) of the lookups since the last call, on the CPU; forgets them.

        Ids repeat when several lookups touched the same row (the ps sums them).
        None when no lookup had a gradient. A GPU's gradients come back in pinned
        memory; ``wait=False``: copied without waiting (the caller waits once for
        every table's: :func:`~towerflow.ps.worker.tables.groups.host_ready`).
        """
        touched = list(self._touched)
        self._touched.clear()  # (no nn.Module attribute set: this runs per table and step)
        parts = []
        for ids, held in touched:
            if isinstance(held, tuple):
                ids, grad = held[0].ids_of(held[1]), held[0].grad_of(held[1])
            else:
                grad = held.grad
            if grad is not None:
                parts.append((ids, grad.detach()))
        if not parts:
            return None
        if len({grad.device for _, grad in parts}) > 1:
            parts = [(ids, grad.cpu()) for ids, grad in parts]
        ids, grads = parts[0] if len(parts) == 1 else (torch.cat([p[0] for p in parts]),
                                                       torch.cat([p[1] for p in parts]))
        if self.padding_idx is not None:  # the padding row takes no update
            ids, grads = kept_rows(ids, grads, ids != self.padding_idx)
        grads = to_host(grads)
        if wait:
            host_ready()
        return ids, grads

    def forget(self) -> None:
        """Drop the lookups not pushed yet (a step that is not pushed)."""
        self._touched.clear()


def _same_ids(predicted: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether the ids pulled ahead (read on the host) are the lookup's ``ids``."""
    if predicted.shape != ids.shape:
        return False
    host = host_copy(ids)
    if host is not None:
        ids = host
    if predicted.device != ids.device:
        predicted = predicted.to(ids.device, non_blocking=True)
    return torch.equal(predicted, ids.to(predicted.dtype))


def seeded_initializer(name: str) -> dict[str, Any]:
    """towerflow's row initializer for table ``name``: its seed a stable hash of the name.

    Example:
        >>> seeded_initializer("a")["seed"] != seeded_initializer("b")["seed"]
        True
    """
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return {**DEFAULT_INITIALIZER, "seed": int.from_bytes(digest, "little") >> 1}
