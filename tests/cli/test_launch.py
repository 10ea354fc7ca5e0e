"""``towerflow launch``: TF_CONFIG and secret for each child, prefixed output, exit status,
and no process left behind after Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from towerflow.cluster.launcher import launch_cluster
from towerflow.errors import InvalidArgumentError

CHILD = r'''
import hashlib, json, os, subprocess, sys, threading
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]
path = os.environ["TOWERFLOW_SECRET_FILE"]
report = {
    "task": task, "cluster": config["cluster"], "pid": os.getpid(), "secret_file": path,
    "mode": oct(os.stat(path).st_mode & 0o777),
    "secret": hashlib.sha256(open(path, "rb").read()).hexdigest(),
    "inherited_secret": "TOWERFLOW_SECRET" in os.environ,
}
if sys.argv[1] == "block":
    grandchild = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
    report["grandchild"] = grandchild.pid
print(json.dumps(report), flush=True)
print("second line", flush=True)
marks = os.environ.get("CHILD_MARKS")
if marks and task["type"] == "ps":
    open(os.path.join(marks, f"ps-{task['index']}"), "w").close()
if sys.argv[1] == "exit" and task["type"] in ("worker", "chief"):
    import time
    deadline = time.monotonic() + 60  # the ps tasks report before the launch ends
    while marks and len(os.listdir(marks)) < len(config["cluster"].get("ps", ())):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sys.exit(int(sys.argv[2]) * task["index"])
threading.Event().wait()
'''


@pytest.fixture
def child(tmp_path: Path) -> Path:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return path


def _reports(text: str) -> dict[str, dict]:
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition("] ")
        if rest.startswith("{"):
            out[name.lstrip("[")] = json.loads(rest)
    return out


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_children_get_tf_config_and_one_private_secret_and_the_worst_status(child, subprocess_env, python,
                                                                          tmp_path):
    out = io.StringIO()
    (tmp_path / "marks").mkdir()
    subprocess_env["CHILD_MARKS"] = str(tmp_path / "marks")
    subprocess_env["TOWERFLOW_SECRET"] = "must-not-leak-into-children"
    status = launch_cluster(
        [python, str(child), "exit", "3"], num_ps=1, num_workers=2, chief=True,
        env=subprocess_env, output=out, grace=5.0,
    )  # fmt: skip
    assert status == 3  # worker:1 exits 3 * 1, the others 0
    reports = _reports(out.getvalue())
    assert sorted(reports) == ["chief:0", "ps:0", "worker:0", "worker:1"]
    for name, report in reports.items():
        assert f"{report['task']['type']}:{report['task']['index']}" == name
        assert report["mode"] == "0o600" and not report["inherited_secret"]
        assert f"[{name}] second line" in out.getvalue()
    assert len({r["secret"] for r in reports.values()}) == 1
    cluster = reports["ps:0"]["cluster"]
    assert [len(cluster[j]) for j in ("chief", "ps", "worker")] == [1, 1, 2]
    assert reports["ps:0"]["secret_file"].startswith("/proc/self/fd/")  # in memory, not on disk
    assert not _alive(reports["ps:0"]["pid"])


def test_status_is_zero_when_every_worker_succeeds(child, subprocess_env, python, tmp_path):
    out = io.StringIO()
    (tmp_path / "marks").mkdir()
    subprocess_env["CHILD_MARKS"] = str(tmp_path / "marks")
    status = launch_cluster([python, str(child), "exit", "0"], num_ps=2, num_workers=1,
                            env=subprocess_env, output=out, grace=5.0)  # fmt: skip
    assert status == 0
    assert sorted(_reports(out.getvalue())) == ["ps:0", "ps:1", "worker:0"]


def test_launch_refuses_an_empty_cluster_or_command(python):
    with pytest.raises(InvalidArgumentError, match="give at least one worker"):
        launch_cluster([python, "-c", "pass"], num_ps=1, num_workers=0)
    with pytest.raises(InvalidArgumentError, match="launch needs a command"):
        launch_cluster([], num_ps=1, num_workers=1)
    with pytest.raises(InvalidArgumentError, match="base_port=65535 leaves no room for 2 ports"):
        launch_cluster([python, "-c", "pass"], num_ps=1, num_workers=1, base_port=65535)


def test_ctrl_c_stops_every_child_and_grandchild(child, subprocess_env, python):
    launcher = subprocess.Popen(
        [python, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--grace", "5",
         "--", python, str(child), "block"],
        env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in launcher.stdout], daemon=True)
    reader.start()
    text = ""
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(_reports(text)) < 3:
            text += lines.get(timeout=max(0.1, deadline - time.monotonic()))
        reports = _reports(text)
        pids = [r[k] for r in reports.values() for k in ("pid", "grandchild")]
        assert all(_alive(pid) for pid in pids)
        launcher.send_signal(signal.SIGINT)
        # the workers' status: these children do not handle the SIGTERM passed on to them
        assert launcher.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        assert [pid for pid in pids if _alive(pid)] == []
    finally:
        for pid in [launcher.pid, *pids]:
            if not _alive(pid):
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.wait(timeout=30)


def test_launch_command_line_parses_the_command_after_double_dash():
    from towerflow.cli import build_parser

    args = build_parser().parse_args(["launch", "--ps", "2", "--workers", "3", "--chief", "--",
                                      sys.executable, "train.py", "--steps", "5"])  # fmt: skip
    assert (args.ps, args.workers, args.chief) == (2, 3, True)
    assert args.command[-4:] == [sys.executable, "train.py", "--steps", "5"]


def _start_launcher(python: str, env: dict[str, str], *command: str) -> subprocess.Popen:
    return subprocess.Popen(
        [python, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--grace", "5",
         "--", *command],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _read_reports(launcher: subprocess.Popen, count: int) -> dict[str, dict]:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in launcher.stdout],
                     daemon=True).start()
    text, deadline = "", time.monotonic() + 60
    while len(_reports(text)) < count:
        text += lines.get(timeout=max(0.1, deadline - time.monotonic()))
    return _reports(text)


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    return [pid for pid in pids if _alive(pid)]


def test_no_copy_of_the_secret_outlives_a_sigkilled_launcher(child, subprocess_env, python,
                                                             tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    subprocess_env["TMPDIR"] = str(temp)
    launcher = _start_launcher(python, subprocess_env, python, str(child), "block")
    pids: list[int] = []
    try:
        reports = _read_reports(launcher, 3)
        pids = [r[k] for r in reports.values() for k in ("pid", "grandchild")]
        secret_digest = reports["ps:0"]["secret"]
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        assert _wait_gone([r["pid"] for r in reports.values()], 20) == []
        import hashlib

        left = [p for p in temp.rglob("*") if p.is_file()
                and hashlib.sha256(p.read_bytes()).hexdigest() == secret_digest]
        assert left == [] and list(temp.iterdir()) == []
        assert reports["ps:0"]["secret_file"].startswith("/proc/self/fd/")
    finally:
        for pid in [launcher.pid, *pids]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=30)


def test_a_command_that_does_not_exist_is_named_once(subprocess_env, python):
    proc = subprocess.run([python, "-m", "towerflow", "launch", "--", "nosuchprog", "--flag"],
                          env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert re.fullmatch(r"towerflow launch: error: command 'nosuchprog' was not found \(not on "
                        r"PATH, or not an executable file\); check its spelling or give its "
                        r"path, e.g. -- python train.py.\n", proc.stderr), proc.stderr


ORDERED = r"""
import json, os, signal, sys, threading, time
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]["type"]
marks = sys.argv[1]
if task == "ps":
    open(os.path.join(marks, "ps.pid"), "w").write(str(os.getpid()))
