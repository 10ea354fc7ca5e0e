"""What a session target names: ``server.target`` (``grpc://host:port``) back to its task.

TensorFlow's ``sv.managed_session(server.target)`` connects to the task whose
server runs in this process. :func:`resolve_target` does the same: it finds
the live :class:`~towerflow.cluster.Server` of this process listening at that
address (every server registers itself here when it is built), else a task of
the cluster the environment describes (``TF_CONFIG``, torchrun, Slurm) at that
address. A target that names no task of a known cluster is refused, never
taken to mean "train locally"; the empty target ``""`` (TensorFlow's
in-process session) means no cluster.

Example:
    >>> resolve_target("")
    (None, None, None)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

from towerflow.cluster.resolvers import resolve_cluster
from towerflow.cluster.spec import ClusterSpec, TaskInfo, parse_address
from towerflow.errors import InvalidArgumentError

if TYPE_CHECKING:
    from towerflow.cluster.server import Server

__all__ = ["register_server", "server_at", "resolve_target"]

_LOCK = threading.Lock()
_SERVERS: weakref.WeakSet[Server] = weakref.WeakSet()


def register_server(server: Server) -> None:
    """Record a server of this process so that its ``target`` finds it."""
    with _LOCK:
        _SERVERS.add(server)


def _key(address: str) -> tuple[str, int]:
    host, port = parse_address(address)
    host = host.lower()
    return ("127.0.0.1" if host in ("localhost", "::1") else host), port


def server_at(target: str) -> Server | None:
    """The live (not stopped) server of this process whose address is ``target``."""
    key = _key(target)
    with _LOCK:
        servers = list(_SERVERS)
    for server in servers:
        if not server.stopped and _key(server.address) == key:
            return server
    return None


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
    key = _key(target)
    server = server_at(target)
    if server is not None:
        return server.cluster, server.task, server
    cluster, _ = resolve_cluster(env=env)
    if cluster is not None:
        for task, address in cluster.tasks():
            if _key(address) == key:
                return cluster, task, None
    raise InvalidArgumentError(
        f"target {target!r} names no task this process knows: no towerflow.Server of this "
        "process listens there and the environment (TF_CONFIG, torchrun, Slurm) names no "
        "cluster task at that address. Build the task's Server first "
        "(server = towerflow.Server(cluster, job_name, task_index)) and pass server or "
        "server.target, or pass '' to train in this process alone."
    )
