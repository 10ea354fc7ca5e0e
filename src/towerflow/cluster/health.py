"""The standard gRPC health service (``grpc.health.v1``) on every task's server.

Kubernetes gRPC probes, load balancers and ``grpc_health_probe`` ask
``/grpc.health.v1.Health/Check`` (or ``Watch``) for the overall service
``""``. A task answers ``SERVING`` once its server listens and its hosted
services are ready (a ps task: once the chief has initialised its shard), and
``NOT_SERVING`` before that and while it shuts down. Any other service name is
unknown (``NOT_FOUND``), so a probe learns nothing but that one word.

``Check`` is the only call a server answers without the cluster's
credentials (:data:`UNAUTHENTICATED_METHODS`, honoured by
:class:`~towerflow.cluster.auth.AuthInterceptor`); ``List`` and everything
else still need them. Since anyone who reaches the port may call it, it is
cheap and bounded apart from the training calls (:class:`HealthGate`, the
server's first interceptor): at most ``max_checks`` at once (another is
refused with ``RESOURCE_EXHAUSTED`` before its request is read), a request
that has not arrived within ``read_timeout`` seconds is cancelled, and one of
more than ``max_request_bytes`` is refused. So health traffic holds at most
``max_checks`` handler threads and never a stream slot. ``Watch`` (a stream
per caller, held as long as the caller likes) answers ``UNIMPLEMENTED``, as
the health protocol allows: a client polls ``Check`` instead.

Example (a probe from Python, as ``grpc_health_probe -addr=localhost:2222`` does)::

    >>> stub = health_pb2_grpc.HealthStub(grpc.insecure_channel("localhost:2222"))  # doctest: +SKIP
    >>> stub.Check(health_pb2.HealthCheckRequest(service="")).status == SERVING     # doctest: +SKIP
    True
"""

from __future__ import annotations

import threading
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

__all__ = [
    "CHECK_METHOD",
    "WATCH_METHOD",
    "UNAUTHENTICATED_METHODS",
    "SERVING",
    "NOT_SERVING",
    "TaskHealth",
    "HealthGate",
]

CHECK_METHOD = "/grpc.health.v1.Health/Check"
WATCH_METHOD = "/grpc.health.v1.Health/Watch"
#: the only method a server answers without credentials
UNAUTHENTICATED_METHODS = frozenset({CHECK_METHOD})
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class TaskHealth:
    """The health service of one task: ``NOT_SERVING`` until :meth:`set_serving`."""

    def __init__(self) -> None:
        self._servicer = health.HealthServicer()
        self._servicer.set(health.OVERALL_HEALTH, NOT_SERVING)
        self._lock = threading.Lock()
        self._serving = False
        self._closed = False

    def add_to(self, server: grpc.Server) -> None:
        """Serve ``grpc.health.v1.Health`` on ``server`` (before it starts)."""
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def gate(self, **limits: Any) -> HealthGate:
        """The interceptor that answers this task's health calls within bounds (first in line)."""
        return HealthGate(self._servicer, **limits)

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


class HealthGate(grpc.ServerInterceptor):
    """Answers the health calls itself, bounded, before any other interceptor sees them.

    Args:
        servicer: the health servicer whose answers it gives.
        max_checks: most ``Check`` calls handled at once (each holds a handler
            thread while its request arrives); one past it is refused at once.
        read_timeout: seconds a ``Check``'s request may take to arrive before
            the call is cancelled.
        max_request_bytes: largest ``Check`` request accepted (a real one is a
            service name: a few bytes).
    """

    def __init__(self, servicer: health.HealthServicer, *, max_checks: int = 2,
                 read_timeout: float = 2.0, max_request_bytes: int = 1024) -> None:
        self._servicer = servicer
        self.max_checks = max_checks
        self._slots = threading.BoundedSemaphore(max_checks)
        self._read_timeout = read_timeout
        self._max_request_bytes = max_request_bytes
        self._check = grpc.stream_unary_rpc_method_handler(
            self._bounded_check, response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
        self._watch = grpc.stream_stream_rpc_method_handler(self._refuse_watch)

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        method = handler_call_details.method
        if method == CHECK_METHOD:
            return self._check
        if method == WATCH_METHOD:
            return self._watch
        return continuation(handler_call_details)

    @staticmethod
    def _refuse_watch(requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED,
                      "this task answers the health Check only (a Watch stream would be held "
                      "open without bound); poll /grpc.health.v1.Health/Check instead.")

    def _bounded_check(self, requests: Any, context: grpc.ServicerContext) -> Any:
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.max_checks} health checks are already being answered; "
                          "probe again later.")
        if not context.add_callback(self._slots.release):
            self._slots.release()  # the call already ended
        timer = threading.Timer(self._read_timeout, context.cancel)
        timer.daemon = True
        timer.start()
        try:
            request = next(requests, None)
        except grpc.RpcError:
            request = None
        finally:
            timer.cancel()
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the health check request did not arrive within "
                          f"{self._read_timeout:g} s; send it with the call.")
        if len(request) > self._max_request_bytes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a health check request of {len(request):,} bytes is larger than "
                          f"{self._max_request_bytes:,}; send the service name only.")
        try:
            parsed = health_pb2.HealthCheckRequest.FromString(request)
        except DecodeError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "the health check request is not a HealthCheckRequest message.")
        return self._servicer.Check(parsed, context)
