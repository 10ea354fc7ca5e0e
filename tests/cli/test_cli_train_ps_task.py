"""The ps job of ``towerflow train``: when a ps task ends (--serve-forever, --idle-timeout), and
the chief's ``cluster/...`` TensorBoard scalars."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from towerflow.cli import main
from towerflow.cli.train import add_train_arguments, strategy_options
from towerflow.cluster import ClusterSpec
from towerflow.cluster.transport import Credentials
from towerflow.errors import InvalidArgumentError
from towerflow.ps import AggregationConfig, PSClient, plan_placement
from towerflow.ps.wire import ps_pb2 as pb
from towerflow.testing.faults import wait_until


def _tf_config(cluster: dict, job: str) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": 0}})


@pytest.mark.parametrize(("flags", "expected"), [
    ([], (False, 3600.0)),
    (["--serve-forever"], (True, 3600.0)),
    (["--idle-timeout", "7.5"], (False, 7.5)),
    (["--idle-timeout", "0"], (False, None)),
])
def test_the_ps_task_gets_serve_forever_and_idle_timeout(monkeypatch, tmp_path, flags,
                                                         expected) -> None:
    from towerflow.ps.server import host

    seen: list[tuple] = []
    monkeypatch.setattr(host, "run_ps_task", lambda cluster, task, credentials, **kw:
                        seen.append((kw["serve_forever"], kw["idle_timeout"])) or 0)
    cluster = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    monkeypatch.setenv("TF_CONFIG", _tf_config(cluster, "ps"))
    assert main(["train", "digits", "--train-dir", str(tmp_path), *flags]) == 0
    assert seen == [expected]


def test_a_negative_idle_timeout_is_refused_naming_it(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("TF_CONFIG", _tf_config({"ps": ["127.0.0.1:1"],
                                                "worker": ["127.0.0.1:2"]}, "ps"))
    assert main(["train", "digits", "--train-dir", str(tmp_path), "--idle-timeout", "-1"]) == 2
    assert re.search(r"--idle-timeout -1 is not a number of seconds >= 0", capsys.readouterr().err)


@pytest.mark.parametrize(("flags", "shown"), [(["--serve-forever"], "--serve-forever"),
                                               (["--idle-timeout", "5"], "--idle-timeout 5.0")])
def test_the_ps_task_flags_of_a_run_without_ps_tasks_are_refused(flags, shown) -> None:
    args = add_train_arguments(argparse.ArgumentParser()).parse_args(["digits", *flags])
    with pytest.raises(InvalidArgumentError, match=rf"^{re.escape(shown)} does not apply: this "
                       r"run trains with all-reduce replicas"):
        strategy_options(args, "mirrored")
    assert "serve_forever" not in strategy_options(args, "ps")


@pytest.mark.slow
@pytest.mark.parametrize("forever", [False, True], ids=["ends", "serve-forever"])
def test_the_ps_task_ends_after_its_worker_unless_told_to_serve_forever(
        forever, free_ports, subprocess_env, tmp_path) -> None:
    ps_port, worker_port = free_ports(2)
    cluster = ClusterSpec({"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{worker_port}"]})
    secret = b"ps-task-secret"
    env = {**subprocess_env, "TF_CONFIG": _tf_config(cluster.as_dict(), "ps"),
           "TOWERFLOW_SECRET": secret.decode()}
    argv = [sys.executable, "-m", "towerflow", "train", "digits", "--train-dir", str(tmp_path)]
    proc = subprocess.Popen(argv + (["--serve-forever"] if forever else []), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = PSClient(cluster, plan_placement({"w": (4,)}, 1), worker_id=0,
                          credentials=Credentials(secret=secret), timeout=60.0)
        client.initialize([np.zeros(4, np.float32)], optimizer=pb.OptimizerSpec(name="sgd"),
                          aggregation=AggregationConfig(total_num_replicas=1))
        client.push([np.ones(4, np.float32)], lr=0.5)
        client.close()  # Done: its only replica has finished
        if forever:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=3)  # a ps that ends by itself is gone well within this
            probe = PSClient(cluster, plan_placement({"w": (4,)}, 1), worker_id=0,
                             credentials=Credentials(secret=secret))
            try:
                assert probe.stats()[0]["applied"] == 1  # it still serves its parameters
            finally:
                probe.close(done=False)
        else:
            assert wait_until(lambda: proc.poll() is not None, timeout=30,
                              what="the ps task to end")
            assert proc.returncode == 0
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert re.search(r"ps task 0: /job:worker/replica:0/task:0 finished", out), out
    assert ("every replica finished" in out) != forever, out


@pytest.mark.slow
def test_a_local_sync_ps_run_checkpoints_and_its_chief_writes_the_cluster_scalars(
        subprocess_env, tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from towerflow.checkpoint import CheckpointManager

    train_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "towerflow", "train", "digits", "--ps", "1", "--workers", "2",
            "--mode", "sync", "--max-steps", "20", "--batch-size", "16", "--summary-every", "5",
            "--log-every", "5", "--checkpoint-every", "0", "--no-progress",
            "--train-dir", str(train_dir)]
    proc = subprocess.run(argv, env=subprocess_env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mode sync" in proc.stdout + proc.stderr
    ckpt = CheckpointManager(train_dir).restore()  # the final one: no periodic checkpoints
    assert ckpt.step == 20 and ckpt.metadata["strategy"]["mode"] == "sync"
    assert set(ckpt.groups["model"]) == {"hidden.weight", "hidden.bias", "softmax_linear.weight",
                                         "softmax_linear.bias"}
    events = EventAccumulator(str(train_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "cluster/ps0/global_step", "cluster/ps0/param_bytes"} <= tags, tags
    assert {"cluster/worker0/steps", "cluster/worker1/steps"} <= tags, tags
    steps = [e.value for e in events.Scalars("cluster/ps0/global_step")]
    assert steps and len(steps) == 4 and all(0 < s <= 20 for s in steps) and steps == sorted(steps), steps
    assert events.Scalars("cluster/ps0/param_bytes")[-1].value > 0
