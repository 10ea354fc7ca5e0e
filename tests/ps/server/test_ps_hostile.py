"""A ps that one slow or hostile peer holding the cluster secret cannot stall or exhaust."""

from __future__ import annotations

import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from towerflow.cluster.transport import make_channel
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.testing import LocalCluster, leftover_processes, loopback_cluster

NUMEL = 1 << 20  # 4 MiB: a push streams in four 1 MiB chunks


def _steps(clients: list[PSClient], params, n: int, voided: list | None = None) -> float:
    """Median seconds of one push-and-pull round of every client (together); a sync step
    voided is listed in ``voided`` (when given) instead of failing."""
    grads = [np.full(NUMEL, 1e-3, np.float32)]

    def one(c: PSClient) -> None:
        result = c.push(grads, lr=0.1, pull_into=params[c.worker_id])
        while voided is not None and result.statuses == ("voided",):  # compute it again
            voided.append(result.messages[0])
            result = c.push(grads, lr=0.1, pull_into=params[c.worker_id])
        assert result.applied

    times = []
    with ThreadPoolExecutor(len(clients)) as pool:
        for _ in range(n):
            start = time.perf_counter()
            list(pool.map(one, clients))
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_peer_stalled_half_way_through_its_push_does_not_slow_honest_workers(
        subprocess_env, mode):
    """Async: its first half is applied on arrival, then it holds nothing others need. Sync:
    its part sum holds the step at most STALL_SECONDS once (the step is voided, naming it),
    so the median step is not slowed."""
    spec = loopback_cluster(1, 3)
    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"],
                      env=subprocess_env) as lc:
        lc.start("ps", 0).wait_for_line(r"ps task 0 serving at", timeout=60)
        placement = plan_placement({"w": (NUMEL,)}, 1)
        honest = [PSClient(spec, placement, worker_id=w, credentials=lc.credentials,
                           timeout=10.0) for w in (0, 2)]
        params = {w: [np.empty(NUMEL, np.float32)] for w in (0, 2)}
        release = threading.Event()
        channel = make_channel(spec.task_address("ps", 0), lc.credentials)
        try:
            honest[0].initialize([np.zeros(NUMEL, np.float32)],
                                 optimizer=pb.OptimizerSpec(name="sgd"),
                                 aggregation=AggregationConfig(mode, total_num_replicas=3,
                                                               replicas_to_aggregate=2))
            _steps(honest, params, 3)  # warm up
            alone = _steps(honest, params, 15)
            baseline = [np.empty(NUMEL, np.float32)]
            honest[0].pull(baseline)
            head = pb.PushRequest(worker_id=1, incarnation=1, seq=1, lr=0.1, dtype="float32",
                                  numel=NUMEL, token=honest[0].global_step())

            def half_then_stall():
                yield head.SerializeToString()
                yield np.ones(NUMEL // 2, np.float32).tobytes()
                release.wait(120)

            hostile = channel.stream_unary("/towerflow.ps.PS/Push").future(
                half_then_stall(), timeout=120)
            shard = honest[0].shards[0]
            deadline = time.monotonic() + 30

            def in_progress() -> int:
                stats = dict(shard.status().stats)
                return stats["pushes"] - stats["applied"] - stats["stale"] - stats["refused"]

            while in_progress() != 1:  # the hostile push has begun
                assert time.monotonic() < deadline, "the hostile push never arrived"
                time.sleep(0.02)
            if mode == "async":  # its first half is applied as it arrives
                pulled = [np.empty(NUMEL, np.float32)]

                def first_value() -> float:
                    honest[0].pull(pulled)
                    return float(pulled[0][0])

                while first_value() == baseline[0][0]:
                    assert time.monotonic() < deadline, "the hostile half was not applied"
                    time.sleep(0.02)
                assert pulled[0][-1] == baseline[0][-1]  # its second half never came
            voided: list[str] = []
            with_hostile = _steps(honest, params, 15, voided)
            assert with_hostile <= 2 * alone + 0.05, (alone, with_hostile)
            assert len(voided) <= 2 and all("the push of worker 1 stopped" in m for m in voided)
            if mode == "async":
                assert not hostile.done()  # still stalled, holding no lock and no bytes
        finally:
            release.set()
            channel.close()
            for c in honest:
                c.close(done=False)
    assert leftover_processes() == []


def test_refused_pushes_with_huge_segment_lists_leave_status_small(free_ports) -> None:
    from towerflow.cluster import ClusterSpec, Server
    from towerflow.cluster.transport import Credentials, stream_unary
    from towerflow.ps import PSService

    secret = Credentials(secret=b"hostile-test")
    port, worker_port = free_ports(2)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{port}"], "worker": [f"127.0.0.1:{worker_port}"]})
    server = Server(spec, "ps", 0, credentials=secret, start=False)
    server.add_handlers([PSService(0).handlers()])
    server.start()
    client = PSClient(spec, plan_placement({"w": (4,)}, 1), worker_id=0, credentials=secret,
                      timeout=30.0)
    try:
        client.initialize([np.zeros(4, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                          aggregation=AggregationConfig())
        shard = client.shards[0]
        big = pb.PushRequest(worker_id=0, incarnation=1, lr=0.1, numel=4, segments=[
            pb.SegmentSignature(name=f"v{i:07d}" + "x" * 40, shape=[i, i])
            for i in range(540_000)])
        assert big.ByteSize() > 30 << 20
        for seq in (1, 2, 3):
            big.seq = seq
            # in frames, as the transport sends it: one 30 MiB message is refused unread
            reply = pb.PushReply.FromString(stream_unary(
                shard.channel, "/towerflow.ps.PS/Push", [big.SerializeToString()], timeout=60))
            assert reply.status == "refused" and len(reply.message) < 2048
        status = shard.status()
        assert status.ByteSize() < 64 << 10 and status.stats["refused"] == 3
        assert client.global_step() == 0
    finally:
        client.close(done=False)
        server.stop()
