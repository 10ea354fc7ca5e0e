"""N local replica processes, torchrun-style: :func:`~towerflow.cluster.launcher.spawn_replicas`.

The launcher of local process groups is one, in :mod:`towerflow.cluster.launcher`;
these names stay importable from here.
"""

from __future__ import annotations

from towerflow.cluster.launcher import exit_status, replica_env, spawn_replicas

__all__ = ["spawn_replicas", "replica_env", "exit_status"]
