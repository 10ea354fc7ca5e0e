"""A restarted ps task forgets the elastic workers that joined it.

Elastic members live in the ps task's memory only (they are in no checkpoint):
once the task restarts and the chief initialises it again, a push under an
elastic id is refused as one from an id that never joined.
"""

from __future__ import annotations

import pytest

from towerflow.cluster import ClusterSpec, Server, TaskInfo
from towerflow.cluster.transport import Credentials
from towerflow.errors import InvalidArgumentError
from towerflow.models.linear import LinearRegression, mse_loss, regression_data
from towerflow.ps import PSService
from towerflow.ps.wire.calls import ELASTIC_BASE
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.parameter_server import ParameterServer

SECRET = Credentials(secret=b"elastic-restart-secret")
DATA = regression_data(32, noise=0.0)
SGD = OptimizerConfig("sgd", lr=0.05)


def _serve(spec: ClusterSpec) -> Server:
    server = Server(spec, "ps", 0, credentials=SECRET, start=False)
    server.add_handlers([PSService(0, replicas=1).handlers()])
    server.start()
    return server


def _chief(spec: ClusterSpec) -> ParameterServer:
    strategy = ParameterServer(spec, TaskInfo("worker", 0), mode="async", credentials=SECRET,
                               device="cpu", server=False)
    strategy.prepare(LinearRegression(), SGD)
    assert strategy.run_step(mse_loss, DATA).applied
    return strategy


def test_an_elastic_worker_is_refused_by_a_restarted_ps_task(free_ports) -> None:
    ports = free_ports(2)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    servers = [_serve(spec)]
    strategies = [_chief(spec)]
    try:
        extra = ParameterServer(spec, join=True, credentials=SECRET, device="cpu")
        strategies.append(extra)
        extra.prepare(LinearRegression(), SGD)
        assert extra.worker_id == ELASTIC_BASE and extra.run_step(mse_loss, DATA).applied
        servers[0].stop()
        servers.append(_serve(spec))         # the ps task restarted: a fresh process state
        strategies.append(_chief(spec))      # the chief initialised it again
        with pytest.raises(InvalidArgumentError, match=(
                rf"from worker {ELASTIC_BASE} was refused: the replicas of this job are 0 \.\. 0"
                r".*Ids from \d+ up are elastic workers': one counts from its Join to its Done")):
            extra.run_step(mse_loss, DATA)
    finally:
        for strategy in reversed(strategies):
            strategy.shutdown()
        for server in servers:
            server.stop()
