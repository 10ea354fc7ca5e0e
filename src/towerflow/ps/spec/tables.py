"""What a sparse table is: :class:`TableConfig`, the descriptions it carries, a dynamic table's options.

A :class:`TableConfig` names a table and says its shape, dtype, sharding
(a partitioner), row-wise optimizer and row initializer; the optimizer and the
initializer travel as descriptions (``{"name", "hyper"}``, ``{"kind", ...}``),
so neither half needs the other's objects to agree on a table.

A dynamic table (:class:`~towerflow.ps.worker.tables.dynamic.DynamicEmbedding`
on a worker, :class:`~towerflow.ps.server.tables.dynamic.DynamicRowStore` on
a ps task) takes any int64 id, makes a row at an id's first admitted update,
and evicts rows; its options (:func:`check_options`) travel in
``TableConfig.store`` as ``{"kind": "dynamic", "admit_after",
"evict_after_steps", "capacity"}``.

Example:
    >>> from towerflow.ps.partition import ModPartitioner
    >>> config = TableConfig("emb", ModPartitioner(2, 10), 4, {"name": "sgd", "hyper": {}},
    ...                      DEFAULT_INITIALIZER)
    >>> config.num_rows, config.row_bytes
    (10, 16)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from towerflow.errors import InvalidArgumentError
from towerflow.ps.partition import Partitioner
from towerflow.ps.spec.initializers import DEFAULT_INITIALIZER

__all__ = ["TableConfig", "DEFAULT_INITIALIZER", "DTYPE_NAMES", "DTYPES_BY_NAME", "DYNAMIC_OPTIONS", "STAT_NAMES",
           "check_options", "describe"]

#: a table's dtypes and their names on the wire
DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64"}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def describe(value: Any, what: str) -> dict[str, Any]:
    """A description dict from a dict or an object with ``to_dict()``."""
    if isinstance(value, Mapping):
        return dict(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise InvalidArgumentError(
        f"{what} must be a dict or have to_dict() (e.g. "
        "towerflow.ps.spec.SparseAdagrad() or "
        f"towerflow.ps.spec.UniformRows()), got {type(value).__name__}."
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


#: a dynamic table's options, in order
DYNAMIC_OPTIONS = ("admit_after", "evict_after_steps", "capacity")
#: the counters a dynamic table's stats hold
STAT_NAMES = ("rows", "admitted", "evicted", "filtered", "bytes")
_WAYS = {"admit_after": "1 makes a row at an id's first update",
         "evict_after_steps": "None keeps rows however old",
         "capacity": "None bounds nothing"}


def check_options(options: Any) -> dict[str, int | None]:
    """A dynamic table's ``{"admit_after", "evict_after_steps", "capacity"}``, checked.

    Raises:
        InvalidArgumentError: not such a dict; ``admit_after`` not an integer >= 1;
            ``evict_after_steps`` or ``capacity`` neither None nor an integer >= 1.

    Example:
        >>> check_options({"admit_after": 2, "evict_after_steps": None, "capacity": 10})
        {'admit_after': 2, 'evict_after_steps': None, 'capacity': 10}
    """
    if not isinstance(options, Mapping) or set(options) != set(DYNAMIC_OPTIONS):
        raise InvalidArgumentError(
            f"A dynamic table's options are a dict of exactly {list(DYNAMIC_OPTIONS)}, got "
            f"{options!r:.200}."
        )
    out: dict[str, int | None] = {}
    for name in DYNAMIC_OPTIONS:
        value = options[name]
        if value is None and name != "admit_after":
            out[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31:
            raise InvalidArgumentError(
                f"{name}={value!r}: it must be an integer in [1, 2**31) ({_WAYS[name]})."
            )
        out[name] = value
    return out
