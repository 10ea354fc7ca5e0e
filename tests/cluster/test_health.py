"""The standard gRPC health check on every task: answered without credentials, and nothing else."""

from __future__ import annotations

import re
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from towerflow.cluster import ClusterSpec, Server, ServerOptions
from towerflow.cluster.health import CHECK_METHOD
from towerflow.cluster.server import PING_METHOD
from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.wire import ps_pb2 as pb
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


def test_watch_is_refused_at_once_so_no_stream_is_held_by_a_stranger(spec):
    with Server(spec, "worker", 0, credentials=SECRET) as server:
        address = spec.task_address("worker", 0)
        channels = [grpc.insecure_channel(address) for _ in range(7)]
        try:
            for i in range(200):
                stream = health_pb2_grpc.HealthStub(channels[i % 7]).Watch(
                    health_pb2.HealthCheckRequest(service=""), timeout=5)
                with pytest.raises(grpc.RpcError) as caught:
                    next(stream)
                assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert "poll /grpc.health.v1.Health/Check" in caught.value.details()
            assert server.streams.open_streams == 0
            with make_channel(address, SECRET) as trusted:
                assert unary(trusted, PING_METHOD, b"", timeout=5)
        finally:
            for channel in channels:
                channel.close()


def test_checks_whose_request_never_comes_are_bounded_and_training_calls_go_on(spec):
    release = threading.Event()

    def never_sent():  # type: ignore[no-untyped-def]
        release.wait(30)
        yield from ()

    with Server(spec, "worker", 0, credentials=SECRET) as server:
        address = spec.task_address("worker", 0)
        channels = [grpc.insecure_channel(address) for _ in range(4)]
        calls = [channels[i % 4].stream_unary(CHECK_METHOD).future(never_sent(), timeout=20)
                 for i in range(40)]
        try:
            with make_channel(address, SECRET) as trusted:
                for _ in range(20):  # the training calls find their threads, at once
                    assert unary(trusted, PING_METHOD, b"", timeout=2)
            codes = [call.exception().code() for call in calls]  # every stall ends by itself
            assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 40 - 2 * 4
            assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.INVALID_ARGUMENT}
            assert _check(address) == SERVING  # and the probe answers again
            assert server.streams.open_streams == 0
        finally:
            release.set()
            for channel in channels:
                channel.close()


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=64),
                      st.integers(1025, 4 << 20).map(lambda n: b"\n" + b"x" * n)))
def test_a_check_request_of_any_bytes_is_answered_or_refused_in_one_sentence(spec, body):
    with Server(spec, "worker", 0, credentials=SECRET):
        with grpc.insecure_channel(spec.task_address("worker", 0), options=[
                ("grpc.max_send_message_length", 8 << 20)]) as channel:
            try:
                reply = channel.unary_unary(CHECK_METHOD)(body, timeout=5)
            except grpc.RpcError as exc:
                assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
                if len(body) > 1024:
                    assert re.search(r"a health check request of [\d,]+ bytes is larger than "
                                     r"1,024", exc.details())
            else:
                assert len(body) <= 1024
                assert health_pb2.HealthCheckResponse.FromString(reply).status == SERVING


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
