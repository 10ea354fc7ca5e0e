"""Article 003's program: 1 ps + 2 workers started by ``towerflow launch``, real processes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distributed_linear_regression.py"
FINISHED = re.compile(
    r"\[worker:(\d)\] finished: (\d+) local steps, global step (\d+), W = ([-\d.]+), b = ([-\d.]+)")
STARTED = re.compile(r"\[worker:(\d)\] sess ok; starting at global step (\d+)")


def launch(python: str, env: dict[str, str], logdir: Path, steps: int) -> str:
    command = [python, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--grace", "5",
               "--", python, str(EXAMPLE), "--logdir", str(logdir), "--steps", str(steps),
               "--noise", "0"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_article_003_trains_async_saves_and_resumes(tmp_path, python, subprocess_env) -> None:
    # long enough that the second worker, which waits for the chief to initialise the ps,
    # joins while the chief is still training (a run of ~2 s at this machine's step rate)
    out = launch(python, subprocess_env, tmp_path, 4000)
    finished = {int(m[0]): m for m in FINISHED.findall(out)}
    assert set(finished) == {0, 1}, out
    for _, local, final, weight, bias in finished.values():
        assert abs(float(weight) - 2.0) < 1e-2 and abs(float(bias) - 1.0) < 1e-2
        assert int(local) < int(final)  # async: the steps a worker saw were not consecutive
    assert (tmp_path / "latest").read_text().startswith("ckpt-")
    assert len(list(tmp_path.glob("ckpt-*"))) == 1  # max_to_keep=1
    assert list(tmp_path.glob("events.out.tfevents.*"))

    # started again, the chief restores the checkpoint with no user code
    saved = int((tmp_path / "latest").read_text().strip().split("-")[1])
    out = launch(python, subprocess_env, tmp_path, saved + 100)
    started = {int(w): int(s) for w, s in STARTED.findall(out)}
    assert started[0] == saved, out
    local = sum(int(m[1]) for m in FINISHED.findall(out))
    assert max(int(m[2]) for m in FINISHED.findall(out)) >= saved + 100
    assert local < saved  # it went on from the checkpoint rather than from step 0