def on_term(signum, frame):
    if task == "chief":  # the final save talks to the ps: it must still be there
        ps = int(open(os.path.join(marks, "ps.pid")).read())
        time.sleep(0.5)  # a save that takes a while
        try:
            os.kill(ps, 0)
            alive = "alive"
        except ProcessLookupError:
            alive = "gone"
        open(os.path.join(marks, "chief"), "w").write(alive)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
threading.Event().wait()
"""


def test_ctrl_c_stops_the_workers_and_chief_before_the_ps(subprocess_env, python, tmp_path):
    script = tmp_path / "ordered.py"
    script.write_text(ORDERED)
    launcher = subprocess.Popen(
        [python, "-m", "towerflow", "launch", "--ps", "1", "--workers", "1", "--chief",
         "--grace", "10", "--", python, str(script), str(tmp_path)],
        env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)  # fmt: skip
    try:
        seen, deadline = "", time.monotonic() + 60
        while seen.count("ready") < 3 or not (tmp_path / "ps.pid").exists():
            seen += launcher.stdout.readline()
            assert time.monotonic() < deadline, seen
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 0  # the chief and the worker stopped cleanly
        assert (tmp_path / "chief").read_text() == "alive"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)


CHIEF_FAILS = r'''
import json, os, sys, threading
task = json.loads(os.environ["TF_CONFIG"])["task"]
if task == {"type": "worker", "index": 0}:
    sys.exit(7)  # the chief could not initialise
threading.Event().wait()  # the others wait for it
'''


def test_the_chief_failing_ends_the_launch_with_its_status(subprocess_env, python,
                                                           tmp_path) -> None:
    script = tmp_path / "chief_fails.py"
    script.write_text(CHIEF_FAILS)
    started = time.monotonic()
    status = launch_cluster([python, str(script)], num_ps=1, num_workers=2,
                            env=subprocess_env, output=io.StringIO(), grace=5.0)
    assert status == 7
    assert time.monotonic() - started < 30  # not the others' init timeout


RESTARTED = r'''
import json, os, sys, threading
task = json.loads(os.environ["TF_CONFIG"])["task"]
marks = sys.argv[1]
starts = len([m for m in os.listdir(marks) if m.startswith(f"{task['type']}-{task['index']}.")])
open(os.path.join(marks, f"{task['type']}-{task['index']}.{starts}"), "w").close()
if task["type"] == "ps":
    threading.Event().wait()
import time
deadline = time.monotonic() + 60  # the ps task reports before any worker ends
while not os.path.exists(os.path.join(marks, "ps-0.0")):
    assert time.monotonic() < deadline
    time.sleep(0.02)
if task["index"] == 1 and starts < int(sys.argv[2]):
    while not os.path.exists(os.path.join(marks, f"worker-0.{starts}")):  # both ran this start
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sys.exit(3)  # worker 1 fails on its first starts
'''


@pytest.mark.parametrize(("failures", "max_restarts", "status", "worker_starts"),
                         [(1, 1, 0, 2), (3, 2, 3, 3), (1, 0, 3, 1)])
def test_max_restarts_starts_the_workers_again_and_keeps_the_ps_tasks(
        subprocess_env, python, tmp_path, failures, max_restarts, status, worker_starts) -> None:
    script, marks = tmp_path / "restarted.py", tmp_path / "marks"
    script.write_text(RESTARTED)
    marks.mkdir()
    out = io.StringIO()
    assert launch_cluster([python, str(script), str(marks), str(failures)], num_ps=1,
                          num_workers=2, env=subprocess_env, output=out, grace=5.0,
                          max_restarts=max_restarts) == status
    started = sorted(m.name for m in marks.iterdir())
    assert [m for m in started if m.startswith("ps-0.")] == ["ps-0.0"]  # never restarted
    for worker in ("worker-0", "worker-1"):
        assert len([m for m in started if m.startswith(worker + ".")]) == worker_starts


def test_max_restarts_below_zero_is_refused(python) -> None:
    with pytest.raises(InvalidArgumentError, match=r"max_restarts=-1 must be 0"):
        launch_cluster([python, "-c", "pass"], num_ps=1, num_workers=1, max_restarts=-1)
