"""``towerflow status``: a running cluster's tasks, ps shards and workers; the chief's scalars."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from towerflow.cli import build_parser, main
from towerflow.cluster import ClusterSpec, Server, ServerOptions
from towerflow.cluster.transport import Credentials
from towerflow.models.linear import LinearRegression, mse_loss, regression_data
from towerflow.ps.worker.observe import ClusterObserver, summary_scalars
from towerflow.testing.faults import LocalCluster, leftover_processes, loopback_cluster, wait_until
from towerflow.training.supervisor import Supervisor

TASK = [sys.executable, "-m", "towerflow.testing.task"]
SECRET = Credentials(secret=b"status-secret")


def _status(lc: LocalCluster, cluster_file: str, *extra: str) -> dict:
    """``towerflow status --once --json`` as a user runs it, with the cluster's secret file."""
    out = subprocess.run([sys.executable, "-m", "towerflow", "status", "--cluster", cluster_file,
                          "--once", "--json", "--interval", "0.5", "--timeout", "1", *extra],
                         env=lc.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _status_here(lc: LocalCluster, cluster_file: str, capsys, monkeypatch) -> dict:  # noqa: ANN001
    """The same command run in this process (``main``): a poll that starts no Python."""
    monkeypatch.setenv("TOWERFLOW_SECRET_FILE", lc.env["TOWERFLOW_SECRET_FILE"])
    capsys.readouterr()
    assert main(["status", "--cluster", cluster_file, "--once", "--json", "--interval", "0.5",
                 "--timeout", "1"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_status_reports_both_workers_their_steps_and_a_suspended_one(subprocess_env, tmp_path,
                                                                    capsys, monkeypatch):
    spec = loopback_cluster(num_ps=1, num_workers=2)
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(spec.as_dict()))
    with LocalCluster(spec, TASK + ["--steps", "1000000", "--step-time", "0.01",
                                    "--heartbeat", "0.3"], env=subprocess_env) as lc:
        lc.start("ps", 0)
        workers = [lc.start("worker", i) for i in range(2)]
        for worker in workers:
            worker.wait_for_line(r"^step \d+", timeout=120)

        def heard() -> dict | None:  # the ps has had a heartbeat of each worker
            now = _status_here(lc, str(cluster_file), capsys, monkeypatch)
            return now if all(w["last_heartbeat_age"] is not None
                              for w in now["workers"]) else None

        wait_until(heard, timeout=60, what="the ps's first heartbeat of each worker")
        snap = _status(lc, str(cluster_file))  # as a user runs it
        assert [t["state"] for t in snap["tasks"]] == ["up", "up", "up"], snap["tasks"]
        (shard,) = snap["ps"]
        assert shard["initialized"] and shard["global_step"] > 0 and shard["param_bytes"] > 0
        assert shard["pushes_per_sec"] > 0 and shard["bytes_per_sec"] > 0
        assert shard["stale"] == shard["refused"] == 0 and shard["mode"] == "async"
        assert [w["task"] for w in snap["workers"]] == [
            "/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"]
        for worker in snap["workers"]:
            assert worker["state"] == "up" and worker["steps"] > 0, worker
            assert worker["steps_per_sec"] > 0 and worker["behind"] >= 0
            assert worker["heartbeat"] == "up" and worker["last_heartbeat_age"] < 5

        workers[1].suspend()
        try:
            def suspended() -> dict | None:
                now = _status_here(lc, str(cluster_file), capsys, monkeypatch)
                return now if now["workers"][1]["state"] == "suspended" else None

            snap = wait_until(suspended, timeout=60, what="worker 1 shown suspended")
            assert snap["workers"][0]["state"] == "up"
            assert "suspended or hung" in snap["tasks"][2]["detail"]
            snap = wait_until(lambda: (s := _status_here(lc, str(cluster_file), capsys,
                                                         monkeypatch))["workers"][1]
                              ["heartbeat"] == "suspended" and s, timeout=30,
                              what="the ps's heartbeats to say worker 1 is suspended")
            assert snap["workers"][1]["steps_per_sec"] == 0
        finally:
            workers[1].resume()
        # without the cluster's secret nothing answers but the refusal
        plain = dict(lc.env)
        plain.pop("TOWERFLOW_SECRET_FILE")
        out = subprocess.run([sys.executable, "-m", "towerflow", "status", "--cluster",
                              str(cluster_file), "--once", "--json", "--interval", "0.1"],
                             env=plain, capture_output=True, text=True, timeout=60)
        refused = json.loads(out.stdout)
        assert {t["state"] for t in refused["tasks"]} == {"refused"}
        assert "call refused" in refused["ps"][0]["error"]
    assert leftover_processes() == []


def test_status_renders_a_live_table_of_a_ps_cluster(free_ports, capsys, monkeypatch):
    ports = free_ports(2)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    monkeypatch.setenv("TOWERFLOW_SECRET", SECRET.secret.decode())
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec.as_dict(),
                                               "task": {"type": "worker", "index": 0}}))
    with Server(spec, "ps", 0, credentials=SECRET, options=ServerOptions(serve_forever=True)):
        monkeypatch.setenv("COLUMNS", "200")
        assert main(["status", "--once", "--interval", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "towerflow status" in out and "/job:ps/replica:0/task:0" in out
    assert "not initialised" in out and "dead" in out  # the worker runs no server


def test_status_refuses_a_bad_interval_and_a_missing_cluster(monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TOWERFLOW_HOSTS"))]:
        monkeypatch.delenv(key)
    assert main(["status", "--once", "--interval", "0"]) == 2
    assert "--interval 0 is not a positive number of seconds" in capsys.readouterr().err
    assert main(["status", "--once"]) == 2
    assert "no cluster given; pass --cluster cluster.json" in capsys.readouterr().err
    assert "status" in build_parser().format_help()


def test_the_chief_writes_cluster_scalars_to_tensorboard(free_ports, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ports = free_ports(2)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
    data = regression_data(16, noise=0.0)
    with Server(spec, "ps", 0, credentials=SECRET), \
            Server(spec, "worker", 0, credentials=SECRET) as mine:
        sv = Supervisor(is_chief=True, logdir=tmp_path, save_summaries_secs=0.2, device="cpu")
        with sv.managed_session(mine, model=LinearRegression()) as sess:
            started = time.monotonic()
            while time.monotonic() - started < 1.0:  # several summary intervals of training
                sess.run_step(mse_loss, data)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("cluster/ps0/global_step", "cluster/ps0/pushes_per_sec", "cluster/ps0/stale",
                "cluster/ps0/refused", "cluster/ps0/lead", "cluster/worker0/steps_per_sec",
                "cluster/worker0/behind"):
        assert tag in tags, sorted(tags)
    assert events.Scalars("cluster/ps0/global_step")[-1].value > 0


def test_summary_scalars_name_each_shard_and_worker():
    snapshot = {"ps": [{"shard": 1, "global_step": 5, "pushes_per_sec": None, "stale": 2}],
                "workers": [{"replica": 0, "job": "chief", "index": 0, "steps": 9, "behind": 1}]}
    assert summary_scalars(snapshot) == {
        "cluster/ps1/global_step": 5.0, "cluster/ps1/stale": 2.0,
        "cluster/chief0/steps": 9.0, "cluster/chief0/behind": 1.0}


def test_an_observer_needs_a_positive_timeout():
    from towerflow.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"timeout=0.*positive number of seconds"):
        ClusterObserver({"ps": ["127.0.0.1:1"]}, SECRET, timeout=0)


def test_the_tables_headers_fit_80_columns() -> None:
    from rich.console import Console

    from towerflow.cli.status import render

    snapshot = {"time": 0.0, "tasks": [
        {"task": "/job:ps/replica:0/task:0", "address": "localhost:41103", "state": "up",
         "pid": 10464, "detail": ""}],
        "ps": [{"shard": 0, "initialized": True, "param_bytes": 38400, "global_step": 10606,
                "pushes_per_sec": 195.2, "bytes_per_sec": 15_000_000.0, "stale": 0,
                "refused": 0, "lead": 6, "max_lead": 0, "mode": "async"}],
        "workers": [{"replica": 0, "task": "/job:worker/replica:0/task:0", "state": "up",
                     "steps": 3611, "steps_per_sec": 15.0, "behind": 1, "last_push_age": 0.1,
                     "heartbeat": "up", "last_heartbeat_age": 1.0}]}
    console = Console(width=80, record=True)
    console.print(render(snapshot))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for header in ("params", "push/s", "bytes/s", "refused", "lead/max", "replica",
                   "steps/s", "behind", "last push", "heartbeat", "worker:0"):
        assert header in text, header
    assert "…" not in text
