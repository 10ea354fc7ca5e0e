"""What a ps task reads into memory: no message bigger than its method needs.

A stranger (no secret, no token) reaches the health check and the handshake; a
call to any other method is refused when its headers arrive. The server reads
one message of at most a frame (4 MiB) and a little, and refuses a longer one
from its length prefix, before gRPC buffers its body; a payload of the data
plane that is larger travels in frames (:mod:`towerflow.cluster.frames`).
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
import torch

from towerflow.cluster.auth import HELLO_METHOD
from towerflow.cluster.frames import DEFAULT_FRAME_BYTES
from towerflow.cluster.health import CHECK_METHOD
from towerflow.cluster.transport import Credentials
from towerflow.ps.partition import ModPartitioner
from towerflow.ps.spec.tables import TableConfig
from towerflow.ps.worker.tables.checkpoint import ship_rows

#: the calls of the issue's measurement (issue 35): four at once, 60 MiB each, no credentials
CALLS, BODY_BYTES = 4, 60 << 20
#: what the ps task may grow by in all, peak included. Measured on a 2-core machine, health
#: checks: +243 MiB at peak, +208 to +243 MiB kept, when the server read every message up to
#: 64 MiB; +1.7 to +6.5 MiB (mostly +2.5 to +4.7), peak and kept, now that it reads at most a
#: frame: the calls' handler threads and flow-control windows. Handshakes: +4 to +6 MiB. The
#: bound is half of one body read whole, 5x the largest growth measured: a machine's noise
#: passes, one 60 MiB message kept does not.
GROWTH_BOUND = 30 << 20
SECRET = Credentials(secret=b"receive-limits-secret")
SGD = {"name": "sgd", "hyper": {}}
UNIFORM = {"kind": "uniform", "minval": -0.5, "maxval": 0.5, "seed": 3}


def _call(address: str, method: str, body: bytes) -> tuple[grpc.StatusCode, str]:
    """A call of ``method`` with ``body`` as its request, as a stranger sends it."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length",
                                                  128 << 20)]) as channel:
        try:
            channel.unary_unary(method)(body, timeout=30)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.slow
@pytest.mark.parametrize(("method", "refused"), [
    (CHECK_METHOD, grpc.StatusCode.RESOURCE_EXHAUSTED),  # by gRPC, from the length prefix
    (HELLO_METHOD, grpc.StatusCode.INVALID_ARGUMENT),  # no challenge: its body is never read
], ids=["health", "handshake"])
def test_four_60_mib_calls_without_credentials_cost_the_ps_under_30_mib(ps_process, method,
                                                                       refused):
    import psutil

    spec, _, ps = ps_process
    address = spec.task_address("ps", 0)
    server = psutil.Process(ps.pid)
    body = b"\n" + b"\0" * (BODY_BYTES - 1)
    for _ in range(2):  # the server's first calls (its handler threads) before the baseline
        assert _call(address, method, b"")[0] != grpc.StatusCode.UNAVAILABLE
    baseline = server.memory_info().rss
    peak = baseline
    with futures.ThreadPoolExecutor(CALLS) as pool:
        calls = [pool.submit(_call, address, method, body) for _ in range(CALLS)]
        while not all(c.done() for c in calls):
            peak = max(peak, server.memory_info().rss)
            time.sleep(0.002)  # sampling the ps's memory while the calls run
    after = server.memory_info().rss
    outcomes = [c.result() for c in calls]
    growth = f"{baseline / 2**20:.1f} MiB -> peak {peak / 2**20:.1f}, after {after / 2**20:.1f}"
    assert peak - baseline < GROWTH_BOUND, growth
    assert after - baseline < GROWTH_BOUND, growth
    assert all(code == refused for code, _ in outcomes), outcomes


def test_table_requests_larger_than_a_frame_travel_in_frames_to_a_real_ps(table_ps_tasks):
    _, clients = table_ps_tasks(SECRET)
    client = clients(1)[0]
    # 100,000 ids and 16-float rows per shard: a push of 7.2 MB per ps task in one request
    cfg = TableConfig("wide", ModPartitioner(2, num_rows=200_000), 16, SGD, UNIFORM)
    client.init_table(cfg)
    ids = torch.arange(200_000)
    before = client.pull(cfg, ids)
    client.push(cfg, ids, torch.ones(200_000, 16), lr=1.0, step=1)
    torch.testing.assert_close(client.pull(cfg, ids), before - 1.0, rtol=0, atol=1e-6)
    requests, sent, _ = client.wire["PushRows"]
    assert sent / requests > DEFAULT_FRAME_BYTES  # each push request was longer than a frame
    # a module's rows shipped in ImportRows chunks of 1,000,000 ids (12 MB) per ps task
    narrow = TableConfig("narrow", ModPartitioner(2, num_rows=2_000_000), 1, SGD, UNIFORM)
    client.init_table(narrow)
    rows = torch.arange(2_000_000, dtype=torch.float32).unsqueeze(1)
    ship_rows(client, narrow, None, rows)
    picked = torch.tensor([0, 1, 999_999, 1_000_000, 1_999_999])
    torch.testing.assert_close(client.pull(narrow, picked), rows[picked], rtol=0, atol=0)
