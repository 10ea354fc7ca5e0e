"""The parameter server wing: two halves and the wire contract they share.

A file's path says which process it runs in:

- :mod:`towerflow.ps.wire` — the wire contract both sides speak: the
  ``.proto`` files and their generated modules, the service's names, call
  sequence and status codes, framing, the messages' Python values
  (:class:`PushHeader`, :class:`PushOutcome`, :class:`AggregationConfig`) and
  tensors as raw buffers;
- at this package's root, what else both sides use: partitioning
  (:mod:`~towerflow.ps.partition`), variable placement
  (:mod:`~towerflow.ps.placement`: :func:`replica_device_setter`) and malloc
  tuning / free-memory checks (:mod:`~towerflow.ps.memory`);
- :mod:`towerflow.ps.server` — what runs inside a ps task: :class:`ShardHost`
  and :func:`run_ps_task` (:mod:`~towerflow.ps.server.host`), the dense shard
  (:class:`ShardState`, :class:`PSService`) and the sparse tables'
  (:class:`TableService`, :class:`TableHost`);
- :mod:`towerflow.ps.worker` — what runs inside a worker: :class:`PSClient`,
  :class:`TableClient` / :class:`TableConfig`, :class:`ShardedEmbedding`,
  :func:`keep_dense` (a model's embedding that stays a dense parameter).

The halves never import each other, and the wire imports neither. This
module only hands names on: importing it loads neither torch nor grpc, nor
either half; each name is imported on first use.

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
    "keep_dense",
    "TableClient",
    "TableConfig",
    "TableService",
    "TableHost",
]

_LAZY = {
    "AggregationConfig": "towerflow.ps.wire.messages",
    "PushHeader": "towerflow.ps.wire.messages",
    "PushOutcome": "towerflow.ps.wire.messages",
    "PushTable": "towerflow.ps.server.pushes",
    "ShardState": "towerflow.ps.server.dense.shard",
    "PSService": "towerflow.ps.server.dense.service",
    "ShardHost": "towerflow.ps.server.host",
    "run_ps_task": "towerflow.ps.server.host",
    "PSClient": "towerflow.ps.worker.dense.client",
    "ShardClient": "towerflow.ps.worker.dense.shard_client",
    "PushResult": "towerflow.ps.worker.dense.client",
    "ShardedEmbedding": "towerflow.ps.worker.tables.embedding",
    "keep_dense": "towerflow.ps.worker.tables.swap",
    "TableClient": "towerflow.ps.worker.tables.client",
    "TableConfig": "towerflow.ps.spec.tables",
    "TableService": "towerflow.ps.server.tables.service",
    "TableHost": "towerflow.ps.server.tables.service",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
