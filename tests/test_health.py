"""The standard gRPC health check on every task: answered without credentials, and nothing else."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from towerflow.cluster import ClusterSpec, Server, ServerOptions
from towerflow.cluster.server import PING_METHOD
from towerflow.cluster.transport import Credentials
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps import ps_pb2 as pb
from towerflow.testing.faults import wait_until

SECRET = Credentials(secret=b"health-secret")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def spec(free_ports) -> ClusterSpec:
    ports = free_ports(3)
    return ClusterSpec({"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
                        "worker": [f"127.0.0.1:{ports[2]}"]})


def _check(address: str, service: str = "") -> int:
    """A probe as Kubernetes sends it: a plain channel, no credentials."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _refused(address: str, method: str, request: bytes = b"") -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary(method)(request, timeout=5)
    return caught.value.code()


def test_every_task_answers_the_health_check_without_credentials(spec):
    options = ServerOptions(serve_forever=True)
    with Server(spec, "chief", 0, credentials=SECRET), \
            Server(spec, "worker", 0, credentials=SECRET), \
            Server(spec, "ps", 0, credentials=SECRET, options=options):
        assert _check(spec.task_address("chief", 0)) == SERVING
        assert _check(spec.task_address("worker", 0)) == SERVING
        # a ps serves nothing useful before the chief initialises its shard
        assert _check(spec.task_address("ps", 0)) == NOT_SERVING


def test_a_ps_is_serving_once_initialised_and_not_serving_while_it_stops(spec):
    ps = Server(spec, "ps", 0, credentials=SECRET, options=ServerOptions(serve_forever=True))
    address = spec.task_address("ps", 0)
    try:
        client = PSClient(spec, plan_placement({"w": (4,)}, 1), worker_id=0, credentials=SECRET)
        try:
            client.initialize([np.zeros(4, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                              aggregation=AggregationConfig(total_num_replicas=2))
        finally:
            client.close(done=False)
        wait_until(lambda: _check(address) == SERVING, timeout=10, what="the ps to serve")
        ps.health.shutdown()  # the first thing stop() does
        assert _check(address) == NOT_SERVING
    finally:
        ps.stop()


def test_the_health_check_reveals_only_the_overall_status(spec):
    with Server(spec, "worker", 0, credentials=SECRET):
        address = spec.task_address("worker", 0)
        with pytest.raises(grpc.RpcError) as caught:
            _check(address, "towerflow.ps.PS")
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        # List (every service and its status) is not exempt from authentication
        assert _refused(address, "/grpc.health.v1.Health/List",
                        health_pb2.HealthListRequest().SerializeToString()) \
            == grpc.StatusCode.UNAUTHENTICATED


def test_watch_answers_without_credentials(spec):
    with Server(spec, "worker", 0, credentials=SECRET):
        with grpc.insecure_channel(spec.task_address("worker", 0)) as channel:
            stream = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert next(stream).status == SERVING
            stream.cancel()


def test_every_other_call_without_the_secret_is_still_refused(spec):
    options = ServerOptions(serve_forever=True)
    with Server(spec, "ps", 0, credentials=SECRET, options=options), \
            Server(spec, "worker", 0, credentials=SECRET):
        for job in ("ps", "worker"):
            assert _refused(spec.task_address(job, 0), PING_METHOD) \
                == grpc.StatusCode.UNAUTHENTICATED
        for method in ("Status", "Done", "Ledger"):
            assert _refused(spec.task_address("ps", 0), f"/towerflow.ps.PS/{method}") \
                == grpc.StatusCode.UNAUTHENTICATED
        # a look-alike of the exempt path is no exemption
        assert _refused(spec.task_address("ps", 0), "/grpc.health.v1.Health/Check/x") \
            == grpc.StatusCode.UNAUTHENTICATED
