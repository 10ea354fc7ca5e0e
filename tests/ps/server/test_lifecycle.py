"""A ps task ends by itself when its job has finished, and waits (bounded) for workers that died."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time

import numpy as np
import pytest

from towerflow.cluster import ClusterSpec, Server, ServerOptions
from towerflow.cluster.heartbeat import HeartbeatOptions
from towerflow.cluster.transport import Credentials, make_channel, unary
from towerflow.errors import InvalidArgumentError, UnavailableError
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.testing.faults import LocalCluster, leftover_processes, loopback_cluster, wait_until

SECRET = Credentials(secret=b"lifecycle-secret")
TASK = [sys.executable, "-m", "towerflow.testing.task"]
SERVER = [sys.executable, "-m", "towerflow", "server", "--heartbeat", "0.2"]


@pytest.fixture
def spec(free_ports) -> ClusterSpec:
    ports = free_ports(3)
    return ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"],
                        "worker": [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"]})


def _joined(server: Server) -> tuple[threading.Thread, list[BaseException | None]]:
    """``server.join()`` in a thread; the list gets what it raised (None: it returned)."""
    outcome: list[BaseException | None] = []

    def join() -> None:
        try:
            server.join(handle_signals=False)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread, outcome


def _client(spec: ClusterSpec, worker: int) -> PSClient:
    return PSClient(spec, plan_placement({"w": (4,)}, 1), worker_id=worker, credentials=SECRET)


def _train(spec: ClusterSpec) -> list[PSClient]:
    clients = [_client(spec, 0), _client(spec, 1)]
    clients[0].initialize([np.zeros(4, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                          aggregation=AggregationConfig(total_num_replicas=2))
    for client in clients:
        client.push([np.ones(4, np.float32)], lr=0.5)
    return clients


def test_join_returns_once_every_worker_said_done(spec, caplog):
    ps = Server(spec, "ps", 0, credentials=SECRET)
    thread, outcome = _joined(ps)
    try:
        first, second = _train(spec)
        first.close()
        assert thread.is_alive() and not ps.stopped  # one replica is still at work
        with caplog.at_level(logging.INFO, logger="towerflow.ps"):
            finished = time.monotonic()
            second.close()
            thread.join(10.0)
        assert outcome == [None]
        assert time.monotonic() - finished < 5.0
        assert ps.stopped
        assert "ps task 0: every replica finished; ending" in caplog.text
    finally:
        ps.stop()


def test_the_chiefs_done_names_its_final_checkpoint(spec, caplog):
    ps = Server(spec, "ps", 0, credentials=SECRET)
    thread, outcome = _joined(ps)
    try:
        for client in _train(spec):
            client.close(done=False)
        channel = make_channel(spec.task_address("ps", 0), SECRET)
        with caplog.at_level(logging.INFO, logger="towerflow.ps"):
            for worker, final in ((1, False), (0, True)):
                request = pb.DoneRequest(worker_id=worker, final_checkpoint=final,
                                         checkpoint_step=2)
                unary(channel, "/towerflow.ps.PS/Done", request.SerializeToString(), timeout=10)
            channel.close()
            thread.join(10.0)
        assert outcome == [None]
        assert re.search(r"every replica finished \(/job:worker/replica:0/task:0 wrote its "
                         r"final checkpoint at step 2\); ending", caplog.text)
    finally:
        ps.stop()


def test_serve_forever_keeps_a_finished_ps_serving(spec):
    ps = Server(spec, "ps", 0, credentials=SECRET, options=ServerOptions(serve_forever=True))
    thread, outcome = _joined(ps)
    try:
        for client in _train(spec):
            client.close()
        lifecycle = ps.services[0].lifecycle
        wait_until(lambda: len(lifecycle.finished) == 2, timeout=10, what="both Done")
        thread.join(2.0)  # a self-ending ps would be gone well within this
        assert thread.is_alive() and not ps.stopped and outcome == []
        late = _client(spec, 0)
        try:
            assert late.stats()[0]["applied"] == 2  # it still serves its parameters
        finally:
            late.close(done=False)
    finally:
        ps.stop()
        thread.join(10.0)
    assert outcome == [None]


def test_a_ps_whose_workers_are_dead_keeps_its_parameters_up_to_the_idle_timeout(spec, caplog):
    beats = HeartbeatOptions(interval=0.1, max_missed=2, startup_grace=0.0)
    options = ServerOptions(heartbeat=beats, idle_timeout=1.5)
    with caplog.at_level(logging.INFO, logger="towerflow.ps"):
        ps = Server(spec, "ps", 0, credentials=SECRET, options=options)
        thread, outcome = _joined(ps)
        try:
            client = _client(spec, 0)
            client.initialize([np.zeros(4, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                              aggregation=AggregationConfig(total_num_replicas=2))
            client.close(done=False)
            # no worker runs a server: both are dead to the heartbeats
            wait_until(lambda: "every replica that has not finished is dead" in caplog.text,
                       timeout=10, what="the ps to report its workers dead")
            assert not ps.stopped  # the parameters are kept for their return
            thread.join(15.0)
        finally:
            ps.stop()
    assert len(outcome) == 1 and isinstance(outcome[0], UnavailableError)
    assert re.search(r"ps task 0 gave up after 1\.5 s without a live replica: every replica "
                     r"that has not finished is dead or suspended \(/job:worker/replica:0/task:0, "
                     r"/job:worker/replica:0/task:1\)", str(outcome[0]))
    assert "keeping the parameters (step 0) for their return for up to 1.5 s" in caplog.text


def test_idle_timeout_must_be_positive():
    with pytest.raises(InvalidArgumentError, match=r"idle_timeout=0.*positive number of seconds"):
        ServerOptions(idle_timeout=0)


# ------------------------------------------------------------------------ real processes
def _cluster_file(tmp_path, spec: ClusterSpec) -> str:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(spec.as_dict()))
    return str(path)


def _exit_times(procs: list, timeout: float) -> list[float]:
    """``time.monotonic()`` at which each process was first seen ended (polled every 10 ms)."""
    ended: dict[int, float] = {}

    def poll() -> bool:
        for index, proc in enumerate(procs):
            if index not in ended and not proc.running:
                ended[index] = time.monotonic()
        return len(ended) == len(procs)

    wait_until(poll, timeout=timeout, what="every task to exit", interval=0.01)
    return [ended[i] for i in range(len(procs))]


@pytest.mark.slow
@pytest.mark.parametrize("chief", [False, True], ids=["workers", "chief+logdir"])
def test_a_ps_process_exits_0_soon_after_its_last_worker(subprocess_env, tmp_path, chief):
    spec = loopback_cluster(num_ps=1, num_workers=2 if not chief else 1, chief=chief)
    logdir = tmp_path / "train"
    args = ["--steps", "40", "--step-time", "0.01", "--timeout", "20"]
    if chief:
        args += ["--logdir", str(logdir)]
    with LocalCluster(spec, TASK + args, env=subprocess_env) as lc:
        ps = lc.start("ps", 0, SERVER + ["--cluster", _cluster_file(tmp_path, spec), "--job",
                                         "ps", "--task", "0"])
        trainers = [lc.start(t.job_name, t.task_index) for t in spec.replicas]
        exits = _exit_times([ps, *trainers], timeout=180)
        for proc in (ps, *trainers):
            assert proc.returncode == 0, proc.tail()
        seconds = exits[0] - max(exits[1:])
        print(f"ps exit - last worker exit: {seconds:+.2f} s")
        assert seconds < 5.0, ps.tail()
        ps.wait_for_line(r"every replica finished", timeout=5)
        if chief:
            assert any(logdir.iterdir())  # the chief's checkpoints
    assert leftover_processes() == []


@pytest.mark.slow
def test_a_ps_process_whose_workers_were_killed_stays_up_then_exits_2(subprocess_env, tmp_path):
    spec = loopback_cluster(num_ps=1, num_workers=2)
    with LocalCluster(spec, TASK + ["--steps", "100000", "--step-time", "0.01"],
                      env=subprocess_env) as lc:
        ps = lc.start("ps", 0, SERVER + ["--cluster", _cluster_file(tmp_path, spec), "--job",
                                         "ps", "--task", "0", "--idle-timeout", "4"])
        workers = [lc.start("worker", i) for i in range(2)]
        for index, worker in enumerate(workers):
            worker.wait_for_line(r"^step \d+", timeout=120)
            ps.wait_for_line(rf"task /job:worker/replica:0/task:{index} at \S+ is alive",
                             timeout=60)  # seen once, so no start-up grace delays its death
        for worker in workers:
            worker.kill()
        ps.wait_for_line(r"every replica that has not finished is dead or suspended", timeout=20)
        assert ps.running  # within its idle limit it keeps the parameters
        assert ps.wait(timeout=30) == 2
        ps.wait_for_line(r"ps task 0 gave up after 4 s without a live replica", timeout=5)
    assert leftover_processes() == []


# ------------------------------------------------------------ how a training loop ends
class _Broken(RuntimeError):
    pass


class _Script:
    """Worker 1 raises at its local step 3; the chief waits at its step 3 until it has."""

    def __init__(self) -> None:
        self.failed = threading.Event()

    def after(self, worker: int, local: int) -> None:
        if worker == 1 and local == 3:
            self.failed.set()
            raise _Broken(f"worker 1 failed at its step {local}")
        if worker == 0 and local == 3:
            assert self.failed.wait(60)


def _supervised(spec: ClusterSpec, server: Server, logdir, script: _Script) -> None:
    import torch

    from towerflow.models.linear import LinearRegression, mse_loss, regression_data
    from towerflow.strategies import OptimizerConfig
    from towerflow.training.supervisor import Supervisor

    data, worker = regression_data(16), server.task.task_index
    sv = Supervisor(is_chief=worker == 0, logdir=logdir, save_model_secs=None, timeout=10.0)
    model = LinearRegression(torch.Generator().manual_seed(0))
    with sv.managed_session(server, model=model, optimizer=OptimizerConfig("sgd", lr=0.1)) as s:
        for local in range(1, 21):
            s.run_step(mse_loss, data)
            script.after(worker, local)


def _trained(spec: ClusterSpec, server: Server, logdir, script: _Script) -> None:
    import torch

    from towerflow.models.linear import LinearRegression, mse_loss, regression_data
    from towerflow.strategies import OptimizerConfig
    from towerflow.strategies.parameter_server import ParameterServer
    from towerflow.training.hooks import Hook
    from towerflow.training.loop import Trainer

    worker = server.task.task_index

    class Steps(Hook):
        local = 0

        def after_step(self, ctx) -> None:  # noqa: ANN001
            self.local += 1
            script.after(worker, self.local)

    strategy = ParameterServer(spec, server.task, credentials=SECRET, server=server, timeout=10.0)
    trainer = Trainer(LinearRegression(torch.Generator().manual_seed(0)), mse_loss,
                      [regression_data(16)] * 1000, strategy=strategy,
                      optimizer=OptimizerConfig("sgd", lr=0.1), hooks=[Steps()],
                      train_dir=logdir if worker == 0 else None, max_steps=30,
                      summary_every=0, checkpoint_every=1000, ema_decay=None,
                      peers_wait=1.0)  # worker 1 never says Done: the chief waits this long
    try:
        with trainer:
            trainer.fit()
    finally:
        strategy.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("loop", [_supervised, _trained], ids=["supervisor", "trainer"])
def test_a_worker_that_raises_is_not_finished_and_the_chiefs_done_names_its_checkpoint(
        spec, tmp_path, caplog, loop):
    from concurrent.futures import ThreadPoolExecutor

    from towerflow.checkpoint import CheckpointManager

    ps = Server(spec, "ps", 0, credentials=SECRET)
    workers = [Server(spec, "worker", i, credentials=SECRET) for i in range(2)]
    thread, outcome = _joined(ps)
    script = _Script()
    try:
        with caplog.at_level(logging.INFO, logger="towerflow.ps"), ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(loop, spec, workers[i], tmp_path, script) for i in range(2)]
            assert runs[0].result(timeout=120) is None
            with pytest.raises(_Broken, match="worker 1 failed at its step 3"):
                runs[1].result(timeout=120)
        final = CheckpointManager(tmp_path).latest()
        assert final is not None
        step = int(final.name.rsplit("-", 1)[1])
        lifecycle = ps.services[0].lifecycle
        wait_until(lambda: 0 in lifecycle.finished, timeout=10, what="the chief's Done")
        assert lifecycle.finished == {0: f"wrote its final checkpoint at step {step}"}
        assert (f"ps task 0: /job:worker/replica:0/task:0 finished (wrote its final checkpoint "
                f"at step {step})") in caplog.text
        thread.join(1.0)  # a ps that counted the failed worker as finished ends within this
        assert thread.is_alive() and not ps.stopped and outcome == []
        reply = PSClient(spec, plan_placement({"w": (1,)}, 1), worker_id=0,
                         credentials=SECRET)
        try:
            rows = {w.worker_id: w for w in reply.shards[0].status().workers}
        finally:
            reply.close(done=False)
        assert rows[0].done and not rows[1].done
    finally:
        ps.stop()
        for worker in workers:
            worker.stop()
        thread.join(10.0)


def test_a_chiefs_failure_ends_the_ps_with_it_after_the_grace_when_no_worker_asks(
        spec, monkeypatch):
    from towerflow.errors import AbortedError
    from towerflow.ps.server import lifecycle
    from towerflow.ps.worker.dense.client import tell_chief_failure

    monkeypatch.setattr(lifecycle, "FAILURE_GRACE", 0.5)
    ps = Server(spec, "ps", 0, credentials=SECRET)
    thread, outcome = _joined(ps)
    try:
        tell_chief_failure(spec, SECRET, "ValueError: the model does not fit")
        thread.join(10.0)
        assert len(outcome) == 1 and isinstance(outcome[0], AbortedError), outcome
        assert re.fullmatch(r"ps task 0: the chief failed before it initialised the job: "
                            r"ValueError: the model does not fit\. Fix the chief's error and "
                            r"start the job again\.", str(outcome[0]))
    finally:
        ps.stop()


def test_an_async_chief_does_not_wait_for_the_done_of_a_worker_the_heartbeats_find_dead(spec):
    import torch

    from towerflow.strategies import OptimizerConfig
    from towerflow.strategies.parameter_server import ParameterServer

    beats = HeartbeatOptions(interval=0.1, max_missed=2, startup_grace=0.0)
    ps = Server(spec, "ps", 0, credentials=SECRET, options=ServerOptions(heartbeat=beats))
    chief_server = Server(spec, "worker", 0, credentials=SECRET)
    chief = ParameterServer(spec, chief_server.task, credentials=SECRET, server=chief_server)
    try:
        chief.prepare(torch.nn.Linear(2, 1), OptimizerConfig("sgd", lr=0.1))
        assert chief.global_step == 0  # initialised; worker 1 runs no server: dead to the ps
        waited = time.monotonic()
        chief.wait_for_peers(timeout=60.0)
        assert time.monotonic() - waited < 10.0  # not the 60 s it would give a live worker
        rows = {w.worker_id: w.heartbeat for w in chief.client.shards[0].status().workers}
        assert rows.get(1) == "dead"
    finally:
        chief.shutdown()
        chief_server.stop()
        ps.stop()
