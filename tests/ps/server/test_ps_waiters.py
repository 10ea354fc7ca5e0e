"""A sync step that waits for ever holds one handler thread per push, not one per attempt."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from towerflow.cluster import ClusterSpec, Server, ServerOptions
from towerflow.cluster.transport import Credentials
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.testing.faults import wait_until

SECRET = Credentials(secret=b"waiters-secret")


def _client(spec: ClusterSpec, worker: int, **options) -> PSClient:
    return PSClient(spec, plan_placement({"w": (4,)}, 1), worker_id=worker, credentials=SECRET,
                    **options)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 8], ids=["push-stream", "chunked-push"])
def test_attempts_that_time_out_while_a_sync_step_waits_free_their_handler_threads(
        free_ports, caplog, chunk_bytes):
    ports = free_ports(3)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"],
                        "worker": [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"]})
    ps = Server(spec, "ps", 0, credentials=SECRET, options=ServerOptions(serve_forever=True))
    early = _client(spec, 0, push_timeout=0.25, push_wait=None, chunk_bytes=chunk_bytes)
    late = _client(spec, 1)
    try:
        early.initialize([np.zeros(4, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                         aggregation=AggregationConfig(mode="sync", total_num_replicas=2,
                                                       timeout=None))
        results: list = []
        with caplog.at_level(logging.WARNING, logger="towerflow.ps"):
            pusher = threading.Thread(
                target=lambda: results.append(early.push([np.ones(4, np.float32)], lr=1.0)))
            pusher.start()
            wait_until(lambda: "(retry 1," in caplog.text, timeout=60,
                       what="the early worker's first retry")
            before = threading.active_count()
            wait_until(lambda: "(retry 21," in caplog.text, timeout=60,
                       what="22 attempts of the early worker's push")
            grown = threading.active_count() - before
            late.push([np.ones(4, np.float32)], lr=1.0)
            pusher.join(30)
        assert results and results[0].applied and results[0].global_step == 1
        assert grown <= 4, f"{grown} more threads after 20 more timed-out attempts"
    finally:
        early.close(done=False)
        late.close(done=False)
        ps.stop()
