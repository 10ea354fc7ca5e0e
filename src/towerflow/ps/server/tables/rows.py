"""The rows of one shard of a sparse embedding table on a ps task.

A :class:`RowStore` holds the rows a ps shard owns under the table's
partitioner (:mod:`towerflow.ps.partition`) and their optimizer slots
(:mod:`towerflow.ps.spec.row_optimizers`). Callers (the ps service, checkpoints)
speak to it in global ids only:

- :meth:`RowStore.lookup` — the rows of some ids (a pull);
- :meth:`RowStore.apply` — row gradients of some ids applied by the table's
  optimizer (a push); duplicate ids are summed first (:func:`coalesce`);
- :meth:`RowStore.export` / :meth:`RowStore.import_` — ``(ids, rows, slots)``
  for checkpoints and for re-sharding to another number of ps tasks
  (:func:`split_export` cuts an export by the new partitioner, so no process
  ever holds more than one old shard's rows).

Every input is checked in full before anything changes: an id of the wrong
dtype, negative, out of the table or owned by another shard, a gradient of the
wrong shape or dtype, a NaN or infinity is refused with an
:class:`~towerflow.errors.InvalidArgumentError` that names the value, and the
store is left as it was. A store is not thread-safe: the shard serialises
calls (an export under the shard's lock holds rows and slots of one moment).

:class:`DenseRowStore` keeps every row of a fixed ``[num_rows, dim]`` table
with its optimizer slots side by side, in one contiguous ``(rows_in_shard, dim
* (1 + slots))`` tensor of "cells": local row ``i`` (global id
``partitioner.global_ids(shard)[i]``) is ``cells[i, :dim]``, its slots the next
``dim`` columns each (:meth:`SparseOptimizer.cell_views`). An update is
memory-bound on a large shard: with the slots beside the row, it gathers each
touched cell once (``index_select``, several times faster than advanced
indexing) and writes it back once, where a tensor per slot costs one random
access per tensor each way (:meth:`SparseOptimizer.apply_cells`; about a third less
time per update for Adagrad's rows of 32 values). A lookup gathers from the
rows' column view (``index_select`` on the view: about twice as fast as
gathering whole cells and then their row columns).

A dynamic table (any int64 id, rows made on first touch, admission and
eviction, as DeepRec's ``EmbeddingVariable`` and Monolith's collisionless
tables) implements the same interface, so neither the worker nor the wire
changes: :class:`~towerflow.ps.server.tables.dynamic.DynamicRowStore`
(``kind: "dynamic"``), its ids in an open-addressing
:class:`~towerflow.ps.server.tables.keyindex.KeyIndex`, spread over the ps
tasks by :class:`~towerflow.ps.partition.HashPartitioner`.
:meth:`RowStore.observe` counts a push's ids once per push (its admission);
a fixed table ignores it.

Example:
    >>> import torch
    >>> from towerflow.ps.partition import ModPartitioner
    >>> from towerflow.ps.spec.row_optimizers import SparseSGD
    >>> store = DenseRowStore(ModPartitioner(2, num_rows=6), 1, 2, SparseSGD())
    >>> store.num_rows, store.lookup(torch.tensor([5, 1])).tolist()
    (3, [[0.0, 0.0], [0.0, 0.0]])
    >>> store.apply(torch.tensor([5, 5]), torch.ones(2, 2), lr=0.5, step=1)
    >>> store.lookup(torch.tensor([5])).tolist()
    [[-1.0, -1.0]]
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import torch

from towerflow.errors import InvalidArgumentError
from towerflow.ps.memory import check_free_memory
from towerflow.ps.partition import Partitioner, coalesce
from towerflow.ps.spec.initializers import ConstantRows, RowInitializer
from towerflow.ps.spec.row_optimizers import SparseOptimizer
from towerflow.ps.spec.tables import DTYPE_NAMES

__all__ = [
    "RowStore",
    "DenseRowStore",
    "RowExport",
    "split_export",
    "coalesce",
]

_FLOAT_DTYPES = tuple(DTYPE_NAMES)
_CHUNK = 1 << 12  # ids per initializer chunk: its temporaries stay near 1 MiB per 32 values


class RowExport(NamedTuple):
    """Rows of a table with their optimizer slots, by global id.

    Attributes:
        ids: int64 ``(n,)`` global ids.
        rows: ``(n, dim)`` rows, ``rows[i]`` for ``ids[i]``.
        slots: optimizer slot name -> ``(n, dim)`` tensor, in the same order.
        versions: int64 ``(n,)`` step of each row's last update (a dynamic
            table's), or None.
    """

    ids: torch.Tensor
    rows: torch.Tensor
    slots: dict[str, torch.Tensor]
    versions: torch.Tensor | None = None
    #: a dynamic table's admission counters (ids not admitted yet, their counts), or None
    counters: tuple[torch.Tensor, torch.Tensor] | None = None


def split_export(export: RowExport, partitioner: Partitioner) -> list[RowExport]:
    """Cut an export into one export per shard of ``partitioner`` (re-sharding).

    Example:
        >>> from towerflow.ps.partition import ModPartitioner
        >>> parts = split_export(RowExport(torch.arange(3), torch.zeros(3, 1), {}),
        ...                      ModPartitioner(2, num_rows=3))
        >>> [p.ids.tolist() for p in parts]
        [[0, 2], [1]]
    """
    out = []
    for pos, ids in partitioner.split(export.ids):
        out.append(RowExport(ids, export.rows.index_select(0, pos),
                             {k: v.index_select(0, pos) for k, v in export.slots.items()},
                             None if export.versions is None
                             else export.versions.index_select(0, pos)))
    return out


# ---------------------------------------------------------------- the interface


class RowStore(abc.ABC):
    """The rows of one shard of one sparse table, by global id.

    Attributes:
        partitioner: the table's partitioner.
        shard: this shard's index under it.
        dim: values per row.
        dtype: the rows' dtype (and the slots').
        optimizer: the row-wise optimizer :meth:`apply` runs.
        initializer: the value of a row before its first update.
    """

    kind: ClassVar[str]

    def __init__(self, partitioner: Partitioner, shard: int, dim: int,
                 optimizer: SparseOptimizer, *, dtype: torch.dtype = torch.float32,
                 initializer: RowInitializer | None = None) -> None:
        if not isinstance(partitioner, Partitioner):
            raise InvalidArgumentError(
                f"partitioner must be a Partitioner, got {type(partitioner).__name__}."
            )
        partitioner.check_shard(shard)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise InvalidArgumentError(f"dim must be an integer >= 1, got {dim!r}.")
        if not isinstance(optimizer, SparseOptimizer):
            raise InvalidArgumentError(
                f"optimizer must be a SparseOptimizer (towerflow.ps.spec.row_optimizers), got "
                f"{type(optimizer).__name__}."
            )
        if dtype not in _FLOAT_DTYPES:
            raise InvalidArgumentError(
                f"A table's dtype must be one of {[str(d) for d in _FLOAT_DTYPES]}, got {dtype}."
            )
        if initializer is not None and not isinstance(initializer, RowInitializer):
            raise InvalidArgumentError(
                f"initializer must be a RowInitializer (ConstantRows, UniformRows, NormalRows), got "
                f"{type(initializer).__name__}."
            )
        self.partitioner = partitioner
        self.shard = shard
        self.dim = dim
        self.optimizer = optimizer
        self.dtype = dtype
        self.initializer = ConstantRows() if initializer is None else initializer

    @abc.abstractmethod
    def lookup(self, ids: torch.Tensor, *, checked: bool = False) -> torch.Tensor:
        """The ``(len(ids), dim)`` rows of ``ids`` (int64 global ids this shard owns).

        A new tensor: changing it does not change the store. ``checked=True``:
        the caller has checked ``ids`` already (``partitioner.local_index(ids,
        shard)`` did not raise), so they are not checked again.
        """

    @abc.abstractmethod
    def apply(self, ids: torch.Tensor, row_grads: torch.Tensor, lr: float, step: int, *,
              checked: bool = False) -> None:
        """Apply ``row_grads[i]`` to the row of ``ids[i]`` with the store's optimizer.

        Rows of the same id are summed first. ``lr`` is the learning rate,
        ``step`` the update's number from 1 (the global step after this update;
        lazy Adam's bias correction and a dynamic table's clock).
        ``checked=True``: the caller has checked the ids (as for :meth:`lookup`),
        ``row_grads`` (shape, dtype, finite) and ``optimizer.check_step(lr,
        step)`` already (the ps shard does, outside its lock).
        """

    def observe(self, ids: torch.Tensor) -> None:
        """Count a push of ``ids`` (checked), once per push: a dynamic table's admission.

        A fixed table counts nothing.
        """

    @abc.abstractmethod
    def export(self, start: int = 0, stop: int | None = None) -> RowExport:
        """Copies of every row this shard holds (of the global ids in ``[start, stop)``),
        with their slots."""

    @abc.abstractmethod
    def import_(self, ids: torch.Tensor, rows: torch.Tensor,
                slots: Mapping[str, torch.Tensor] | None = None) -> None:
        """Set the rows (and slots) of ``ids``; ``slots=None`` resets their slots.

        ``ids`` must be owned by this shard and unique; ``slots`` must hold
        exactly the optimizer's slots, each shaped like ``rows``.
        """

    @property
    @abc.abstractmethod
    def num_rows(self) -> int:
        """Rows held now."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of the rows and slots held."""

    def describe(self) -> dict[str, Any]:
        """The store's description (for a checkpoint manifest or the wire).

        :func:`~towerflow.ps.server.tables.stores.row_store_from_dict` builds a fresh store
        (initial rows) from it.
        """
        return {"kind": self.kind, "partitioner": self.partitioner.to_dict(),
                "shard": self.shard, "dim": self.dim,
                "dtype": str(self.dtype).removeprefix("torch."),
                "optimizer": self.optimizer.to_dict(),
                "initializer": self.initializer.to_dict()}

    # checks shared by every implementation ------------------------------------------

    def _check_values(self, what: str, values: object, ids: torch.Tensor) -> torch.Tensor:
        """``values`` if it is a finite ``(len(ids), dim)`` tensor of the table's dtype."""
        if not isinstance(values, torch.Tensor):
            raise InvalidArgumentError(
                f"{what} must be a torch.Tensor, got {type(values).__name__}."
            )
        shape = [ids.numel(), self.dim]
        if list(values.shape) != shape:
            raise InvalidArgumentError(
                f"{what} has shape {list(values.shape)} but {ids.numel()} ids of a table with "
                f"{self.dim} values per row need {shape}; send one row per id."
            )
        if values.dtype != self.dtype:
            raise InvalidArgumentError(
                f"{what} has dtype {values.dtype} but the table holds {self.dtype}; convert "
                f"with .to({self.dtype})."
            )
        if bool(torch.isfinite(values.sum())):  # one reduction; a NaN or inf spoils the sum
            return values
        finite = torch.isfinite(values).all(dim=1)  # (or the sum overflowed)
        if not bool(finite.all()):
            pos = int((~finite).nonzero()[0, 0])
            raise InvalidArgumentError(
                f"{what}[{pos}] (id {int(ids[pos])}) holds {values[pos].tolist()}, not finite; "
                "nothing was applied. Find where the NaN or infinity comes from (a diverged "
                "loss: lower the learning rate or clip gradients)."
            )
        return values

    def _check_slots(self, slots: object, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        names = self.optimizer.slot_names
        if not isinstance(slots, Mapping) or set(slots) != set(names):
            got = sorted(map(str, slots)) if isinstance(slots, Mapping) else type(slots).__name__
            raise InvalidArgumentError(
                f"The {self.optimizer.name} optimizer keeps slots {list(names)}, got {got}; "
                "import rows saved with the same optimizer, or pass slots=None to start "
                "their optimizer state afresh."
            )
        return {k: self._check_values(f"slots[{k!r}]", slots[k], ids) for k in names}


# ---------------------------------------------------------------- the dense store


class DenseRowStore(RowStore):
    """Every row of a fixed-size table's shard with its slots, in one contiguous tensor.

    Row ``i`` and its optimizer slots are one "cell", ``cells[i]`` of ``dim *
    (1 + len(optimizer.slot_names))`` values (the row, then each slot), so an
    update touches each row's memory once each way; rows and slots are
    column views of the cells.

    Args:
        partitioner: the table's partitioner; it must bound the table
            (``num_rows`` given).
        shard: this shard's index.
        dim: values per row.
        optimizer: the row-wise optimizer.
        dtype: ``torch.float32`` (default) or ``torch.float64``.
        initializer: the rows' start (:class:`ConstantRows` zeros by default).
    """

    kind: ClassVar[str] = "dense"

    def __init__(self, partitioner: Partitioner, shard: int, dim: int,
                 optimizer: SparseOptimizer, *, dtype: torch.dtype = torch.float32,
                 initializer: RowInitializer | None = None) -> None:
        super().__init__(partitioner, shard, dim, optimizer, dtype=dtype,
                         initializer=initializer)
        if partitioner.num_rows is None:
            raise InvalidArgumentError(
                f"A dense row store needs a table of fixed size, but {partitioner!r} has no "
                "num_rows; give the partitioner num_rows."
            )
        n = partitioner.rows_in_shard(shard)
        itemsize = torch.empty((), dtype=dtype).element_size()
        check_free_memory(n * (dim * itemsize * (1 + len(optimizer.slot_names)) + 8),
                          f"Table shard {shard} of {n:,} rows x {dim} (with "
                          f"{len(optimizer.slot_names)} optimizer slot(s))")
        self._cells = torch.empty((n, dim * (1 + len(optimizer.slot_names))), dtype=dtype)
        self._rows, self._slots = optimizer.cell_views(self._cells, dim)
        ids = partitioner.global_ids(shard)
        for start in range(0, n, _CHUNK):
            piece = ids[start:start + _CHUNK]
            self._rows[start:start + piece.numel()] = self.initializer(piece, dim, dtype)
        for name, slot in self._slots.items():
            slot.fill_(optimizer.slot_initial_value(name))

    @property
    def num_rows(self) -> int:
        return self._rows.shape[0]

    @property
    def nbytes(self) -> int:
        tensors = (self._rows, *self._slots.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def _local(self, ids: object, checked: bool = False) -> torch.Tensor:
        return self.partitioner.local_index(ids, self.shard, checked=checked)  # type: ignore[arg-type]

    def lookup(self, ids: torch.Tensor, *, checked: bool = False) -> torch.Tensor:
        return self._rows.index_select(0, self._local(ids, checked))

    def apply(self, ids: torch.Tensor, row_grads: torch.Tensor, lr: float, step: int, *,
              checked: bool = False) -> None:
        local = self._local(ids, checked)
        grads = row_grads if checked else self._check_values("row_grads", row_grads, ids)
        if not checked:
            lr, step = self.optimizer.check_step(lr, step)
        if local.numel():
            local, grads = coalesce(local, grads)  # local ids keep the global ids' order
            self.optimizer.apply_cells(self._cells, local, grads, lr, step)

    def export(self, start: int = 0, stop: int | None = None) -> RowExport:
        ids = self.partitioner.global_ids(self.shard)  # increasing: a range is a slice
        first = int(torch.searchsorted(ids, start)) if start else 0
        last = ids.numel() if stop is None else int(torch.searchsorted(ids, stop))
        own = torch.contiguous_format  # a view of the cells: copied to a tensor of its own
        return RowExport(ids[first:last], self._rows[first:last].clone(memory_format=own),
                         {k: v[first:last].clone(memory_format=own)
                          for k, v in self._slots.items()})

    def export_ids(self, ids: torch.Tensor) -> RowExport:
        """The rows and slots of ``ids`` (owned here, each once), copies: what a push changed,
        for the shard's replica."""
        local = self._local(ids, checked=True)
        return RowExport(ids, self._rows.index_select(0, local),
                         {k: v.index_select(0, local) for k, v in self._slots.items()})

    def import_(self, ids: torch.Tensor, rows: torch.Tensor,
                slots: Mapping[str, torch.Tensor] | None = None) -> None:
        local = self._local(ids)
        rows = self._check_values("rows", rows, ids)
        given = None if slots is None else self._check_slots(slots, ids)
        unique, counts = torch.unique(ids, return_counts=True)
        if unique.numel() != ids.numel():
            dup = int(unique[counts > 1][0])
            raise InvalidArgumentError(
                f"import_ got id {dup} more than once; each id's row can be set once per "
                "import (merge the exports first)."
            )
        self._rows.index_copy_(0, local, rows)
        for name, slot in self._slots.items():
            if given is None:
                slot.index_fill_(0, local, self.optimizer.slot_initial_value(name))
            else:
                slot.index_copy_(0, local, given[name])

    def __repr__(self) -> str:
        return (f"DenseRowStore(shard {self.shard} of {self.partitioner!r}, {self.num_rows} x "
                f"{self.dim} {self.dtype}, {self.optimizer!r})")
