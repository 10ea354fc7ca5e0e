"""The parameter server: placement, ps shards, aggregation, service and client.

- :func:`replica_device_setter` — which ps task holds each variable
  (:mod:`~towerflow.ps.placement`).
- :class:`ShardState` / :class:`AggregationConfig` — a ps shard's flat buffers,
  server-side optimizer and async / sync / ssp aggregation.
- :class:`PSService` / :func:`run_ps_task` — the shard behind gRPC on a ps task.
- :class:`PSClient` — a worker's pull / push / push-and-pull to every shard.

Importing this package loads neither torch nor grpc; the service and client
modules (which need grpc) are imported on first use of their names.
"""

from __future__ import annotations

import importlib
from typing import Any

from towerflow.ps.aggregation import AggregationConfig
from towerflow.ps.placement import (
    DeviceSetter,
    Placement,
    ShardLayout,
    plan_placement,
    replica_device_setter,
)
from towerflow.ps.shard import PushHeader, PushOutcome, ShardState

__all__ = [
    "replica_device_setter",
    "plan_placement",
    "DeviceSetter",
    "Placement",
    "ShardLayout",
    "ShardState",
    "PushHeader",
    "PushOutcome",
    "AggregationConfig",
    "PSService",
    "run_ps_task",
    "PSClient",
    "ShardClient",
    "PushResult",
]

_LAZY = {
    "PSService": "towerflow.ps.service",
    "run_ps_task": "towerflow.ps.service",
    "PSClient": "towerflow.ps.client",
    "ShardClient": "towerflow.ps.client",
    "PushResult": "towerflow.ps.client",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'towerflow.ps' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
