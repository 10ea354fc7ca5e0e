"""A table's ``TableSpec`` message: built from a :class:`~towerflow.ps.spec.tables.TableConfig`, read back as a row store's description.

A worker sends ``table_spec(config, shard)`` (``InitTable``, an export's
first chunk, an import); a ps task reads it with :func:`describe_table_spec`,
which checks every field before a row store is built from it
(:func:`~towerflow.ps.server.tables.stores.row_store_from_dict`). The
optimizer, initializer, partitioner and dynamic options travel as JSON objects.

Example:
    >>> from towerflow.ps.partition import ModPartitioner
    >>> from towerflow.ps.spec.tables import TableConfig, DEFAULT_INITIALIZER
    >>> config = TableConfig("emb", ModPartitioner(2, 10), 4, {"name": "sgd", "hyper": {}},
    ...                      DEFAULT_INITIALIZER)
    >>> description = describe_table_spec(table_spec(config, 1))
    >>> description["kind"], description["shard"], description["dim"], description["dtype"]
    ('dense', 1, 4, 'float32')
"""

from __future__ import annotations

import json
from typing import Any

from towerflow.errors import InvalidArgumentError
from towerflow.ps.spec.tables import DTYPE_NAMES, TableConfig
from towerflow.ps.wire import tables_pb2 as tpb

__all__ = ["table_spec", "describe_table_spec"]


def table_spec(config: TableConfig, shard: int) -> tpb.TableSpec:
    """The ``TableSpec`` message of shard ``shard`` of the table ``config`` describes."""
    return tpb.TableSpec(
        name=config.name, num_rows=config.num_rows, dim=config.dim,
        dtype=DTYPE_NAMES[config.dtype],
        partitioner=json.dumps(config.partitioner.to_dict(), sort_keys=True),
        optimizer=json.dumps(dict(config.optimizer), sort_keys=True),
        initializer=json.dumps(dict(config.initializer), sort_keys=True), shard=shard,
        store="" if config.store is None else json.dumps(dict(config.store), sort_keys=True))


def _json(field: str, text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidArgumentError(
            f"The table's {field} is not a JSON object ({text[:100]!r}); send the dict's "
            "JSON (e.g. json.dumps(partitioner.to_dict()))."
        ) from None


def describe_table_spec(spec: Any) -> dict[str, Any]:
    """The row store description (:meth:`RowStore.describe`) of a ``TableSpec`` message.

    Raises:
        InvalidArgumentError: a field missing, malformed or inconsistent.
    """
    if not spec.name:
        raise InvalidArgumentError("A table needs a name; give TableSpec.name.")
    partitioner = _json("partitioner", spec.partitioner)
    store = _json("store", spec.store) if spec.store else {"kind": "dense"}
    dynamic = isinstance(store, dict) and store.get("kind") == "dynamic"
    rows = None if dynamic else spec.num_rows
    if not isinstance(partitioner, dict) or partitioner.get("num_rows") != rows or (
            dynamic and spec.num_rows):
        raise InvalidArgumentError(
            f"Table {spec.name!r}: the partitioner {partitioner!r:.200} does not have the "
            f"table's num_rows={spec.num_rows}; describe both with the same size (a dynamic "
            "table: num_rows 0 and an unbounded partitioner)."
        )
    out = {"kind": "dynamic" if dynamic else "dense", "partitioner": partitioner,
           "shard": spec.shard, "dim": spec.dim, "dtype": spec.dtype,
           "optimizer": _json("optimizer", spec.optimizer),
           "initializer": _json("initializer", spec.initializer)}
    if dynamic:
        out["options"] = {k: v for k, v in store.items() if k != "kind"}
    elif store != {"kind": "dense"}:
        raise InvalidArgumentError(
            f"Table {spec.name!r}: unknown store {store!r:.200}; leave TableSpec.store empty "
            "(a fixed table) or describe a dynamic one."
        )
    return out
