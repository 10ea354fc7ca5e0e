"""Children started through guarded_argv die with their parent, even on SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from towerflow._children import guarded_argv, signal_group, spawn_group, stop_groups

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

_PARENT = """
import subprocess, sys, time
from towerflow._children import guarded_argv, signal_group, spawn_group, stop_groups
child = subprocess.Popen(guarded_argv([sys.executable, "-c", "import time; time.sleep(60)"]))
print(child.pid, flush=True)
child.wait()
"""


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_child_gets_sigterm_when_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert psutil.pid_exists(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_gone(child_pid, timeout=10), f"child {child_pid} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if child_pid is not None and psutil.pid_exists(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_command_runs_in_the_same_process_with_its_arguments() -> None:
    out = subprocess.run(
        guarded_argv([sys.executable, "-c", "import os, sys; print(os.getpid(), sys.argv[1:])",
                      "a", "b c"]),
        capture_output=True, text=True, timeout=30, check=True,
    )
    assert out.stdout.split(" ", 1)[1].strip() == "['a', 'b c']"


def test_stop_groups_kills_a_suspended_leader_and_its_grandchild_that_ignores_sigterm() -> None:
    script = ("import signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "child = subprocess.Popen([sys.executable, '-c', "
              "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(60)\n")
    leader = spawn_group([sys.executable, "-c", script], dict(os.environ), subprocess.PIPE)
    grandchild = None
    try:
        assert leader.stdout is not None
        grandchild = int(leader.stdout.readline())
        assert signal_group(leader, signal.SIGSTOP)
        stop_groups([leader], grace=0.5)
        assert leader.returncode == -signal.SIGKILL
        assert _wait_gone(grandchild, timeout=10), f"grandchild {grandchild} outlived its group"
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait(10)
        if leader.stdout is not None:
            leader.stdout.close()
