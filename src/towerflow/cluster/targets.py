"""What a session target names: ``server.target`` (``grpc://host:port``) back to its task.

TensorFlow's ``sv.managed_session(server.target)`` connects to the task whose
server runs in this process. :func:`resolve_target` does the same: it finds
the live :class:`~towerflow.cluster.Server` of this process listening at that
address (every server registers itself when it is built:
:func:`~towerflow.cluster.server.server_at`), else a task of
the cluster the environment describes (``TF_CONFIG``, torchrun, Slurm) at that
address. A target that names no task of a known cluster is refused, never
taken to mean "train locally"; the empty target ``""`` (TensorFlow's
in-process session) means no cluster.

Example:
    >>> resolve_target("")
    (None, None, None)
"""

from __future__ import annotations

from collections.abc import Mapping

from towerflow.cluster.resolvers import resolve_cluster
from towerflow.cluster.server import Server, address_key, register_server, server_at
from towerflow.cluster.spec import ClusterSpec, TaskInfo
from towerflow.errors import InvalidArgumentError

__all__ = ["register_server", "server_at", "resolve_target"]


def resolve_target(
    target: str, env: Mapping[str, str] | None = None
) -> tuple[ClusterSpec | None, TaskInfo | None, Server | None]:
    """``(cluster, task, server)`` of the task at ``target``; all None for ``""``.

    Raises:
        InvalidArgumentError: ``target`` is not ``host:port`` or names no task
            of a live server of this process nor of the environment's cluster.
    """
    if not target:
        return None, None, None
    key = address_key(target)
    server = server_at(target)
    if server is not None:
        return server.cluster, server.task, server
    cluster, _ = resolve_cluster(env=env)
    if cluster is not None:
        for task, address in cluster.tasks():
            if address_key(address) == key:
                return cluster, task, None
    raise InvalidArgumentError(
        f"target {target!r} names no task this process knows: no towerflow.Server of this "
        "process listens there and the environment (TF_CONFIG, torchrun, Slurm) names no "
        "cluster task at that address. Build the task's Server first "
        "(server = towerflow.Server(cluster, job_name, task_index)) and pass server or "
        "server.target, or pass '' to train in this process alone."
    )
