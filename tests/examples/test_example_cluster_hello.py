"""examples/cluster_hello.py: article 000 §4, the first task waits for the second."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster_hello.py"


def _start(python: str, task: int, ports: str, env: dict[str, str],
           cwd: Path) -> tuple[subprocess.Popen, queue.Queue]:
    process = subprocess.Popen(
        [python, str(EXAMPLE), "--task", str(task), "--ports", ports, "--timeout", "60"],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return process, lines


def _read_until(lines: queue.Queue, needle: str, timeout: float = 60.0) -> str:
    text = ""
    deadline = time.monotonic() + timeout
    while needle not in text:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if line is None:
            raise AssertionError(f"process ended before printing {needle!r}:\n{text}")
        text += line
    return text


def _drain(lines: queue.Queue, timeout: float = 30.0) -> str:
    text = ""
    while (line := lines.get(timeout=timeout)) is not None:
        text += line
    return text


@pytest.mark.slow
def test_first_task_waits_for_the_second_then_both_compute_and_exit(
    python, free_ports, subprocess_env, tmp_path
):
    a, b = free_ports(2)
    work, temp = tmp_path / "work", tmp_path / "temp"
    work.mkdir()
    temp.mkdir()
    env = {**subprocess_env, "TMPDIR": str(temp)}  # nothing may be written here
    env.pop("TOWERFLOW_SECRET", None)
    env.pop("TOWERFLOW_SECRET_FILE", None)
    first, first_lines = _start(python, 0, f"{a},{b}", env, work)
    second = None
    try:
        waiting = f"waiting for /job:local/replica:0/task:1 at localhost:{b} (failed to connect; retrying)"
        early = _read_until(first_lines, waiting)
        assert "Hello, this is the server1!" not in early
        second, second_lines = _start(python, 1, f"{a},{b}", env, work)
        assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0
        out0, out1 = early + _drain(first_lines), _drain(second_lines)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    assert "/job:local/replica:0/task:0: sent x=[0.0, 1.0, 2.0, 3.0] to /job:local/replica:0/task:1, " \
           "got 2x+1=[1.0, 3.0, 5.0, 7.0] computed by task 1" in out0
    assert "got 2x+1=[21.0, 23.0, 25.0, 27.0] computed by task 0" in out1
    assert "Hello, this is the server1!" in out0 and "Hello, this is the server2!" in out1
    # the shared secret lives in the tasks' working directory, not in the temp directory
    assert [p.name for p in work.iterdir()] == ["cluster_hello.secret"]
    assert oct((work / "cluster_hello.secret").stat().st_mode & 0o777) == "0o600"
    assert list(temp.iterdir()) == []


@pytest.mark.slow
def test_runs_as_every_task_of_towerflow_launch(python, subprocess_env):
    result = subprocess.run(
        [python, "-m", "towerflow", "launch", "--ps", "0", "--workers", "2", "--", python, str(EXAMPLE)],
        env=subprocess_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[worker:0] /job:worker/replica:0/task:0: sent x=" in result.stdout
    assert "[worker:1] Hello, this is the server2!" in result.stdout
