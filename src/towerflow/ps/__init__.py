"""The parameter server wing: what users say, the wire, and the two halves that run.

A file's path says which process runs it and what it is about::

    ps/
      spec/       what users and both halves say (torch only, no gRPC):
                  tables.py (TableConfig, a dynamic table's options),
                  row_optimizers.py (SparseSGD, SparseAdagrad, SparseLazyAdam,
                  SparseFtrl and their registry), initializers.py (UniformRows,
                  NormalRows, ConstantRows), dense.py (dense optimizer names, slots)
      wire/       what travels between the halves: the .proto files and their
                  generated modules, calls.py (service, methods, call sequence,
                  status codes), framing.py, messages.py (PushHeader, PushOutcome,
                  AggregationConfig), tables.py (the TableSpec message),
                  tensors.py (one encode, one decode of raw buffers), finite.py
      partition.py, placement.py, memory.py
                  what both halves compute alike: row partitioners, variable
                  placement (replica_device_setter), malloc tuning
      server/     runs inside a ps task: host.py (ShardHost, run_ps_task),
                  dense/ (store, admission, aggregation, the steps kept of an
                  async run's end, the PS service),
                  tables/ (row stores, the Tables service), lifecycle, elastic
      worker/     runs inside a worker: dense/ (PSClient), tables/ (TableClient,
                  ShardedEmbedding, SparseTables, prefetch, fused tables looked
                  up as one, table checkpoints), live export, observation

Arrows (import contracts in ``pyproject.toml``): ``spec`` imports neither half
nor the wire; ``wire`` imports neither half; the halves never import each other,
and within each half the dense part and the tables are independent.
This module only hands names on: importing it loads neither torch nor grpc,
nor either half; each name is imported on first use.

Example (a ps task, as the article's ``server.join()``)::

    server = towerflow.Server(cluster, "ps", 0)   # hosts ShardHost (JOB_SERVICES["ps"])
    server.join()
"""

from __future__ import annotations

from towerflow._lazy import lazy_dir, lazy_getattr
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
__dir__ = lazy_dir(globals(), __all__)
