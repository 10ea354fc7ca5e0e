"""Row stores by kind: a fixed table's :class:`~towerflow.ps.server.tables.rows.DenseRowStore`
and a dynamic table's :class:`~towerflow.ps.server.tables.dynamic.DynamicRowStore`, built from
their descriptions (:meth:`RowStore.describe`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from towerflow.errors import InvalidArgumentError
from towerflow.ps.partition import partitioner_from_dict
from towerflow.ps.server.tables.dynamic import DynamicRowStore
from towerflow.ps.server.tables.rows import DenseRowStore, RowStore
from towerflow.ps.spec.initializers import initializer_from_dict
from towerflow.ps.spec.row_optimizers import sparse_optimizer_from_dict
from towerflow.ps.spec.tables import DTYPES_BY_NAME

__all__ = ["row_store_from_dict"]

_STORES: dict[str, type[RowStore]] = {"dense": DenseRowStore, "dynamic": DynamicRowStore}


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
    if data["kind"] not in _STORES or data["dtype"] not in DTYPES_BY_NAME:
        raise InvalidArgumentError(
            f"Unknown row store kind {data['kind']!r} or dtype {data['dtype']!r}; kinds are "
            f"{sorted(_STORES)}, dtypes {sorted(DTYPES_BY_NAME)}."
        )
    extra = {"options": data["options"]} if "options" in data else {}
    return _STORES[data["kind"]](
        partitioner_from_dict(data["partitioner"]), data["shard"], data["dim"],
        sparse_optimizer_from_dict(data["optimizer"]), dtype=DTYPES_BY_NAME[data["dtype"]],
        initializer=initializer_from_dict(data["initializer"]), **extra)
