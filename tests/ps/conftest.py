"""Fixtures of the ps tests: ps tasks that serve only the table service, in this process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture
def table_ps_tasks(free_ports) -> Iterator[Callable[[Any], Any]]:
    """Return ``start(credentials) -> (spec, clients)``: two ps tasks on 127.0.0.1 serving
    only the table service, in this process; ``clients(count, aggregation=None)`` makes
    ``count`` worker clients (ids 0.., incarnations 100..).

    The clients are closed and the tasks stopped when the test ends.
    """
    from towerflow.cluster import ClusterSpec, Server
    from towerflow.ps.worker.tables.client import TableClient

    servers: list[Any] = []
    made: list[Any] = []

    def start(credentials: Any) -> Any:
        ports = free_ports(3)
        spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
                            "worker": [f"127.0.0.1:{ports[2]}"]})
        servers.extend(Server(spec, "ps", i, credentials=credentials,
                              services=["towerflow.ps.server.tables.service:TableHost"])
                       for i in range(2))

        def clients(count: int, aggregation: Any = None) -> list[Any]:
            new = [TableClient(spec.job_tasks("ps"), credentials=credentials, worker_id=w,
                               incarnation=100 + w, timeout=10.0, aggregation=aggregation)
                   for w in range(count)]
            made.extend(new)
            return new

        return spec, clients

    try:
        yield start
    finally:
        for client in made:
            client._close()
        for server in servers:
            server.stop()
