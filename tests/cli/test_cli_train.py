"""``towerflow train``: one process, resume, N local replicas, and the replica spawner."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from towerflow.checkpoint import CheckpointManager, read_checkpoint
from towerflow.cli import build_parser, main
from towerflow.cli.train import replica_argv
from towerflow.cluster.launcher import spawn_replicas

_STEP = r"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{{6}}: step {}, loss = \d+\.\d\d \(\d+\.\d examples/sec; \d+\.\d{{3}} sec/batch\)"


def _train_args(train_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "digits", "--train-dir", str(train_dir), "--max-steps", str(steps),
            "--batch-size", "16", "--log-every", "10", "--checkpoint-every", "10",
            "--summary-every", "0", "--no-progress", *extra]


def test_train_then_the_same_command_resumes_from_the_latest_checkpoint(
        tmp_path, capsys, caplog) -> None:
    assert main(_train_args(tmp_path, 20, "--device", "/cpu:0")) == 0
    out = capsys.readouterr().out
    assert any(re.fullmatch(_STEP.format(20), line)
               for line in out.splitlines()), out
    with caplog.at_level(logging.INFO, logger="towerflow.training"):
        assert main(_train_args(tmp_path, 30, "--device", "/cpu:0")) == 0
    assert "at step 20" in caplog.text
    out = capsys.readouterr().out
    assert "step 10," not in out and "step 30, loss" in out
    assert CheckpointManager(tmp_path).latest().name == "ckpt-00000030"


@pytest.mark.slow
def test_two_cpu_replicas_train_digits_and_only_the_chief_logs_and_saves(
        tmp_path, subprocess_env, python) -> None:
    cmd = [python, "-m", "towerflow", *_train_args(tmp_path, 20, "--replicas", "2")]
    proc = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step_lines = [line for line in proc.stdout.splitlines() if "loss =" in line]
    assert len(step_lines) == 2 and not any(line.startswith("[replica") for line in step_lines)
    ckpt = read_checkpoint(CheckpointManager(tmp_path).latest())
    assert ckpt.step == 20 and ckpt.metadata["world_size"] == 2
    assert ckpt.metadata["batch_size"] == 16


@pytest.mark.slow
def test_replicas_without_a_usable_network_fail_with_one_message_and_no_traceback(
        tmp_path, subprocess_env, python) -> None:
    env = {**subprocess_env, "GLOO_SOCKET_IFNAME": "nosuchif0"}  # Gloo finds no such interface
    cmd = [python, "-m", "towerflow", *_train_args(tmp_path, 20, "--replicas", "2")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    shown = proc.stdout + proc.stderr
    assert proc.returncode != 0, shown
    assert "Traceback" not in shown
    # whichever replica fails first says why in one line; the other may be stopped before
    # it gets there, and says at most one line (its traceback goes to its log file)
    rank0 = [line for line in shown.splitlines() if line.startswith("towerflow train: error:")]
    rank1 = [line for line in shown.splitlines() if line.startswith("[replica 1]")]
    assert len(rank0) <= 1 and len(rank1) <= 1 and rank0 + rank1, shown
    sentence = (r"Replica {} of 2 could not join the gloo process group at 127\.0\.0\.1:\d+: "
                r".*Unable to find address for: nosuchif0\. Check the network the replicas use")
    for line in rank0:
        assert re.search(sentence.format(0), line), line
    for line in rank1:
        log = tmp_path / "replica-1.log"
        assert re.search(r"\[replica 1\] stopped by UnavailableError: " + sentence.format(1),
                         line) and f"(traceback in {log})" in line, line
        assert "Traceback (most recent call last)" in log.read_text()


def test_replica_command_reproduces_the_parsed_options() -> None:
    argv = ["train", "cifar10", "--replicas", "2", "--train-dir", "d", "--max-steps", "5",
            "--data", "synthetic", "--lr", "0.05", "--log-device-placement"]
    args = build_parser().parse_args(argv)
    again = build_parser().parse_args(replica_argv(args)[3:])
    assert vars(again) == vars(args) | {"_run": again._run}
    assert replica_argv(args)[:3] == [sys.executable, "-m", "towerflow"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_num_gpus_without_gpus_suggests_cpu_replicas(tmp_path, capsys) -> None:
    assert main(_train_args(tmp_path, 5, "--num-gpus", "2")) == 2
    assert "--num-gpus 2 asks for 2 GPU(s) but 0 are visible; use --replicas 2" in \
        capsys.readouterr().err


_FAILING_REPLICA = r"""
import os, sys, time
if os.environ["RANK"] == "0":
    open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(120)  # a replica stuck waiting for a dead peer
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(3)
"""


def test_a_failing_replica_stops_the_others_and_sets_the_exit_status(tmp_path) -> None:
    import psutil

    pid_file = tmp_path / "rank0.pid"
    status = spawn_replicas([sys.executable, "-c", _FAILING_REPLICA, str(pid_file)], 2,
                            grace_s=5.0)
    assert status == 3
    pid = int(pid_file.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_replicas_get_torchrun_environment(tmp_path) -> None:
    code = ("import os, sys; e = os.environ; "
            "open(sys.argv[1] + e['RANK'], 'w').write(','.join(e[k] for k in "
            "('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR')))")
    assert spawn_replicas([sys.executable, "-c", code, str(tmp_path / "r")], 2) == 0
    assert (tmp_path / "r0").read_text() == "0,0,2,127.0.0.1"
    assert (tmp_path / "r1").read_text() == "1,1,2,127.0.0.1"


def _train_flags() -> set[str]:
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for action in sub.choices["train"]._actions for flag in action.option_strings}


def _assert_names_real_flags(message: str) -> None:
    assert "--data synthetic" in message and "--no-download" in message, message
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z_-]*", message))
    assert named <= _train_flags(), f"{sorted(named - _train_flags())} are not flags: {message}"


def test_missing_cifar10_with_no_download_names_the_flags_that_exist(tmp_path, capsys) -> None:
    argv = ["train", "cifar10", "--data-dir", str(tmp_path / "empty"), "--no-download",
            "--train-dir", str(tmp_path / "run"), "--max-steps", "1", "--device", "/cpu:0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "towerflow train: error: CIFAR-10 train files" in err
    _assert_names_real_flags(err)


@pytest.mark.slow
def test_a_failed_cifar10_download_suggests_synthetic_data_and_the_real_flags(
        tmp_path, free_ports, subprocess_env, python) -> None:
    closed = free_ports(1)[0]  # every request goes through a proxy that is not there
    env = dict(subprocess_env, https_proxy=f"http://127.0.0.1:{closed}",
               HTTPS_PROXY=f"http://127.0.0.1:{closed}", no_proxy="", NO_PROXY="")
    cmd = [python, "-m", "towerflow", "train", "cifar10", "--data-dir", str(tmp_path / "data"),
           "--train-dir", str(tmp_path / "run"), "--max-steps", "1", "--device", "/cpu:0"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Cannot download CIFAR-10" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    _assert_names_real_flags(errors[0])


def test_replica_command_keeps_every_flag_the_parser_knows() -> None:
    argv = ["train", "digits", "--replicas", "2", "--device", "/cpu:0", "--ps", "1",
            "--mode", "sync", "--no-download", "--seed", "3", "--ema-decay", "0"]
    args = build_parser().parse_args(argv)
    rebuilt = replica_argv(args)
    assert rebuilt[rebuilt.index("--device") + 1] == "/cpu:0"
    again = build_parser().parse_args(rebuilt[3:])
    assert vars(again) == vars(args) | {"_run": again._run}


def test_a_rerun_whose_train_dir_holds_max_steps_says_so_in_one_line(
        tmp_path, capsys, caplog) -> None:
    assert main(_train_args(tmp_path, 10, "--device", "/cpu:0")) == 0
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="towerflow.training"):
        assert main(_train_args(tmp_path, 10, "--device", "/cpu:0")) == 0
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and re.fullmatch(
        rf"'{re.escape(str(tmp_path))}' already holds global step 10, which reaches max_steps "
        r"10: nothing to train\. Raise max_steps \(--max-steps\) or start another train_dir\.",
        said[0]), said
    assert "loss =" not in capsys.readouterr().out


def test_a_bare_tf_config_without_a_ps_job_makes_this_process_a_replica(
        tmp_path, monkeypatch, free_ports) -> None:
    """The command plays its TF_CONFIG task instead of spawning its own replicas."""
    import json

    port = free_ports(1)[0]
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": [f"127.0.0.1:{port}"]},
                                                "task": {"type": "worker", "index": 0}}))
    assert main(_train_args(tmp_path, 3, "--replicas", "2")) == 0
    assert read_checkpoint(CheckpointManager(tmp_path).latest()).metadata["world_size"] == 1


def test_a_ps_task_of_the_environment_serves_instead_of_training(monkeypatch, capsys) -> None:
    import json

    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["h:1"]},
                                                "task": {"type": "evaluator", "index": 0}}))
    assert main(["train", "digits"]) == 0
    assert "task evaluator:0 does not train" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_ps_training_with_more_gpus_than_visible_suggests_cpu_workers(monkeypatch, capsys) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)  # a local cluster is what gets checked
    assert main(["train", "digits", "--num-gpus", "2", "--ps", "1"]) == 2
    assert "--num-gpus 2 asks for 2 GPU(s) but 0 are visible; use --replicas 2 for CPU " \
        "workers." in capsys.readouterr().err


def test_a_replica_told_to_writes_its_traceback_to_its_file_and_prints_one_line(
        tmp_path, monkeypatch, capsys) -> None:
    from towerflow.cli.train import _traceback_to_file
    from towerflow.cluster.launcher import TRACEBACK_FILE_ENV

    log = tmp_path / "replica-1.log"
    monkeypatch.setenv(TRACEBACK_FILE_ENV, str(log))
    with pytest.raises(SystemExit) as ended, _traceback_to_file():
        raise RuntimeError("Gloo connectFullMesh failed\n  a long C++ trace")
    assert ended.value.code == 1
    assert capsys.readouterr().err == (f"stopped by RuntimeError: Gloo connectFullMesh failed "
                                       f"(traceback in {log})\n")
    assert "Traceback (most recent call last)" in log.read_text()
    assert "a long C++ trace" in log.read_text()
