"""towerflow train --bind / TOWERFLOW_BIND: the interface a training task's server listens on.

In a Kubernetes pod the cluster names the pod's own Service, which resolves only once the
pod runs; the task's server then listens on an interface of the pod instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest
import torch

from towerflow.cli.train import add_train_arguments, bind_host, build_strategy, strategy_options
from towerflow.cluster import Server
from towerflow.errors import InvalidArgumentError


def _args(*argv: str) -> argparse.Namespace:
    return add_train_arguments(argparse.ArgumentParser()).parse_args(["digits", *argv])


def _tf_config(cluster: dict, job: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})


def _listening(port: int, pid: int | None = None) -> set[str]:
    """The local addresses a TCP socket of process ``pid`` (default: this one) listens on."""
    import psutil

    return {c.laddr.ip.removeprefix("::ffff:") for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_bind_is_the_flag_else_towerflow_bind_else_the_cluster_host() -> None:
    assert bind_host(_args("--bind", "::"), {"TOWERFLOW_BIND": "0.0.0.0"}) == "::"
    assert bind_host(_args(), {"TOWERFLOW_BIND": "0.0.0.0"}) == "0.0.0.0"
    assert bind_host(_args(), {"TOWERFLOW_BIND": ""}) is None
    assert bind_host(_args(), {}) is None


def test_bind_of_a_run_without_a_server_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"--bind 0\.0\.0\.0 does not apply: this run "
                       r"trains with all-reduce replicas"):
        strategy_options(_args("--bind", "0.0.0.0"), "mirrored")


def test_a_worker_whose_service_name_does_not_resolve_serves_on_the_bound_interface(
        free_ports) -> None:
    from towerflow.strategies.base import OptimizerConfig

    ps_port, worker_port = free_ports(2)
    cluster = {"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"worker-0.invalid:{worker_port}"]}
    env = {"TF_CONFIG": _tf_config(cluster, "worker", 0), "TOWERFLOW_BIND": "127.0.0.1"}
    with Server(cluster, "ps", 0):
        strategy = build_strategy(_args(), env)
        try:
            strategy.prepare(torch.nn.Linear(3, 1), OptimizerConfig(lr=0.1))
            assert strategy.server is not None
            assert _listening(worker_port) == {"127.0.0.1"}
        finally:
            strategy.shutdown()
    wide = build_strategy(_args("--bind", "0.0.0.0"), {**env, "TOWERFLOW_BIND": "127.0.0.1"})
    with pytest.raises(InvalidArgumentError, match=(
            r"refusing to serve /job:worker/replica:0/task:0 on non-loopback address "
            rf"0\.0\.0\.0:{worker_port} without authentication")):
        wide.prepare(torch.nn.Linear(3, 1), OptimizerConfig(lr=0.1))


def _ps_task(cluster: dict, env: dict[str, str], *argv: str) -> subprocess.Popen:
    env = {**env, "TF_CONFIG": _tf_config(cluster, "ps", 0)}
    return subprocess.Popen([sys.executable, "-m", "towerflow", *argv],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_listening(proc: subprocess.Popen, port: int, timeout: float = 60.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = _listening(port, proc.pid)
        if found:
            return found
        time.sleep(0.05)
    return set()


@pytest.mark.slow
@pytest.mark.parametrize(("command", "how"), [("train", "flag"), ("train", "environment"),
                                              ("server", "flag"), ("server", "environment")])
def test_a_ps_task_listens_where_it_is_told(command, how, free_ports, subprocess_env,
                                            tmp_path) -> None:
    """``towerflow train`` and ``towerflow server`` alike: --bind, else TOWERFLOW_BIND."""
    ps_port, worker_port = free_ports(2)
    cluster = {"ps": [f"ps-0.invalid:{ps_port}"], "worker": [f"worker-0.invalid:{worker_port}"]}
    base = {k: v for k, v in subprocess_env.items() if k != "TOWERFLOW_BIND"}
    argv = (("train", "digits", "--train-dir", str(tmp_path / "run")) if command == "train"
            else ("server",))
    told = (_ps_task(cluster, base, *argv, "--bind", "127.0.0.1") if how == "flag"
            else _ps_task(cluster, {**base, "TOWERFLOW_BIND": "127.0.0.1"}, *argv))
    try:
        assert _wait_listening(told, ps_port) == {"127.0.0.1"}, told.poll()
    finally:
        told.terminate()
        out, _ = told.communicate(timeout=30)
    assert told.returncode == 0, out


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "server"])
def test_a_ps_task_told_no_interface_refuses_its_unresolvable_cluster_address(
        command, free_ports, subprocess_env, tmp_path) -> None:
    ps_port, worker_port = free_ports(2)
    cluster = {"ps": [f"ps-0.invalid:{ps_port}"], "worker": [f"worker-0.invalid:{worker_port}"]}
    base = {k: v for k, v in subprocess_env.items() if k != "TOWERFLOW_BIND"}
    argv = (("train", "digits", "--train-dir", str(tmp_path / "run")) if command == "train"
            else ("server",))
    untold = _ps_task(cluster, base, *argv)
    out, _ = untold.communicate(timeout=120)
    assert untold.returncode != 0 and f"ps-0.invalid:{ps_port}" in out, out

