"""What runs inside a ps task: the host, the dense shard, the sparse tables.

- :mod:`~towerflow.ps.server.host` — :class:`ShardHost` (the services a ps
  task's ``Server`` hosts) and :func:`run_ps_task`;
- :mod:`~towerflow.ps.server.dense` — the dense shard: flat parameter buffer,
  server-side optimizers, aggregation (async / sync / ssp), the ``PS`` service;
- :mod:`~towerflow.ps.server.tables` — the sparse tables: row stores, row-wise
  optimizers, their aggregation, the ``Tables`` service;
- :mod:`~towerflow.ps.server.pushes` (the push table both kinds of shard keep),
  :mod:`~towerflow.ps.server.lifecycle` (when the task ends),
  :mod:`~towerflow.ps.server.elastic` (elastic workers),
  :mod:`~towerflow.ps.server.workerstats` (what each worker did).

Nothing here is imported by a worker: a worker's side is :mod:`towerflow.ps.worker`,
and both speak the wire contract at the root of :mod:`towerflow.ps`. Importing
this package loads none of its modules.
"""
