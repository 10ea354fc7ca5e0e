"""Article 003's program: 1 ps + 2 workers started by ``towerflow launch``, real processes."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "distributed_linear_regression.py"
FINISHED = re.compile(
    r"\[worker:(\d)\] finished: (\d+) local steps, global step (\d+), W = ([-\d.]+), b = ([-\d.]+)")
STARTED = re.compile(r"\[worker:(\d)\] sess ok; starting at global step (\d+)")


def launch(python: str, env: dict[str, str], cwd: Path, steps: int) -> str:
    """One run of the example under ``towerflow launch``, in its default logdir under ``cwd``."""
    command = [python, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--grace", "10",
               "--", python, str(EXAMPLE), "--steps", str(steps), "--noise", "0"]
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_article_003_trains_async_saves_reruns_resumes_and_stops_on_ctrl_c(
        tmp_path, python, subprocess_env) -> None:
    import signal
    import threading

    from towerflow.checkpoint import CheckpointManager

    logdir = tmp_path / "log" / "linear_regression"  # the default: under the current directory
    # long enough that the second worker, which waits for the chief to initialise the ps,
    # joins while the chief is still training (a run of ~2 s at this machine's step rate)
    out = launch(python, subprocess_env, tmp_path, 4000)
    finished = {int(m[0]): m for m in FINISHED.findall(out)}
    assert set(finished) == {0, 1}, out
    for _, local, final, weight, bias in finished.values():
        assert abs(float(weight) - 2.0) < 1e-2 and abs(float(bias) - 1.0) < 1e-2
        assert int(local) < int(final)  # async: the steps a worker saw were not consecutive
    assert (logdir / "latest").read_text().startswith("ckpt-")
    assert len(list(logdir.glob("ckpt-*"))) == 1  # max_to_keep=1
    assert list(logdir.glob("events.out.tfevents.*"))
    saved = CheckpointManager(logdir).restore().step
    assert saved >= 4000

    # the same command again has nothing to do, and says so
    out = launch(python, subprocess_env, tmp_path, 4000)
    assert f"[worker:0] log/linear_regression already holds global step {saved} >= --steps " \
        "4000: nothing to train" in out
    assert "finished: 0 local steps" not in out

    # started again with more steps, the chief restores the checkpoint with no user code
    out = launch(python, subprocess_env, tmp_path, saved + 100)
    started = {int(w): int(s) for w, s in STARTED.findall(out)}
    assert started[0] == saved, out
    local = sum(int(m[1]) for m in FINISHED.findall(out))
    assert max(int(m[2]) for m in FINISHED.findall(out)) >= saved + 100
    assert local < saved  # it went on from the checkpoint rather than from step 0
    saved = CheckpointManager(logdir).restore().step

    base = [python, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--grace", "10",
            "--", python, str(EXAMPLE), "--noise", "0"]

    launcher = subprocess.Popen([*base, "--steps", str(10**9)], env=subprocess_env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    lines: list[str] = []
    training = threading.Event()

    trained: set[str] = set()

    def read() -> None:
        for line in launcher.stdout:
            lines.append(line)
            if line.startswith(("[worker:0] step ", "[worker:1] step ")):
                trained.add(line[:10])
                if len(trained) == 2:  # both train (a task still starting has no handler yet)
                    training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert training.wait(120), "".join(lines)
        launcher.send_signal(signal.SIGINT)  # a clean stop: every task ends its step, exits 0
        assert launcher.wait(timeout=120) == 0
        reader.join(10)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(30)
    out = "".join(lines)
    assert "Traceback" not in out and "UnavailableError" not in out, out
    last = max(int(line.split()[2].rstrip(",")) for line in lines
               if line.startswith("[worker:0] step "))
    assert CheckpointManager(logdir).restore().step >= last > saved
