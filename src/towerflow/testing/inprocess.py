"""ps tasks served from this process: real ``Server`` objects on loopback, for tests and
benchmarks that need a cluster but no child processes.

Example::

    with ps_tasks(Credentials(secret=b"s")) as spec:      # 2 ps tasks and a worker slot
        strategy = ParameterServer(spec, TaskInfo("worker", 0), credentials=..., server=False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from towerflow.cluster import ClusterSpec, Server, ServerOptions
from towerflow.testing.faults import loopback_cluster

__all__ = ["ps_tasks"]


@contextlib.contextmanager
def ps_tasks(credentials: Any, num_ps: int = 2, num_workers: int = 1) -> Iterator[ClusterSpec]:
    """``num_ps`` full ps tasks (dense and table services) serving until the block ends.

    Yields the cluster: the ps tasks and ``num_workers`` worker slots, on free 127.0.0.1 ports.
    Every server started is stopped on the way out, however the block ends.
    """
    spec = loopback_cluster(num_ps, num_workers)
    servers: list[Server] = []
    try:
        for index in range(num_ps):
            servers.append(Server(spec, "ps", index, credentials=credentials,
                                  options=ServerOptions(serve_forever=True)))
        yield spec
    finally:
        for server in servers:
            server.stop()
