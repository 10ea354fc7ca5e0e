"""Each process's share of the cores: the rule, ``towerflow launch``'s children, a task
started by hand, and the user's own ``OMP_NUM_THREADS`` kept. Real processes on 127.0.0.1.

Every test states the thread variables its processes see (:func:`_env`), whatever the
caller's environment holds (a GPU image may set ``OMP_NUM_THREADS=6``)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
from pathlib import Path

import pytest
import torch

from towerflow.cluster import ClusterSpec, TaskInfo
from towerflow.cluster.threads import (
    OMP_ENV,
    apply_thread_share,
    available_cores,
    processes_on_host,
    share_line,
    thread_share,
)
from towerflow.errors import InvalidArgumentError

# Each child of `towerflow launch` reports its threads. The launcher stops the ps task once
# the workers have ended, so a worker ends only after the ps task has reported (its mark in
# the directory argv[1]); else a slow ps task is stopped before it prints.
REPORT = r"""
import json, os, sys, time, torch
task = json.loads(os.environ["TF_CONFIG"])["task"]
print("threads " + json.dumps([torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")]),
      flush=True)
open(os.path.join(sys.argv[1], f"{task['type']}-{task['index']}"), "w").close()
deadline = time.monotonic() + 60
while task["type"] == "worker" and time.monotonic() < deadline \
        and not os.path.exists(os.path.join(sys.argv[1], "ps-0")):
    time.sleep(0.05)
"""

#: what sets PyTorch's intra-op threads at start-up (MKL_NUM_THREADS wins over OMP_NUM_THREADS)
THREAD_VARS = (OMP_ENV, "MKL_NUM_THREADS")


def _env(base: dict[str, str], **thread_vars: str) -> dict[str, str]:
    """``base`` without any thread variable of the caller's, then ``thread_vars`` set."""
    env = {name: value for name, value in base.items() if name not in THREAD_VARS}
    env.update(thread_vars)
    return env


@pytest.mark.parametrize(("cores", "processes", "expected"), [
    (16, 4, 4), (16, 3, 5), (2, 4, 1), (2, 2, 1), (8, 1, 8), (1, 1, 1),
])
def test_each_process_gets_its_share_of_the_cores_and_at_least_one(cores, processes, expected):
    assert thread_share(cores, processes, {}) == (expected, "share")


def test_the_users_omp_num_threads_is_kept_whatever_the_share():
    assert thread_share(2, 4, {OMP_ENV: "6"}) == (6, OMP_ENV)
    assert thread_share(64, 1, {OMP_ENV: " 1 "}) == (1, OMP_ENV)
    assert thread_share(8, 2, {OMP_ENV: ""}) == (4, "share")  # empty: not set


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_an_omp_num_threads_that_is_not_a_positive_integer_is_refused(value):
    with pytest.raises(InvalidArgumentError,
                       match=rf"OMP_NUM_THREADS='{re.escape(value)}' is not a positive integer; "
                       "set it to the threads each process should run"):
        thread_share(8, 2, {OMP_ENV: value})


def test_no_cores_or_no_processes_is_refused():
    with pytest.raises(InvalidArgumentError, match=r"cannot share 4 core\(s\) among 0 process"):
        thread_share(4, 0, {})


def test_the_line_says_the_count_the_cores_and_the_way_to_choose():
    assert share_line("towerflow launch", 4, 2, 1, "share") == (
        "towerflow launch: 4 processes on 2 cores: 1 thread each (OMP_NUM_THREADS=1); "
        "set OMP_NUM_THREADS to choose")
    assert share_line("towerflow launch", 3, 16, 6, OMP_ENV) == (
        "towerflow launch: 3 processes on 16 cores: 6 threads each (OMP_NUM_THREADS=6 as set)")


def test_processes_on_this_host_are_the_loopback_tasks_and_this_tasks_host():
    spec = ClusterSpec({"ps": ["127.0.0.1:1", "node-b:2"],
                        "worker": ["localhost:3", "node-b:4", "node-c:5"]})
    assert processes_on_host(spec) == 2
    assert processes_on_host(spec, TaskInfo("ps", 1)) == 4  # node-b is this task's host
    assert processes_on_host(ClusterSpec({"worker": ["node-c:5"]})) == 1  # never below 1
    assert processes_on_host(None) == 1


def test_a_task_applies_its_share_to_torch_and_the_environment(caplog):
    spec = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
    env: dict[str, str] = {}
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="towerflow.cluster"):
            threads = apply_thread_share("towerflow train", spec, TaskInfo("ps", 0), env)
        assert threads == max(1, available_cores() // 3) == torch.get_num_threads()
        assert env == {OMP_ENV: str(threads)}
        assert f"towerflow train: 3 processes on {available_cores()} core" in caplog.text
    finally:
        torch.set_num_threads(before)


def _launch(env: dict[str, str], python: str, marks: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--grace", "5",
         "--", python, "-c", REPORT, str(marks)],
        env=env, capture_output=True, text=True, timeout=120)


def _children(stdout: str) -> dict[str, list]:
    found = re.findall(r"^\[(\w+:\d)\] threads (.+)$", stdout, re.MULTILINE)
    return {name: json.loads(report) for name, report in found}


def test_launch_gives_every_child_its_share_and_says_so(subprocess_env, python, tmp_path):
    proc = _launch(_env(subprocess_env), python, tmp_path)
    share = max(1, available_cores() // 3)
    assert proc.returncode == 0, proc.stderr
    assert _children(proc.stdout) == {name: [share, str(share)]
                                      for name in ("ps:0", "worker:0", "worker:1")}
    each = f"{share} thread{'s' if share != 1 else ''} each"
    assert (f"towerflow launch: 3 processes on {available_cores()} core"
            in proc.stderr), proc.stderr
    assert f"{each} (OMP_NUM_THREADS={share}); set OMP_NUM_THREADS to choose" in proc.stderr


def test_launch_keeps_the_users_omp_num_threads(subprocess_env, python, tmp_path):
    cores, share = available_cores(), max(1, available_cores() // 3)
    if share == cores:
        pytest.skip("one core: no count other than the share to set")
    mine = share + 1  # not the share (PyTorch runs at most one thread per core)
    proc = _launch(_env(subprocess_env, **{OMP_ENV: str(mine)}), python, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _children(proc.stdout) == {name: [mine, str(mine)]
                                      for name in ("ps:0", "worker:0", "worker:1")}
    assert f"{mine} threads each (OMP_NUM_THREADS={mine} as set)" in proc.stderr


HAND_STARTED = r"""
import json, os, sys, torch
from towerflow.cli import main
status = main(sys.argv[1:])
print("threads " + json.dumps([status, torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]]))
"""


def test_a_task_started_by_hand_applies_its_share_from_the_cluster_spec(subprocess_env, python,
                                                                      tmp_path):
    """An evaluator started with ``towerflow train`` under TF_CONFIG: 3 tasks on 127.0.0.1."""
    env = _env(subprocess_env, TF_CONFIG=json.dumps({
        "cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]},
        "task": {"type": "evaluator", "index": 0}}))
    proc = subprocess.run([python, "-c", HAND_STARTED, "train", "digits", "--train-dir",
                           str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=120)
    share = max(1, available_cores() // 3)
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r"^threads (.+)$", proc.stdout, re.MULTILINE) == [
        json.dumps([0, share, str(share)])], proc.stdout
    assert f"towerflow train: 3 processes on {available_cores()} core" in proc.stderr
    assert "set OMP_NUM_THREADS to choose" in proc.stderr


def test_replicas_keep_the_users_omp_num_threads_and_share_otherwise():
    from towerflow.cluster.launcher import replica_env

    assert replica_env(0, 2, 29500, base={OMP_ENV: "5"})[OMP_ENV] == "5"
    assert replica_env(1, 2, 29500, base={})[OMP_ENV] == str(max(1, available_cores() // 2))
    with pytest.raises(InvalidArgumentError, match="OMP_NUM_THREADS='x'"):
        replica_env(0, 2, 29500, base={OMP_ENV: "x"})
