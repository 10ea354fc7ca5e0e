"""What a sparse table is: :class:`TableConfig` and the descriptions it carries.

A :class:`TableConfig` names a table and says its shape, dtype, sharding
(a partitioner), row-wise optimizer and row initializer; the optimizer and the
initializer travel as descriptions (``{"name", "hyper"}``, ``{"kind", ...}``),
so a worker never imports the ps task's row stores or optimizers.

Example:
    >>> from towerflow.ps.partition import ModPartitioner
    >>> config = TableConfig("emb", ModPartitioner(2, 10), 4, {"name": "sgd", "hyper": {}},
    ...                      DEFAULT_INITIALIZER)
    >>> config.num_rows, config.row_bytes
    (10, 16)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from towerflow.errors import InvalidArgumentError
from towerflow.ps.partition import Partitioner
from towerflow.ps.wire import tables_pb2 as tpb

__all__ = ["TableConfig", "DEFAULT_INITIALIZER"]

_DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64"}
#: the default row initializer: uniform in [-0.05, 0.05), a function of the id
DEFAULT_INITIALIZER: dict[str, Any] = {"kind": "uniform", "minval": -0.05, "maxval": 0.05,
                                       "seed": 0}


def _describe(value: Any, what: str) -> dict[str, Any]:
    """A description dict from a dict or an object with ``to_dict()``."""
    if isinstance(value, Mapping):
        return dict(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise InvalidArgumentError(
        f"{what} must be a dict or have to_dict() (e.g. "
        "towerflow.ps.server.tables.optimizers.SparseAdagrad() or "
        f"towerflow.ps.server.tables.rows.UniformRows()), got {type(value).__name__}."
    )


@dataclass(frozen=True)
class TableConfig:
    """What a table is: its name, shape, dtype, sharding, optimizer and initializer.

    Attributes:
        name: unique among the job's tables.
        partitioner: how rows map to shards (its ``num_rows`` is the table's).
        dim: values per row.
        optimizer: the row-wise optimizer's description (``{"name", "hyper"}``).
        initializer: the rows' start (``{"kind", ...}``).
        dtype: ``torch.float32`` or ``torch.float64``.
        store: None (a fixed table of ``num_rows`` rows), or a dynamic table's
            ``{"kind": "dynamic", "admit_after", "evict_after_steps",
            "capacity"}`` (any int64 id; its partitioner unbounded).
    """

    name: str
    partitioner: Partitioner
    dim: int
    optimizer: Mapping[str, Any]
    initializer: Mapping[str, Any]
    dtype: torch.dtype = torch.float32
    store: Mapping[str, Any] | None = None

    @property
    def dynamic(self) -> bool:
        """Whether this is a dynamic table (any int64 id, rows made on first update)."""
        return self.store is not None

    @property
    def num_rows(self) -> int:
        """Rows of the table."""
        return int(self.partitioner.num_rows or 0)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return self.dim * self.dtype.itemsize

    def spec(self, shard: int) -> tpb.TableSpec:
        """The ``TableSpec`` message of shard ``shard``."""
        return tpb.TableSpec(
            name=self.name, num_rows=self.num_rows, dim=self.dim,
            dtype=_DTYPE_NAMES[self.dtype],
            partitioner=json.dumps(self.partitioner.to_dict(), sort_keys=True),
            optimizer=json.dumps(dict(self.optimizer), sort_keys=True),
            initializer=json.dumps(dict(self.initializer), sort_keys=True), shard=shard,
            store="" if self.store is None else json.dumps(dict(self.store), sort_keys=True))
