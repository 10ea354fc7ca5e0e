"""A model's many small tables kept as one table per kind on the ps tasks.

A recommendation model has a table per field (26 fields: 52 tables in a
DeepFM), and on a ps each table shard is its own item of every step's
request, checked, looked up and updated apart: the cost of a step grows with
the number of tables, not with the rows it touches. Tables that the ps
would treat alike — the same row width, dtype, row-wise optimizer,
initializer kind and ``mod`` partitioning, and pushed the same way — are
therefore laid end to end in one table on the ps tasks (a *fused* table,
as TensorFlow's partitioned variables and TorchRec's batched tables do):
table ``k`` starts at row ``offset_k``, and its id ``i`` is the fused
table's id ``offset_k + i``. Each offset is a multiple of the number of ps
tasks, so id ``i`` lives on the same ps task (``i % num_ps``) in both, and a
step costs one item per fused table and ps task whatever the number of
tables.

Nothing above the table client sees it: each module keeps its own
:class:`~towerflow.ps.spec.tables.TableConfig` (its name, its rows
``0 .. num_rows - 1``), and :class:`~towerflow.ps.worker.tables.client.TableClient`
translates. Checkpoints hold each table under its own name (a table's rows
are exported by their id range), so a checkpoint does not depend on how the
tables were laid out, and restores into a model with more or fewer tables.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from towerflow.ps.partition import ModPartitioner
from towerflow.ps.spec.tables import TableConfig

__all__ = ["TableView", "fuse_tables"]


class TableView(NamedTuple):
    """Where a table lives on the ps: the fused ``table`` and the first row of it, ``offset``."""

    table: TableConfig
    offset: int


def _seeded(initializer: dict[str, Any], name: str) -> dict[str, Any]:
    if "seed" not in initializer:
        return dict(initializer)
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return {**initializer, "seed": int.from_bytes(digest, "little") >> 1}


def _kind(config: TableConfig, extra: Hashable) -> Hashable | None:
    """What a table must share with another to be fused with it (None: never fused)."""
    if config.partitioner.kind != "mod" or config.dynamic:  # a dynamic table stands alone
        return None
    init = {k: v for k, v in config.initializer.items() if k != "seed"}
    return (config.dim, str(config.dtype), json.dumps(config.optimizer, sort_keys=True),
            json.dumps(init, sort_keys=True), extra)


def fuse_tables(configs: Sequence[TableConfig], extras: Sequence[Hashable] | None = None
                ) -> tuple[list[TableConfig], dict[str, TableView]]:
    """Lay the tables that the ps would treat alike end to end.

    Args:
        configs: the tables (one per module).
        extras: per table, what else must be equal to fuse two (e.g. how they
            push); None: nothing else.

    Returns:
        ``(fused, views)``: the fused tables (two members and more), and the
        view of each member by its name. A table fused with no other is in
        neither.

    Example:
        >>> from towerflow.ps.partition import ModPartitioner
        >>> def table(name, rows):
        ...     return TableConfig(name, ModPartitioner(2, num_rows=rows), 4,
        ...                        {"name": "sgd", "hyper": {}}, {"kind": "constant", "value": 0.0})
        >>> fused, views = fuse_tables([table("a", 5), table("b", 3)])
        >>> [(f.name, f.num_rows) for f in fused], views["b"].offset
        ([('a+1', 10)], 6)
    """
    groups: dict[Hashable, list[TableConfig]] = {}
    for index, config in enumerate(configs):
        key = _kind(config, None if extras is None else extras[index])
        if key is not None:
            groups.setdefault(key, []).append(config)
    names = {c.name for c in configs}
    fused: list[TableConfig] = []
    views: dict[str, TableView] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        shards = members[0].partitioner.num_shards
        offsets, total = [], 0
        for member in members:
            offsets.append(total)
            total += -(-member.num_rows // shards) * shards  # keep each id on its ps task
        name = f"{members[0].name}+{len(members) - 1}"
        while name in names:
            name += "'"
        names.add(name)
        first = members[0]
        table = TableConfig(name, ModPartitioner(shards, num_rows=total), first.dim,
                            dict(first.optimizer), _seeded(dict(first.initializer), name),
                            first.dtype)
        fused.append(table)
        for member, offset in zip(members, offsets, strict=True):
            views[member.name] = TableView(table, offset)
    return fused, views
