"""A ps task's dense shard: flat parameter buffer, optimizers, aggregation, the ``PS`` service.

- :mod:`~towerflow.ps.server.dense.shard` — :class:`ShardState`: the flat
  buffers, the step, the push bookkeeping and the ledger;
- :mod:`~towerflow.ps.server.dense.checks` — whether a push matches the shard;
- :mod:`~towerflow.ps.server.dense.records` — what a shard counts and reports;
- :mod:`~towerflow.ps.server.dense.optimizers` — the server-side optimizers;
- :mod:`~towerflow.ps.server.dense.aggregation` — async / sync / ssp;
- :mod:`~towerflow.ps.server.dense.initspec` — checking the chief's ``Init``;
- :mod:`~towerflow.ps.server.dense.service` — :class:`PSService` behind gRPC.
"""
