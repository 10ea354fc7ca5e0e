"""Heartbeats by default in real clusters: the ps watches, workers answer through a Server."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Iterator

import pytest

from towerflow.cli import build_parser
from towerflow.cli.server import heartbeat_from_args
from towerflow.cluster import ClusterSpec, Server, ServerOptions, TaskInfo
from towerflow.cluster.heartbeat import HeartbeatOptions
from towerflow.cluster.transport import Credentials
from towerflow.errors import InvalidArgumentError
from towerflow.models.linear import LinearRegression, mse_loss, regression_data
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer
from towerflow.testing import LocalCluster, leftover_processes, loopback_cluster
from towerflow.training.supervisor import Supervisor

SECRET = Credentials(secret=b"heartbeat-default-secret")
FAST = HeartbeatOptions(interval=0.1, max_missed=3, startup_grace=0.0)
DATA = regression_data(16, noise=0.0)


@pytest.fixture
def spec(free_ports) -> ClusterSpec:
    ports = free_ports(2)
    return ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})


def test_towerflow_server_beats_every_second_by_default_and_0_turns_it_off():
    parser = build_parser()
    default = parser.parse_args(["server", "--job", "ps"])
    assert heartbeat_from_args(default) == HeartbeatOptions(interval=1.0)
    assert heartbeat_from_args(parser.parse_args(["server", "--heartbeat", "0.5"])) \
        == HeartbeatOptions(interval=0.5)
    assert heartbeat_from_args(parser.parse_args(["server", "--heartbeat", "0"])) is None
    with pytest.raises(InvalidArgumentError, match=r"--heartbeat -1 is negative; give seconds"):
        heartbeat_from_args(parser.parse_args(["server", "--heartbeat", "-1"]))


def _chief(spec: ClusterSpec, **kw) -> ParameterServer:
    return ParameterServer(spec, TaskInfo("worker", 0), credentials=SECRET, device="cpu", **kw)


def test_a_training_worker_answers_the_ps_heartbeats_and_is_let_go_when_done(spec):
    with Server(spec, "ps", 0, credentials=SECRET, options=ServerOptions(heartbeat=FAST)) as ps:
        host = ps.services[0]
        strategy = _chief(spec)
        try:
            strategy.prepare(LinearRegression(), OptimizerConfig("sgd", lr=0.1))
            assert strategy.server is not None and strategy.server.task == TaskInfo("worker", 0)
            strategy.run_step(mse_loss, DATA)
            health = host.monitor.wait_for("worker", 0, alive=True, timeout=20)
            assert host.service.describe_worker(0) == "/job:worker/replica:0/task:0"
            assert health.pid is not None
        finally:
            strategy.shutdown()
        assert strategy.server is None  # it stopped the server it started
        # it told the ps it was done: its heartbeats end instead of it being reported dead
        deadline = time.monotonic() + 20
        while any(t.name.startswith("towerflow-heartbeat") and t.is_alive()
                  for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the finished worker is still being watched"
            time.sleep(0.05)
        assert host.monitor.dead() == []
        assert host.service.describe_worker(0) == "/job:worker/replica:0/task:0"


@contextlib.contextmanager
def _prepared(strategy: ParameterServer) -> Iterator[ParameterServer]:
    try:
        strategy.prepare(LinearRegression(), OptimizerConfig("sgd", lr=0.1))
        yield strategy
    finally:
        strategy.shutdown()


def test_a_worker_uses_the_server_it_is_given_and_starts_none_when_told(spec):
    # the ps serves on after the first strategy's Done: the second one comes back to it
    with Server(spec, "ps", 0, credentials=SECRET, options=ServerOptions(serve_forever=True)), \
            Server(spec, "worker", 0, credentials=SECRET) as mine:
        with _prepared(_chief(spec, server=mine)) as given:
            assert given.server is mine
        assert not mine.stopped and given.server is mine  # not its own: left running
        with _prepared(_chief(spec, server=False)) as none:
            assert none.server is None


def test_a_supervised_worker_uses_its_master_server_given_or_named_by_its_target(spec, monkeypatch):
    config = {"cluster": spec.as_dict(), "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    monkeypatch.setenv("TOWERFLOW_SECRET", SECRET.secret.decode())
    # the ps serves on after the first session's Done: the second session comes back to it
    with Server(spec, "ps", 0, credentials=SECRET, options=ServerOptions(serve_forever=True)), \
            Server(spec, "worker", 0, credentials=SECRET) as mine:
        for master in (mine, mine.target):  # server.target names this process's live server
            sv = Supervisor(is_chief=True, device="cpu")
            with sv.managed_session(master, model=LinearRegression()) as sess:
                assert sess.strategy.server is mine
                sess.run_step(mse_loss, DATA)
        assert not mine.stopped


def test_a_worker_whose_port_is_taken_trains_on_and_warns(spec, caplog):
    with Server(spec, "ps", 0, credentials=SECRET), \
            Server(spec, "worker", 0, credentials=SECRET):
        with caplog.at_level(logging.WARNING, logger="towerflow.ps"), \
                _prepared(_chief(spec)) as strategy:
            assert strategy.server is None
            assert strategy.run_step(mse_loss, DATA).global_step == 1
    assert re.search(r"/job:worker/replica:0/task:0 trains without a server, so the ps tasks' "
                     r"heartbeats will miss it: cannot listen on 127\.0\.0\.1:\d+", caplog.text)


WORKER = """
import sys
from towerflow.cluster import resolve_cluster
from towerflow.errors import TowerflowError
from towerflow.models.linear import LinearRegression, mse_loss, regression_data
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer

