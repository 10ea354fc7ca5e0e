"""What users and both ps halves say: tables, row optimizers, row initializers, dense optimizers.

The one place a name is written. A user describes a table and how it trains
here; a worker sends these descriptions and a ps task builds its row stores
and optimizers from them. Nothing here talks to a process or imports gRPC
(only torch, and :mod:`~towerflow.ps.spec.dense` not even that), so the worker
half, the server half, the strategies and the command line all read it:

- :mod:`~towerflow.ps.spec.tables` — :class:`TableConfig` (name, shape, dtype,
  partitioner, optimizer and initializer descriptions, a dynamic table's
  options: :func:`check_options`);
- :mod:`~towerflow.ps.spec.row_optimizers` — the row-wise optimizers
  (:class:`SparseSGD`, :class:`SparseAdagrad`, :class:`SparseLazyAdam`,
  :class:`SparseFtrl`) and their registry (:data:`SPARSE_OPTIMIZERS`);
- :mod:`~towerflow.ps.spec.initializers` — row initializers
  (:class:`UniformRows`, :class:`NormalRows`, :class:`ConstantRows`);
- :mod:`~towerflow.ps.spec.dense` — the dense optimizers' names and slots.

Example (a table trained with FTRL, its rows starting near zero)::

    from towerflow.ps.spec import SparseFtrl, NormalRows
    emb = towerflow.ps.ShardedEmbedding(1_000_000, 16, name="item",
                                        optimizer=SparseFtrl(), initializer=NormalRows(std=0.01))
"""

from __future__ import annotations

from towerflow._lazy import lazy_dir, lazy_getattr

__all__ = [
    "TableConfig",
    "check_options",
    "SparseOptimizer",
    "SparseSGD",
    "SparseAdagrad",
    "SparseLazyAdam",
    "SparseFtrl",
    "SPARSE_OPTIMIZERS",
    "RowInitializer",
    "UniformRows",
    "NormalRows",
    "ConstantRows",
    "OPTIMIZER_NAMES",
    "SLOT_NAMES",
]

_LAZY = {
    "TableConfig": "towerflow.ps.spec.tables",
    "check_options": "towerflow.ps.spec.tables",
    **{name: "towerflow.ps.spec.row_optimizers"
       for name in ("SparseOptimizer", "SparseSGD", "SparseAdagrad", "SparseLazyAdam",
                    "SparseFtrl", "SPARSE_OPTIMIZERS")},
    **{name: "towerflow.ps.spec.initializers"
       for name in ("RowInitializer", "UniformRows", "NormalRows", "ConstantRows")},
    "OPTIMIZER_NAMES": "towerflow.ps.spec.dense",
    "SLOT_NAMES": "towerflow.ps.spec.dense",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
__dir__ = lazy_dir(globals(), __all__)
