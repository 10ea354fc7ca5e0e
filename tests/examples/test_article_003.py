"""Article 003 written the TensorFlow way, tasks started by hand on 127.0.0.1.

``sv.managed_session(server.target)``, the setter, a manual save to a second
directory, a kill and a restart: both workers train through the ps (their
global steps interleave), the weights approach the true ones, and the rerun
resumes from the last step in ``logdir``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from towerflow.checkpoint import CheckpointManager
from towerflow.models.linear import TRUE_BIAS, TRUE_WEIGHT

PROGRAM = Path(__file__).parents[1] / "support" / "programs" / "article_003.py"


def _setter_form() -> str:
    """``scope`` when ``towerflow.device(setter)`` is a valid scope, else ``argument``."""
    import towerflow
    from towerflow.errors import InvalidArgumentError

    spec = towerflow.ClusterSpec({"ps": ["localhost:1"], "worker": ["localhost:2"]})
    setter = towerflow.replica_device_setter(worker_device="/job:worker/task:0", cluster=spec)
    try:
        with towerflow.device(setter):
            pass
    except InvalidArgumentError:
        return "argument"
    return "scope"


class _Task:
    def __init__(self, python: str, env: dict[str, str], *args: str) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen([python, str(PROGRAM), *args], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, prefix: str, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = [line for line in self.lines if line.startswith(prefix)]
            if found:
                return found[-1]
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line {prefix!r}: {''.join(self.lines)}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.reader.join(10)


def run_to_the_end(tasks: list[_Task], seconds: float) -> None:
    """Wait for the workers (``tasks[1:]``) to exit 0, then stop every task."""
    try:
        for worker in tasks[1:]:
            assert worker.proc.wait(seconds) == 0, "".join(worker.lines)
            worker.reader.join(10)
    finally:
        for task in tasks:
            task.kill()


def _start(python, env, ports, logdir, manual, steps, how) -> list[_Task]:
    common = (logdir, manual, str(steps), how)
    port_list = ",".join(map(str, ports))
    return [_Task(python, env, port_list, "ps", "0", *common)] + [
        _Task(python, env, port_list, "worker", str(i), *common) for i in range(2)]


@pytest.mark.slow
def test_article_003_with_server_target_saves_resumes_and_interleaves(
        tmp_path, python, subprocess_env, free_ports) -> None:
    how = _setter_form()
    logdir, manual = str(tmp_path / "super"), str(tmp_path / "linear")
    tasks = _start(python, subprocess_env, free_ports(3), logdir, manual, 3000, how)
    run_to_the_end(tasks, 180)
    for worker in tasks[1:]:
        assert worker.wait_for("sess ok", 1).split()[3] == "ParameterServer"
    seen = [[int(s) for s in w.wait_for("seen ", 1).split()[1].split(",")] for w in tasks[1:]]
    for mine, other in (seen, seen[::-1]):
        assert len(mine) < mine[-1] - mine[0] + 1  # not consecutive: the other worker pushed
        assert any(mine[0] < step < mine[-1] for step in other)  # the steps interleave
    weight, bias = (float(v.split("=")[1]) for v in tasks[1].wait_for("finished", 1).split()[1:])
    assert abs(weight - TRUE_WEIGHT) < 1e-2 and abs(bias - TRUE_BIAS) < 1e-2
    final = CheckpointManager(logdir).restore().step
    assert final >= 3000 and CheckpointManager(manual).restore().step == final

    # killed half way (SIGKILL), then started again: the rerun resumes from logdir's last step
    tasks = _start(python, subprocess_env, free_ports(3), logdir, manual, 10**9, how)
    try:
        tasks[1].wait_for("step ", 120)
    finally:
        for task in tasks:
            task.kill()
    last = CheckpointManager(logdir).restore().step
    assert last >= final
    tasks = _start(python, subprocess_env, free_ports(3), logdir, manual, last + 100, how)
    try:
        assert int(tasks[1].wait_for("sess ok", 120).split()[2]) == last
        assert tasks[1].proc.wait(180) == 0
    finally:
        for task in tasks:
            task.kill()
    assert CheckpointManager(logdir).restore().step >= last + 100
