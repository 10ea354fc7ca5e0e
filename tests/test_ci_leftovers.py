"""CI's end-of-run check: a process the run started and left running is found, named and ended."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "leftover-processes.sh"

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


def _check(mark: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TOWERFLOW_RUN_MARK"}
    env["TOWERFLOW_LEFTOVER_GRACE_S"] = "1"
    return subprocess.run(
        ["bash", str(SCRIPT), mark, str(os.getpid()), *extra],
        env=env, capture_output=True, text=True, timeout=60,
    )


def test_a_run_that_left_nothing_passes():
    result = _check(f"test-{uuid.uuid4().hex}")
    assert result.returncode == 0, result.stderr


def test_a_detached_process_of_the_run_is_named_and_killed():
    mark = f"test-{uuid.uuid4().hex}"
    env = dict(os.environ, TOWERFLOW_RUN_MARK=mark)
    # A daemon-like child: its own session, still holding the run's marker.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)"],
        env=env, start_new_session=True,
    )
    try:
        found = _check(mark)
        assert found.returncode == 1
        assert str(child.pid) in found.stderr and "time.sleep(300)" in found.stderr
        assert child.poll() is None  # without --kill it is only named

        killed = _check(mark, "--kill")
        assert killed.returncode == 1
        assert child.wait(timeout=10) == -9
        assert _check(mark).returncode == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
