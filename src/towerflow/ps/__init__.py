"""The parameter server: placement, ps shards, aggregation, service and client.

- :func:`replica_device_setter` — which ps task holds each variable
  (:mod:`~towerflow.ps.placement`).
- :class:`ShardState` / :class:`AggregationConfig` — a ps shard's flat buffers,
  server-side optimizer and async / sync / ssp aggregation.
- :class:`PSService` — the shard behind gRPC; :class:`ShardHost` — that service
  hosted by a ps task's ``Server`` (so ``Server(cluster, "ps", 0).join()`` is a
  whole ps task, as in article 003); :func:`run_ps_task` — the same, until
  SIGTERM / SIGINT.
- :class:`PSClient` — a worker's pull / push / push-and-pull to every shard.

The wire contract both sides speak is :mod:`~towerflow.ps.protocol`; the
worker's side is :mod:`~towerflow.ps.client` and :mod:`~towerflow.ps.worker`
(and, for sparse tables, :mod:`~towerflow.ps.embedding`), which import no
server module; the server's side is :mod:`~towerflow.ps.server.dense.service` over
:mod:`~towerflow.ps.server.dense.shard`, :mod:`~towerflow.ps.server.dense.aggregation`,
:mod:`~towerflow.ps.server.pushes` and :mod:`~towerflow.ps.server.dense.optimizers`.

Importing this package loads neither torch nor grpc, nor either side's
modules: each is imported on first use of its names.

Example (a ps task, as the article's ``server.join()``)::

    server = towerflow.Server(cluster, "ps", 0)   # hosts ShardHost (JOB_SERVICES["ps"])
    server.join()
"""

from __future__ import annotations

from towerflow._lazy import lazy_getattr
from towerflow.ps.placement import (
    DeviceSetter,
    Placement,
    ShardLayout,
    plan_placement,
    replica_device_setter,
)

__all__ = [
    "replica_device_setter",
    "plan_placement",
    "DeviceSetter",
    "Placement",
    "ShardLayout",
    "ShardState",
    "PushHeader",
    "PushOutcome",
    "PushTable",
    "AggregationConfig",
    "PSService",
    "ShardHost",
    "run_ps_task",
    "PSClient",
    "ShardClient",
    "PushResult",
    "ShardedEmbedding",
    "TableClient",
    "TableConfig",
    "TableService",
    "TableHost",
]

_LAZY = {
    "AggregationConfig": "towerflow.ps.protocol",
    "PushHeader": "towerflow.ps.protocol",
    "PushOutcome": "towerflow.ps.protocol",
    "PushTable": "towerflow.ps.server.pushes",
    "ShardState": "towerflow.ps.server.dense.shard",
    "PSService": "towerflow.ps.server.dense.service",
    "ShardHost": "towerflow.ps.server.host",
    "run_ps_task": "towerflow.ps.server.host",
    "PSClient": "towerflow.ps.client",
    "ShardClient": "towerflow.ps.client",
    "PushResult": "towerflow.ps.client",
    "ShardedEmbedding": "towerflow.ps.embedding",
    "TableClient": "towerflow.ps.table_client",
    "TableConfig": "towerflow.ps.table_client",
    "TableService": "towerflow.ps.server.tables.service",
    "TableHost": "towerflow.ps.server.tables.service",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
