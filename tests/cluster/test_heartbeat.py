"""Heartbeats over the authenticated transport: dead and suspended tasks are named."""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest

from towerflow.cluster import ClusterSpec, Server, TaskInfo
from towerflow.cluster.heartbeat import HeartbeatMonitor, HeartbeatOptions
from towerflow.cluster.transport import Credentials
from towerflow.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError
from towerflow.testing import LocalCluster, leftover_processes, loopback_cluster

SECRET = Credentials(secret=b"heartbeat-secret")
FAST = HeartbeatOptions(interval=0.1, max_missed=3, startup_grace=0.0)


def _heartbeat_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("towerflow-heartbeat")]


@pytest.fixture
def pair(free_ports):
    """A watching task and a watched task, both served in this process."""
    ports = free_ports(2)
    cluster = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    servers = [Server(cluster, "ps", 0, credentials=SECRET)]
    try:
        servers.append(Server(cluster, "worker", 0, credentials=SECRET))
        yield cluster, servers
    finally:
        for server in servers:
            server.stop()


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"interval": 0}, r"interval must be a positive number of seconds, got 0"),
        ({"max_missed": 0}, r"max_missed must be an integer >= 1, got 0"),
        ({"max_missed": 2.5}, r"max_missed must be an integer >= 1, got 2.5"),
        ({"timeout": -1.0}, r"timeout must be a positive number of seconds, got -1.0"),
        ({"startup_grace": -1}, r"startup_grace must be >= 0 seconds, got -1"),
    ],
)
def test_options_are_validated(options, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        HeartbeatOptions(**options)


def test_detection_bound_counts_the_beat_in_flight_and_the_missed_ones():
    assert HeartbeatOptions(interval=0.5, max_missed=3).detection_bound == pytest.approx(2.0)
    assert HeartbeatOptions(interval=0.5, max_missed=4, timeout=1.0).detection_bound == 5.0


def test_live_peer_is_alive_and_reports_its_pid(pair):
    cluster, (watcher, _) = pair
    with HeartbeatMonitor(watcher, options=FAST) as beats:
        health = beats.wait_for("worker", 0, alive=True, timeout=10)
        assert health.alive and health.missed == 0 and health.last_seen is not None
        assert health.pid is not None
        assert beats.dead() == [] and beats.describe_dead() == ""
        beats.check()  # nothing dead: no error
        assert re.fullmatch(r"task /job:worker/replica:0/task:0 at 127\.0\.0\.1:\d+ is alive "
                            r"\(pid \d+\)", health.describe())


def test_a_peer_not_started_yet_gets_the_startup_grace_before_it_is_dead(free_ports):
    ports = free_ports(2)
    cluster = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    options = HeartbeatOptions(interval=0.05, max_missed=2, startup_grace=1.0)
    with Server(cluster, "ps", 0, credentials=SECRET) as watcher, \
            HeartbeatMonitor(watcher, options=options) as beats:
        beats.wait_for("worker", 0, alive=False, timeout=10)
        health = beats.health("worker", 0)
        assert health.seconds_unseen() >= 1.0 and health.missed > 2
        assert "never answered in" in health.describe()


def test_stopped_peer_is_declared_dead_by_name_and_alive_again_when_back(pair):
    cluster, (watcher, peer) = pair
    dead, back = [], []
    beats = HeartbeatMonitor(watcher, options=FAST, on_dead=dead.append, on_alive=back.append)
    try:
        beats.wait_for("worker", 0, alive=True, timeout=10)
        assert [h.task for h in back] == [TaskInfo("worker", 0)]  # its first answer
        peer.stop()
        health = beats.wait_for("worker", 0, alive=False, timeout=10)
        assert health.missed >= 3
        assert re.fullmatch(
            r"task /job:worker/replica:0/task:0 at 127\.0\.0\.1:\d+ missed \d+ heartbeats "
            r"\(last seen \d+\.\d s ago; last beat: failed to connect: the process is gone or not "
            r"started\); it is dead or suspended", health.describe())
        assert [h.task for h in dead] == [TaskInfo("worker", 0)]
        with pytest.raises(UnavailableError, match=r"task /job:worker/replica:0/task:0 .* missed "
                                                   r"\d+ heartbeats.*Restart the task"):
            beats.check()
        beats.check([TaskInfo("ps", 0)])  # only the dead task's name raises
        restarted = Server(cluster, "worker", 0, credentials=SECRET)
        try:
            beats.wait_for("worker", 0, alive=True, timeout=15)
            assert [h.task for h in back] == [TaskInfo("worker", 0)] * 2
            assert len(dead) == 1
        finally:
            restarted.stop()
    finally:
        beats.stop()
    assert _heartbeat_threads() == []


def test_a_peer_that_refuses_our_credentials_misses_its_beats(free_ports):
    ports = free_ports(2)
    cluster = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    with Server(cluster, "ps", 0, credentials=SECRET) as watcher, \
            Server(cluster, "worker", 0, credentials=Credentials(secret=b"another")), \
            HeartbeatMonitor(watcher, options=FAST) as beats:
        health = beats.wait_for("worker", 0, alive=False, timeout=10)
    assert "refused our credentials" in health.describe()
    assert health.last_seen is None and "never answered" in health.describe()


def test_peers_and_jobs_are_checked_against_the_cluster(pair):
    cluster, (watcher, _) = pair
    with pytest.raises(InvalidArgumentError, match=r"task index 3 is out of range for job 'worker'"):
        HeartbeatMonitor(watcher, peers=[TaskInfo("worker", 3)], start=False)
    with pytest.raises(InvalidArgumentError, match=r"job 'evaluator' is not in the cluster"):
        HeartbeatMonitor(watcher, jobs=["evaluator"], start=False)
    beats = HeartbeatMonitor(watcher, jobs=["worker"], start=False)
    assert [h.task for h in beats.peers()] == [TaskInfo("worker", 0)]
    with pytest.raises(InvalidArgumentError, match=r"/job:ps/replica:0/task:0 is not watched"):
        beats.health("ps", 0)


def test_wait_for_gives_up_with_the_peer_state(pair):
    cluster, (watcher, _) = pair
    with HeartbeatMonitor(watcher, options=FAST) as beats, \
            pytest.raises(DeadlineExceededError, match=r"was not declared dead within 0.3 s"):
        beats.wait_for("worker", 0, alive=False, timeout=0.3)


@pytest.mark.slow
def test_suspended_and_killed_processes_are_detected_and_named(subprocess_env):
    """SIGSTOP is a deadline miss, SIGKILL a refused connection; SIGCONT brings it back."""
    spec = loopback_cluster(num_ps=0, num_workers=2)
    options = HeartbeatOptions(interval=0.25, max_missed=3, startup_grace=0.0)
    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"],
                      env=subprocess_env) as lc:
        watched = lc.start("worker", 1)
        watched.wait_for_line(r"serving /job:worker/replica:0/task:1", timeout=60)
        with Server(spec, "worker", 0, credentials=lc.credentials) as watcher, \
                HeartbeatMonitor(watcher, options=options) as beats:
            health = beats.wait_for("worker", 1, alive=True, timeout=30)
            assert health.pid == watched.pid
            watched.suspend()
            start = time.monotonic()
            health = beats.wait_for("worker", 1, alive=False, timeout=30)
            detected = time.monotonic() - start
            assert re.search(r"task /job:worker/replica:0/task:1 at 127\.0\.0\.1:\d+ missed 3 "
                             r"heartbeats \(last seen \d+\.\d s ago; last beat: no reply before "
                             r"the deadline: the process is suspended or hung\); it is dead or "
                             r"suspended", health.describe())
            assert detected < 30
            watched.resume()
            assert beats.wait_for("worker", 1, alive=True, timeout=30).pid == watched.pid
            watched.kill()
            health = beats.wait_for("worker", 1, alive=False, timeout=30)
            assert "failed to connect" in health.describe()
    assert _heartbeat_threads() == []
    assert leftover_processes() == []


