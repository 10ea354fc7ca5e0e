"""Services a Server hosts for its job: a ps task is ``Server(cluster, "ps", i).join()``."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import threading

import numpy as np
import pytest

from towerflow.cluster import ClusterSpec, Server, ServerOptions
from towerflow.cluster.services import JOB_SERVICES, factories_for, load_factory, register_service
from towerflow.cluster.transport import Credentials, make_channel, raw_handlers, unary
from towerflow.errors import InvalidArgumentError, NotFoundError, TowerflowError
from towerflow.ps import AggregationConfig, PSClient, PSService, ShardHost, plan_placement
from towerflow.ps.server.tables.service import TableHost
from towerflow.ps.wire import ps_pb2 as pb

SECRET = Credentials(secret=b"services-secret")


@pytest.fixture
def spec(free_ports) -> ClusterSpec:
    ports = free_ports(2)
    return ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})


def _train_once(spec: ClusterSpec, *, done: bool = True) -> np.ndarray:
    """Initialise the ps shard through a real client, push one gradient, return the params.

    ``done=False``: the worker leaves without saying it finished, so the ps task serves on.
    """
    client = PSClient(spec, plan_placement({"w": (4,)}, 1), worker_id=0, credentials=SECRET)
    try:
        client.initialize([np.zeros(4, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                          aggregation=AggregationConfig())
        params = np.empty(4, np.float32)
        client.push([np.ones(4, np.float32)], lr=0.5, pull_into=[params])
        return params
    finally:
        client.close(done=done)


def _status(spec: ClusterSpec) -> pb.StatusReply:
    channel = make_channel(spec.task_address("ps", 0), SECRET)
    try:
        reply = unary(channel, "/towerflow.ps.PS/Status", pb.StatusRequest().SerializeToString(),
                      timeout=10)
    finally:
        channel.close()
    return pb.StatusReply.FromString(reply)


def test_a_ps_server_hosts_its_shard_and_a_worker_trains_on_it(spec):
    options = ServerOptions(serve_forever=True)  # its only worker says Done before the Status
    with Server(spec, "ps", 0, credentials=SECRET, options=options) as ps:
        assert [type(s) for s in ps.services] == [ShardHost, TableHost]
        assert ps.services[0].monitor is None  # heartbeats are opt-in in the Python API
        np.testing.assert_allclose(_train_once(spec), np.full(4, -0.5, np.float32))
        status = _status(spec)
        assert status.initialized and status.step == 1 and status.shard == 0


def test_services_none_serves_only_the_builtin_ping(spec):
    with Server(spec, "ps", 0, credentials=SECRET, services=None) as ps, \
            Server(spec, "worker", 0, credentials=SECRET) as worker:
        assert ps.services == ()
        assert worker.ping("ps", 0)["job"] == "ps"
        with pytest.raises(TowerflowError, match=r"towerflow\.ps\.PS/Status"):
            _status(spec)


def test_handlers_given_for_the_same_service_win_over_the_registered_one(spec):
    service = PSService(0)
    with Server(spec, "ps", 0, credentials=SECRET, handlers=[service.handlers()]) as ps:
        assert [type(s) for s in ps.services] == [TableHost]  # another service: still hosted
        _train_once(spec)
        state = service.shard.state  # the given service received the Init and the push
        assert state.step == 1


def test_other_jobs_host_nothing_by_default(spec):
    with Server(spec, "worker", 0, credentials=SECRET) as worker:
        assert worker.services == ()


class Echo:
    """A hosted service recording its lifecycle."""

    def __init__(self, server: Server, events: list[str]) -> None:
        self.server, self.events = server, events
        events.append(f"built for {server.task.device_name}")

    def handlers(self):  # noqa: ANN201 - grpc.GenericRpcHandler
        return raw_handlers("t.Echo", {"Say": ("unary_unary", lambda r: b"echo " + r)})

    def start(self) -> None:
        assert self.server.address  # the server listens already
        self.events.append("started")

    def stop(self) -> None:
        self.events.append("stopped")


def test_a_service_registered_for_a_job_is_built_started_and_stopped(monkeypatch, free_ports):
    monkeypatch.setitem(JOB_SERVICES, "echo", ())
    events: list[str] = []
    register_service("echo", lambda server: Echo(server, events))
    spec = ClusterSpec({"echo": [f"127.0.0.1:{free_ports(1)[0]}"]})
    server = Server(spec, "echo", 0, credentials=SECRET, start=False)
    assert events == []  # built when the server starts
    server.start()
    channel = make_channel(server.address, SECRET)
    try:
        assert events == ["built for /job:echo/replica:0/task:0", "started"]
        assert unary(channel, "/t.Echo/Say", b"hi", timeout=10) == b"echo hi"
    finally:
        channel.close()
        server.stop()
    assert events[-1] == "stopped"


def test_a_failing_service_start_stops_the_server(spec):
    class Broken(Echo):
        def start(self) -> None:
            raise NotFoundError("the broken service cannot start; fix it.")

    events: list[str] = []
    server = Server(spec, "worker", 0, credentials=SECRET, start=False,
                    services=[lambda s: Broken(s, events)])
    with pytest.raises(NotFoundError, match="the broken service cannot start"):
        server.start()
    assert server.stopped and events[-1] == "stopped"
    with Server(spec, "worker", 0, credentials=SECRET):  # the port was released
        pass


@pytest.mark.parametrize(
    ("factory", "error", "pattern"),
    [
        ("towerflow.ps.ShardHost", InvalidArgumentError,
         r"service factory 'towerflow\.ps\.ShardHost' is not of the form 'package\.module:factory'"),
        ("towerflow.no_such_module:Host", NotFoundError,
         r"module 'towerflow\.no_such_module' cannot be imported"),
        ("towerflow.ps:NoSuchHost", NotFoundError, r"module 'towerflow\.ps' has no 'NoSuchHost'"),
        ("towerflow.ps:__doc__", InvalidArgumentError, r"is not callable"),
    ],
)
def test_bad_service_factories_are_refused_with_the_name(factory, error, pattern):
    with pytest.raises(error, match=pattern):
        load_factory(factory)


def test_services_argument_forms(spec):
    assert load_factory(JOB_SERVICES["ps"][0]) is ShardHost
    assert factories_for("ps", True) == JOB_SERVICES["ps"]
    assert factories_for("ps", None) == factories_for("ps", False) == ()
    with pytest.raises(InvalidArgumentError, match=r"services='towerflow\.ps:ShardHost': pass a "
                                                   r"sequence of factories"):
        Server(spec, "ps", 0, credentials=SECRET, start=False, services="towerflow.ps:ShardHost")
    with pytest.raises(InvalidArgumentError, match=r"not of the form 'package\.module:factory'"):
        register_service("ps", "towerflow.ps")
    with pytest.raises(NotFoundError, match=r"module 'towerflow\.nope' cannot be imported"):
        Server(spec, "worker", 0, credentials=SECRET, services=["towerflow.nope:Host"])


def test_importing_the_cluster_layer_does_not_import_the_ps_layer(python, subprocess_env):
    code = textwrap.dedent("""
        import sys
        import towerflow.cluster
        from towerflow.cluster import Server
        print(sorted(m for m in sys.modules if m.startswith("towerflow.ps")))
    """)
    out = subprocess.run([python, "-c", code], env=subprocess_env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"


PS_PROGRAM = """
import sys
import towerflow
cluster = towerflow.ClusterSpec({"ps": [sys.argv[1]], "worker": [sys.argv[2]]})
server = towerflow.Server(cluster, job_name="ps", task_index=0)
print("joined", server.target, flush=True)
server.join()
print("join returned", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_articles_ps_program_serves_until_a_signal_and_exits_cleanly(
        spec, sig, python, subprocess_env):
    env = {**subprocess_env, "TOWERFLOW_SECRET": SECRET.secret.decode()}
    proc = subprocess.Popen(
        [python, "-c", PS_PROGRAM, spec.task_address("ps", 0), spec.task_address("worker", 0)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        assert lines and lines[0].startswith("joined grpc://127.0.0.1:"), lines
        # the worker has not finished: the ps serves on, and only the signal ends its join
        np.testing.assert_allclose(_train_once(spec, done=False), np.full(4, -0.5, np.float32))
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "join returned" in out and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_join_in_the_main_thread_restores_the_signal_handlers_when_it_returns(spec):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = Server(spec, "ps", 0, credentials=SECRET)
    stopper = threading.Timer(0.05, server.stop)
    try:
        stopper.start()
        server.join()
        assert server.stopped
    finally:
        stopper.cancel()
        server.stop()
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_signal_before_join_stops_the_server_instead_of_killing_the_process(spec):
    """``towerflow server`` and ``run_ps_task`` listen as soon as the server is built: a
    SIGTERM between that and ``join`` ends the join, not the process."""
    import os

    from towerflow.cluster.server import stop_on_signals_from_now

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with stop_on_signals_from_now() as bind:
        server = Server(spec, "ps", 0, credentials=SECRET)
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # before the server is bound or joined
            bind(server)
            server.join(handle_signals=False)  # returns: the signal stopped it
            assert server.stopped
        finally:
            server.stop()
    assert {sig: signal.getsignal(sig) for sig in before} == before
