"""The standard gRPC health service (``grpc.health.v1``) on every task's server.

Kubernetes gRPC probes, load balancers and ``grpc_health_probe`` ask
``/grpc.health.v1.Health/Check`` (or ``Watch``) for the overall service
``""``. A task answers ``SERVING`` once its server listens and its hosted
services are ready (a ps task: once the chief has initialised its shard), and
``NOT_SERVING`` before that and while it shuts down. Any other service name is
unknown (``NOT_FOUND``), so a probe learns nothing but that one word.

Those two methods are the only calls a server answers without the cluster's
credentials (:data:`UNAUTHENTICATED_METHODS`, honoured by
:class:`~towerflow.cluster.auth.AuthInterceptor`); ``List`` and everything
else still need them.

Example (a probe from Python, as ``grpc_health_probe -addr=localhost:2222`` does)::

    >>> stub = health_pb2_grpc.HealthStub(grpc.insecure_channel("localhost:2222"))  # doctest: +SKIP
    >>> stub.Check(health_pb2.HealthCheckRequest(service="")).status == SERVING     # doctest: +SKIP
    True
"""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

__all__ = [
    "CHECK_METHOD",
    "WATCH_METHOD",
    "UNAUTHENTICATED_METHODS",
    "SERVING",
    "NOT_SERVING",
    "TaskHealth",
]

CHECK_METHOD = "/grpc.health.v1.Health/Check"
WATCH_METHOD = "/grpc.health.v1.Health/Watch"
#: the only methods a server answers without credentials
UNAUTHENTICATED_METHODS = frozenset({CHECK_METHOD, WATCH_METHOD})
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class TaskHealth:
    """The health service of one task: ``NOT_SERVING`` until :meth:`set_serving`.

    ``Watch`` streams are non-blocking (they hold no handler thread while
    they wait for a change).
    """

    def __init__(self) -> None:
        self._servicer = health.HealthServicer(experimental_non_blocking=True)
        self._servicer.set(health.OVERALL_HEALTH, NOT_SERVING)
        self._lock = threading.Lock()
        self._serving = False
        self._closed = False

    def add_to(self, server: grpc.Server) -> None:
        """Serve ``grpc.health.v1.Health`` on ``server`` (before it starts)."""
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    @property
    def serving(self) -> bool:
        """Whether the task answers ``SERVING``."""
        return self._serving

    def set_serving(self, serving: bool) -> None:
        """Answer ``SERVING`` (True) or ``NOT_SERVING``; ignored after :meth:`shutdown`."""
        with self._lock:
            if self._closed or serving == self._serving:
                return
            self._serving = serving
            self._servicer.set(health.OVERALL_HEALTH, SERVING if serving else NOT_SERVING)

    def shutdown(self) -> None:
        """Answer ``NOT_SERVING`` from now on (the task is stopping)."""
        with self._lock:
            self._closed, self._serving = True, False
            self._servicer.enter_graceful_shutdown()