def test_after_shutdown_no_thread_of_servers_monitor_or_ps_client_is_left():
    import numpy as np

    from towerflow.ps import AggregationConfig, PSClient, PSService, plan_placement
    from towerflow.ps.wire import ps_pb2 as pb
    from towerflow.testing import wait_until

    before = set(threading.enumerate())
    spec = loopback_cluster(num_ps=1, num_workers=1)
    service = PSService(0)
    ps = Server(spec, "ps", 0, credentials=SECRET, start=False)
    ps.add_handlers([service.handlers()])
    ps.start()
    worker = Server(spec, "worker", 0, credentials=SECRET)
    beats = HeartbeatMonitor(worker, options=FAST)
    client = PSClient(spec, plan_placement({"w": (4,)}, 1), worker_id=0, credentials=SECRET)
    try:
        client.initialize([np.zeros(4, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                          aggregation=AggregationConfig())
        client.push([np.ones(4, np.float32)], lr=0.1, pull_into=[np.empty(4, np.float32)])
        beats.wait_for("ps", 0, alive=True, timeout=10)
        assert len(set(threading.enumerate()) - before) >= 2  # serving and beating threads
    finally:
        client.close()
        beats.stop()
        worker.stop()
        ps.stop()
    wait_until(lambda: not [t for t in threading.enumerate() if t not in before], timeout=10,
               what="every thread of the servers, the monitor and the ps client ending")


def test_a_peer_marked_finished_is_never_reported_dead(free_ports):
    ports = free_ports(3)
    cluster = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"],
                           "worker": [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"]})
    with Server(cluster, "ps", 0, credentials=SECRET) as watcher, \
            Server(cluster, "worker", 0, credentials=SECRET) as done_worker, \
            Server(cluster, "worker", 1, credentials=SECRET) as lost_worker, \
            HeartbeatMonitor(watcher, options=FAST) as beats:
        beats.wait_for("worker", 0, alive=True, timeout=10)
        beats.wait_for("worker", 1, alive=True, timeout=10)
        beats.mark_finished("worker", 0)
        done_worker.stop()
        lost_worker.stop()
        # by the time the lost worker is declared dead, the finished one has had as long
        beats.wait_for("worker", 1, alive=False, timeout=10)
        assert [h.task for h in beats.dead()] == [TaskInfo("worker", 1)]
        assert beats.health("worker", 0).alive
        beats.check([TaskInfo("worker", 0)])  # the finished task raises nothing
        with pytest.raises(InvalidArgumentError, match=r"not watched by the heartbeat monitor"):
            beats.mark_finished("worker", 7)
