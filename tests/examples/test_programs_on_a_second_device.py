"""The articles' programs and the click example with the model's compute on a device other
than the CPU their batches come from, as on a workstation with a GPU.

PyTorch's ``lazy`` device stands in for the GPU on a machine without one
(``TOWERFLOW_DEVICE=lazy``; tensors on it and on the CPU do not mix, so a batch
left on the CPU fails at the first op, as on a GPU). The programs run as
written, tasks started by hand and by ``towerflow launch``. (The click example in one
process is not among them: the lazy device has no sparse gradients, which its
``nn.Embedding(sparse=True)`` tables take there; on 2 ps + 2 workers the tables are on the
ps tasks.)
"""

from __future__ import annotations

import re
import subprocess

import pytest
from test_article_003 import _start, run_to_the_end
from test_example_click_model import EXAMPLE as CLICK_EXAMPLE
from test_example_click_model import FINISHED as CLICK_FINISHED
from test_example_linear_regression import EXAMPLE as LINEAR_EXAMPLE
from test_example_linear_regression import FINISHED as LINEAR_FINISHED

pytestmark = pytest.mark.slow


#: what a process run with the second device's site says at its exit (its ops there)
OPS = re.compile(r"^(\[worker:\d\] )?second device: (\d+) ops$", re.M)


def computed_there(out: str) -> dict[str, int]:
    """Each worker's count of operations run on the second device, by its launch prefix."""
    return {prefix.strip(): int(ops) for prefix, ops in OPS.findall(out)
            if prefix.startswith("[worker")}


def _run(command: list[str], env: dict[str, str], cwd, timeout: float) -> str:
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def test_article_003_tasks_started_by_hand_feed_cpu_batches_to_a_model_elsewhere(
        tmp_path, python, second_device_env, free_ports) -> None:
    tasks = _start(python, second_device_env, free_ports(3), str(tmp_path / "super"),
                   str(tmp_path / "linear"), 150, "argument")
    run_to_the_end(tasks, 120)
    for worker in tasks[1:]:
        assert worker.wait_for("sess ok", 1).split()[3] == "ParameterServer"
        assert worker.wait_for("finished", 1)
        assert int(worker.wait_for("second device:", 1).split()[2]) > 0, "".join(worker.lines)


def _launched(python: str, env: dict[str, str], cwd, ps: int, program: list[str],
              finished) -> None:
    """``program`` on ``ps`` ps tasks and 2 workers under ``towerflow launch``: both workers
    finished (``finished``: their final line) and computed on the second device."""
    out = _run([python, "-m", "towerflow", "launch", "--ps", str(ps), "--workers", "2",
                "--grace", "10", "--", python, *program], env, cwd, 240)
    assert {int(m[0]) for m in finished.findall(out)} == {0, 1}, out[-3000:]
    ops = computed_there(out)
    assert set(ops) == {"[worker:0]", "[worker:1]"} and min(ops.values()) > 0, out[-3000:]


def test_article_003_under_launch_feeds_cpu_batches_to_a_model_elsewhere(
        tmp_path, python, second_device_env) -> None:
    _launched(python, second_device_env, tmp_path, 1,
              [str(LINEAR_EXAMPLE), "--steps", "150", "--noise", "0"], LINEAR_FINISHED)


def test_the_click_example_on_two_ps_and_two_workers_feeds_its_model_elsewhere(
        tmp_path, python, second_device_env) -> None:
    _launched(python, second_device_env, tmp_path, 2,
              [str(CLICK_EXAMPLE), "--logdir", "run", "--steps", "60"], CLICK_FINISHED)
