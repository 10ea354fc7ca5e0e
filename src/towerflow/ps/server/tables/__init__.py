"""A ps task's shards of the sparse embedding tables and the ``Tables`` service.

- :mod:`~towerflow.ps.server.tables.rows` — the row stores (fixed and dynamic
  tables) and row initializers;
- :mod:`~towerflow.ps.spec.row_optimizers` — the row-wise optimizers;
- :mod:`~towerflow.ps.server.tables.aggregation` — async / sync / ssp per row;
- :mod:`~towerflow.ps.server.tables.shard` — :class:`TableShard`: one table's
  shard with its push table;
- :mod:`~towerflow.ps.server.tables.service` — :class:`TableService` behind
  gRPC and :class:`TableHost`, its host in a ps task's ``Server``.
"""
