"""Row stores by kind: a fixed table's :class:`~towerflow.ps.server.tables.rows.DenseRowStore`
and a dynamic table's :class:`~towerflow.ps.server.tables.dynamic.DynamicRowStore`, built from
their descriptions (:meth:`RowStore.describe`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from towerflow.errors import InvalidArgumentError
from towerflow.ps.partition import partitioner_from_dict
from towerflow.ps.server.tables.dynamic import DynamicRowStore
from towerflow.ps.server.tables.optimizers import sparse_optimizer_from_dict
from towerflow.ps.server.tables.rows import (
    _FLOAT_DTYPES,
    DenseRowStore,
    RowStore,
    initializer_from_dict,
)

__all__ = ["row_store_from_dict"]

_STORES: dict[str, type[RowStore]] = {"dense": DenseRowStore, "dynamic": DynamicRowStore}
_DTYPES = {str(d).removeprefix("torch."): d for d in _FLOAT_DTYPES}


def row_store_from_dict(data: Mapping[str, Any]) -> RowStore:
    """A fresh store (rows at their initializer's values) from :meth:`RowStore.describe`.

    Raises:
        InvalidArgumentError: not such a dict, an unknown kind or dtype, or what
            the store's constructor refuses.
    """
    keys = {"kind", "partitioner", "shard", "dim", "dtype", "optimizer", "initializer"}
    if isinstance(data, Mapping) and data.get("kind") == "dynamic":
        keys.add("options")
    if not isinstance(data, Mapping) or set(data) != keys:
        raise InvalidArgumentError(
            f"A row store is described by a dict with exactly the keys {sorted(keys)}, got "
            f"{data!r:.200}."
        )
    if data["kind"] not in _STORES or data["dtype"] not in _DTYPES:
        raise InvalidArgumentError(
            f"Unknown row store kind {data['kind']!r} or dtype {data['dtype']!r}; kinds are "
            f"{sorted(_STORES)}, dtypes {sorted(_DTYPES)}."
        )
    extra = {"options": data["options"]} if "options" in data else {}
    return _STORES[data["kind"]](
        partitioner_from_dict(data["partitioner"]), data["shard"], data["dim"],
        sparse_optimizer_from_dict(data["optimizer"]), dtype=_DTYPES[data["dtype"]],
        initializer=initializer_from_dict(data["initializer"]), **extra)