cluster, task = resolve_cluster()
strategy = ParameterServer(cluster, task, mode="sync", step_timeout=float(sys.argv[1]),
                           device="cpu")
data = regression_data(16, noise=0.0)
try:
    strategy.prepare(LinearRegression(), OptimizerConfig("sgd", lr=0.05))
    print("serving", strategy.server.target, flush=True)
    while True:
        print("step", strategy.run_step(mse_loss, data).global_step, flush=True)
except TowerflowError as exc:
    print(f"error {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
finally:
    strategy.shutdown()
"""


@pytest.mark.slow
def test_sync_step_names_a_suspended_worker_with_the_default_heartbeats(python, subprocess_env):
    step_timeout = 8.0
    spec = loopback_cluster(num_ps=1, num_workers=2)
    with LocalCluster(spec, [python, "-c", WORKER, str(step_timeout)], env=subprocess_env) as lc:
        ps = lc.start("ps", 0, [python, "-m", "towerflow", "server"])  # default --heartbeat 1
        workers = [lc.start("worker", i) for i in range(2)]
        for worker in workers:
            worker.wait_for_line(r"^serving grpc://127\.0\.0\.1:\d+$", timeout=90)
        ps.wait_for_line(r"task /job:worker/replica:0/task:1 at 127\.0\.0\.1:\d+ is alive",
                         timeout=60)
        workers[1].wait_for_line(r"^step \d+$", timeout=60, count=3)
        workers[1].suspend()
        assert workers[0].wait(timeout=90) == 3, lc.logs()
        error = workers[0].wait_for_line(r"^error DeadlineExceededError: .*", timeout=5).group(0)
        assert re.search(r"missing: task /job:worker/replica:0/task:1 at 127\.0\.0\.1:\d+ missed "
                         r"\d+ heartbeats \(.*\); it (is dead or suspended|may be slow)\.",
                         error), error
        ps.wait_for_line(r"task /job:worker/replica:0/task:1 at 127\.0\.0\.1:\d+ missed 3 "
                         r"heartbeats \(.*no reply before the deadline.*\); it is dead or "
                         r"suspended", timeout=30)
    assert leftover_processes() == []
