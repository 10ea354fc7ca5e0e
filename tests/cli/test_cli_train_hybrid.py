"""``towerflow train click --dense allreduce``: hybrid training from the command line, under
``towerflow launch`` and with its tasks started by hand; its checkpoints in every mode."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from launched import Launched

from towerflow.checkpoint import latest_checkpoint, read_checkpoint
from towerflow.cli import main
from towerflow.testing.faults import LocalCluster, loopback_cluster, wait_until

SMALL = ["--table-rows", "2000", "--ids-per-example", "8", "--embedding-dim", "8",
         "--summary-every", "0", "--no-progress", "--log-every", "50"]
TRAIN = [sys.executable, "-m", "towerflow", "train", "click", *SMALL]


def train(run: Path, env: dict, *args: str) -> str:
    proc = subprocess.run([*TRAIN, "--train-dir", str(run), *args], env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


@pytest.mark.slow
def test_a_hybrid_checkpoint_moves_to_one_process_to_all_ps_and_back(
        tmp_path, subprocess_env) -> None:
    run = tmp_path / "run"
    out = train(run, subprocess_env, "--ps", "1", "--workers", "2", "--dense", "allreduce",
                "--max-steps", "100")
    assert "joined the workers' gloo all-reduce group (2 workers)" in out
    ckpt = read_checkpoint(latest_checkpoint(run))
    assert ckpt.step == 100 and ckpt.metadata["strategy"]["dense"] == "allreduce"
    slots = ckpt.groups["optimizer"]  # the dense layers' adagrad state, by variable
    assert slots and all(name.endswith("/sum") for name in slots)
    assert "table.weight" not in ckpt.groups["model"]  # the table: parts of rows from the ps
    for args, step in ((["--ps", "0", "--workers", "1", "--dense", "ps"], 130),  # one process
                       (["--ps", "2", "--workers", "2", "--dense", "ps"], 160),  # all on the ps
                       (["--ps", "2", "--workers", "2", "--dense", "allreduce",
                         "--embedding-staleness", "1"], 190)):  # rows pulled a step ahead
        out = train(run, subprocess_env, *args, "--max-steps", str(step))
        assert f"at step {step - 30}" in out, out[-3000:]  # restored where the last one ended
        assert read_checkpoint(latest_checkpoint(run)).step == step


def test_dense_allreduce_with_sync_mode_is_refused_with_a_sentence(tmp_path, capsys) -> None:
    code = main(["train", "click", *SMALL, "--ps", "1", "--workers", "2", "--dense", "allreduce",
                 "--mode", "sync", "--max-steps", "5", "--train-dir", str(tmp_path / "run")])
    assert code != 0
    assert "already averaged synchronously by all-reduce" in capsys.readouterr().err


def test_embedding_staleness_without_dense_allreduce_is_refused(tmp_path, capsys) -> None:
    code = main(["train", "click", *SMALL, "--ps", "1", "--workers", "2",
                 "--embedding-staleness", "2", "--max-steps", "5",
                 "--train-dir", str(tmp_path / "run")])
    assert code != 0
    assert "applies to hybrid training only" in capsys.readouterr().err


@pytest.mark.slow
def test_a_killed_worker_stops_the_job_naming_it_and_the_job_started_again_resumes(
        tmp_path, subprocess_env) -> None:
    run = tmp_path / "run"
    spec = loopback_cluster(num_ps=1, num_workers=2)
    command = [*TRAIN, "--train-dir", str(run), "--dense", "allreduce", "--step-timeout", "10",
               "--checkpoint-every", "40"]
    with LocalCluster(spec, command + ["--max-steps", "1000000"], env=subprocess_env,
                      log_dir=tmp_path / "logs") as lc:
        for job, index in (("ps", 0), ("worker", 0), ("worker", 1)):
            lc.start(job, index)
        wait_until(lambda: latest_checkpoint(run), timeout=120, what="a first checkpoint")
        lc.task("worker", 1).kill()
        chief = lc.task("worker", 0)
        assert chief.wait(timeout=60) != 0, chief.tail(40)
        said = chief.output()
        assert "dense all-reduce of step" in said and "/job:worker/replica:0/task:1" in said, \
            said[-4000:]
        assert "start the job again (every worker" in said
        lc.stop_all()
        saved = read_checkpoint(latest_checkpoint(run)).step
        for job, index in (("ps", 0), ("worker", 0), ("worker", 1)):
            lc.start(job, index, command + ["--max-steps", str(saved + 30)])
        assert [lc.task("worker", i).wait(timeout=120) for i in (0, 1)] == [0, 0], lc.logs()
        assert f"at step {saved}" in lc.task("worker", 0).output()
    assert read_checkpoint(latest_checkpoint(run)).step == saved + 30


@pytest.mark.slow
def test_under_launch_max_restarts_a_killed_worker_has_the_workers_rejoin_from_the_checkpoint(
        tmp_path, subprocess_env) -> None:
    run = tmp_path / "run"
    command = [sys.executable, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2",
               "--max-restarts", "1", "--grace", "20", "--", *TRAIN, "--train-dir", str(run),
               "--dense", "allreduce", "--step-timeout", "10", "--checkpoint-every", "50",
               "--max-steps", "100000000"]
    with Launched(command, subprocess_env) as launch:
        launch.wait_for(r"\[worker:0\] saved checkpoint")
        launch.task("worker", 1).kill()
        launch.wait_for(r"restarting the workers and the chief \(restart 1 of 1\)")
        launch.wait_for(r"\[worker:0\] restored .* at step \d+")
        launch.wait_for(r"\[worker:0\] saved checkpoint")  # training went on after the restart
        launch.process.send_signal(signal.SIGTERM)  # stop the run: its checkpoint, exit 0
        assert launch.process.wait(timeout=90) == 0, "".join(launch.seen[-60:])
    said = launch.said()
    # the chief names the lost worker wherever its death found it: in a step's all-reduce,
    # the step log's, a checkpoint's pause or the wait in the store for the others' word
    assert re.search(r"\[worker:0\] towerflow train: error: Worker 0: the (dense all-reduce of "
                     r"step \d+|all-reduce of the step log at step \d+|checkpoint's pause at step "
                     r"\d+|wait for the other workers' pushes before the checkpoint of step \d+) "
                     r"failed \(.*\): /job:worker/replica:0/task:1 at ", said), said[-4000:]
