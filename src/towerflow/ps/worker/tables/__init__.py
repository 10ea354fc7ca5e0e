"""A worker's side of the sparse embedding tables.

- :mod:`~towerflow.ps.spec.tables` — :class:`TableConfig`: what a table is;
- :mod:`~towerflow.ps.worker.tables.client` — :class:`TableClient`: the calls
  of the ``Tables`` service to every ps task;
- :mod:`~towerflow.ps.worker.tables.stream` — the long-lived row stream to one ps task;
- :mod:`~towerflow.ps.worker.tables.embedding` — :class:`ShardedEmbedding` and
  the tables of a model;
- :mod:`~towerflow.ps.worker.tables.checkpoint` — the tables' rows and slots in
  a checkpoint, streamed part by part.
"""
