"""Shared test fixtures: markers, free loopback ports, subprocess helpers."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from towerflow.cluster.launcher import free_ports as _free_ports


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` cleanly when no CUDA device is present."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: seconds a test's threads get to end after it returned
_THREAD_GRACE_S = 10.0


def _owned(thread: threading.Thread) -> bool:
    """A thread a test must end: not a daemon, or one of towerflow's (a server's handlers...)."""
    return not thread.daemon or thread.name.startswith("towerflow")


@pytest.fixture(autouse=True)
def no_thread_outlives_its_test() -> Iterator[None]:
    """Fail a test that leaves a non-daemon or towerflow thread (a server's handler pool,
    a pipeline...) running after it, and its fixtures, ended; such a thread logs into and
    takes cores from the tests after it."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + _THREAD_GRACE_S
    while True:
        left = [t for t in threading.enumerate() if t not in before and _owned(t) and t.is_alive()]
        if not left or time.monotonic() > deadline:
            break
        left[0].join(0.05)
    assert not left, (f"threads started by this test still run {_THREAD_GRACE_S:g} s after it "
                      f"ended: {sorted(t.name for t in left)}; stop the servers, pools and "
                      "pipelines it starts before it returns")


@pytest.fixture(autouse=True)
def no_task_identity_outlives_its_test() -> Iterator[None]:
    """Fail a test that leaves this process registered as a cluster task (a server or an
    all-reduce replica not stopped): the device names of every test after it would change."""
    from towerflow import _identity

    before = list(_identity._registered)
    yield
    left = [task for token, task in _identity._registered if (token, task) not in before]
    assert not left, (f"this test left the process registered as task(s) {left}; stop the "
                      "servers and strategies it starts (shutdown()) before it returns")


@pytest.fixture
def free_ports() -> Callable[[int], list[int]]:
    """Return a function giving ``n`` currently free TCP ports on 127.0.0.1."""
    return _free_ports


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for child Python processes: unbuffered, single-threaded BLAS."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("TF_CONFIG", None)
    return env


@pytest.fixture
def python() -> str:
    """The interpreter running the tests, for starting child processes."""
    return sys.executable


@pytest.fixture
def start_ps_tasks(free_ports) -> Iterator[Callable[[Any], Any]]:
    """Return ``start(credentials) -> ClusterSpec``: two full ps tasks (dense and table
    services) and one worker slot on 127.0.0.1, in this process, serving after Done.

    The tasks it started are stopped when the test ends.
    """
    from towerflow.cluster import ClusterSpec, Server, ServerOptions

    servers: list[Any] = []

    def start(credentials: Any) -> Any:
        ports = free_ports(3)
        spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
                            "worker": [f"127.0.0.1:{ports[2]}"]})
        for i in range(2):
            servers.append(Server(spec, "ps", i, credentials=credentials,
                                  options=ServerOptions(serve_forever=True)))
        return spec

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def ps_process(subprocess_env: dict[str, str]) -> Iterator[tuple[Any, Any, Any]]:
    """One real ps task (``towerflow server``) with a cluster secret, in its own process;
    yields (cluster, the ``LocalCluster``, the ps task)."""
    from towerflow.testing import LocalCluster, leftover_processes, loopback_cluster

    spec = loopback_cluster(num_ps=1, num_workers=1)
    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"],
                      env=subprocess_env) as lc:
        ps = lc.start("ps", 0)
        ps.wait_for_line(r"ps task 0 serving at", timeout=60)
        yield spec, lc, ps
    assert leftover_processes() == []
