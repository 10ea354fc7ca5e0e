"""SIGTERM / SIGINT end a run the way a scheduler expects: a final checkpoint, exit 0, resume.

Each way to train is stopped mid-run as a real process; a second signal, or
the deadline, abandons the final checkpoint and leaves no partial one.
"""

from __future__ import annotations

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

import pytest
import torch

from towerflow.checkpoint import CheckpointManager
from towerflow.checkpoint.chunked import ChunkedGroup
from towerflow.cli import main
from towerflow.data import load_digits
from towerflow.models import DigitsNet, cross_entropy_loss
from towerflow.strategies.single import SingleDevice
from towerflow.training import TrainConfig, Trainer
from towerflow.training.hooks import Hook
from towerflow.training.stopping import FinalCheckpointAbandoned, StopSignals

ROOT = Path(__file__).resolve().parents[2]


class _Run:
    """A command whose output lines are read as they come, stopped by the test."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.text = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.text, re.MULTILINE)
            if found:
                return found
            left = deadline - time.monotonic()
            assert left > 0 and self.proc.poll() is None or not self.lines.empty(), self.text
            try:
                self.text += self.lines.get(timeout=max(0.05, min(left, 1.0)))
            except queue.Empty:
                continue

    def finish(self, timeout: float = 120.0) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        while not self.lines.empty():
            self.text += self.lines.get()
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(10)


def _train(tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "towerflow", "train", "digits", "--train-dir", str(tmp_path),
            "--log-every", "20", "--no-progress", "--summary-every", "0", *extra]


def _stop_mid_run(argv: list[str], env: dict[str, str], started: str,
                  while_running=lambda run: None) -> tuple[int, str]:  # noqa: ANN001
    run = _Run(argv, env)
    try:
        run.wait_for(started)
        while_running(run)
        run.proc.send_signal(signal.SIGTERM)
        return run.finish(), run.text
    finally:
        run.close()


def _stopped_step(text: str) -> int:
    return int(re.search(r"stopped by signal 15 at global step (\d+); its checkpoint",
                         text).group(1))


def _latest_step(train_dir: Path) -> int:
    ckpt = CheckpointManager(train_dir).restore()
    assert ckpt is not None
    return ckpt.step


class _SignalAt(Hook):
    """Sends this process ``sig`` after step ``step``."""

    def __init__(self, step: int, sig: int = signal.SIGTERM) -> None:
        self.step, self.sig = step, sig

    def after_step(self, ctx) -> None:  # noqa: ANN001
        if ctx.step == self.step:
            os.kill(os.getpid(), self.sig)


def _trainer(train_dir: Path, *hooks: Hook) -> Trainer:
    torch.manual_seed(0)
    return Trainer(DigitsNet(), cross_entropy_loss, load_digits("train"),
                   strategy=SingleDevice("/cpu:0"), hooks=hooks,
                   config=TrainConfig(train_dir=train_dir, batch_size=16, max_steps=1000,
                                      log_every=10 ** 6, summary_every=0))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_fit_after_the_step_in_flight_with_a_checkpoint_of_it(tmp_path,
                                                                             sig) -> None:
    before = signal.getsignal(sig)
    with _trainer(tmp_path, _SignalAt(7, sig)) as trainer:
        result = trainer.fit()
    assert result.step == 7 and _latest_step(tmp_path) == 7
    assert signal.getsignal(sig) == before
    with _trainer(tmp_path) as trainer:
        assert trainer.fit(max_steps=9).restored_from == 7


@pytest.mark.slow
def test_sigterm_to_one_process_saves_the_step_reached_and_a_rerun_resumes_from_it(
        tmp_path, subprocess_env) -> None:
    code, text = _stop_mid_run(_train(tmp_path, "--max-steps", "100000"), subprocess_env,
                               r"step 20, loss")
    assert code == 0, text
    stopped = _stopped_step(text)
    assert stopped >= 20 and _latest_step(tmp_path) == stopped
    resumed = subprocess.run(_train(tmp_path, "--max-steps", str(stopped + 5)),
                             env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {stopped}\n" in resumed.stdout + resumed.stderr
    assert _latest_step(tmp_path) == stopped + 5


@pytest.mark.slow
def test_sigterm_to_replicas_stops_every_one_at_the_same_step_and_rank_0_saves(
        tmp_path, subprocess_env) -> None:
    code, text = _stop_mid_run(_train(tmp_path, "--replicas", "2", "--max-steps", "100000"),
                               subprocess_env, r"^step 20, loss|: step 20, loss")
    assert code == 0, text
    stopped = _stopped_step(text)
    assert f"[replica 1] stopped by signal 15 at global step {stopped}\n" in text
    assert _latest_step(tmp_path) == stopped


@pytest.mark.slow
def test_sigterm_to_a_ps_run_saves_on_the_chief_and_every_task_exits_zero(
        tmp_path, subprocess_env, capsys, monkeypatch) -> None:
    for name in ("TF_CONFIG", "TOWERFLOW_SECRET", "TOWERFLOW_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    snapshots = []

    def watch(run: object) -> None:  # towerflow status finds the run by its train dir alone
        assert (tmp_path / "cluster.secret").stat().st_mode & 0o777 == 0o600
        assert main(["status", "--train-dir", str(tmp_path), "--once", "--json",
                     "--interval", "0.2"]) == 0
        snapshots.append(json.loads(capsys.readouterr().out))

    code, text = _stop_mid_run(
        _train(tmp_path, "--ps", "1", "--workers", "2", "--max-steps", "100000"),
        subprocess_env, r"task:1 at \S+ is alive[\s\S]*\[worker:0\] .*step \d+, loss", watch)
    assert code == 0, text
    assert "worker:0 exited with status 0" in text and "worker:1 exited with status 0" in text
    assert _latest_step(tmp_path) == _stopped_step(text)
    assert [t["state"] for t in snapshots[0]["tasks"]] == ["up"] * 3
    assert "secret" not in (tmp_path / "cluster.json").read_text()
    assert not (tmp_path / "cluster.secret").exists()  # it lived as long as the run


@pytest.mark.slow
def test_sigterm_to_launch_makes_a_supervisor_chief_save_and_exit_zero(
        tmp_path, subprocess_env) -> None:
    logdir = tmp_path / "log"
    code, text = _stop_mid_run(
        [sys.executable, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--",
         sys.executable, str(ROOT / "examples" / "distributed_linear_regression.py"),
         "--logdir", str(logdir), "--steps", "10000000"],
        subprocess_env, r"\[worker:0\] step \d+, loss",
        # both workers in their session (a worker still importing torch dies of the signal)
        while_running=lambda run: run.wait_for(r"\[worker:1\] sess ok"))
    assert code == 0, text
    printed = [int(s) for s in re.findall(r"\[worker:0\] step (\d+), loss", text)]
    assert _latest_step(logdir) >= max(printed)


def _parts(on_second_part):  # noqa: ANN001, ANN202
    yield {"i": 0}, {"x": torch.zeros(4)}
    on_second_part()
    yield {"i": 1}, {"x": torch.ones(4)}


def _save_abandoned(tmp_path: Path, stop: StopSignals, on_second_part) -> None:  # noqa: ANN001
    manager = CheckpointManager(tmp_path)
    manager.save(3, {"model": {"w": torch.zeros(2)}})
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested == signal.SIGTERM
    with pytest.raises(FinalCheckpointAbandoned) as caught, stop.final_save():
        manager.save(9, {"model": {"w": torch.ones(2)},
                         "rows": ChunkedGroup(_parts(on_second_part))})
    assert caught.value.code == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000003", "latest"]
    assert _latest_step(tmp_path) == 3


def test_a_second_signal_abandons_the_final_checkpoint_and_leaves_no_part_of_it(
        tmp_path) -> None:
    with StopSignals(deadline_s=None) as stop:
        _save_abandoned(tmp_path, stop, lambda: os.kill(os.getpid(), signal.SIGINT))


def test_the_deadline_abandons_a_final_checkpoint_that_takes_too_long(tmp_path) -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGALRM)}
    with StopSignals(deadline_s=0.2) as stop:
        _save_abandoned(tmp_path, stop, lambda: threading.Event().wait(30))
    assert {sig: signal.getsignal(sig) for sig in before} == before


# One replica under a Supervisor, training until a signal stops it: CPU replicas (Gloo),
# named, so that the machine's GPUs (however many) change nothing.
_SUPERVISED_REPLICA = r"""
import os, sys, torch, towerflow
from towerflow.models.linear import LinearRegression, mse_loss, regression_data

rank = int(os.environ["RANK"])
sv = towerflow.Supervisor(is_chief=rank == 0, logdir=sys.argv[1], save_model_secs=None,
                          device="cpu")
data = regression_data(8)
with sv.managed_session(model=LinearRegression()) as sess:
    while not sv.should_stop():
        sess.run_step(mse_loss, data)
        if sess.global_step == 5:
            sys.stdout.write("training\n")  # one write per line: the replicas share a pipe
            sys.stdout.flush()
sys.stdout.write(f"stopped at {sess.global_step}\n")
sys.stdout.flush()
"""

_SPAWN = ("import sys; from towerflow.cluster.launcher import spawn_replicas; "
          "sys.exit(spawn_replicas(sys.argv[1:], 2))")


@pytest.mark.slow
def test_supervised_replicas_stop_at_the_same_step_and_the_chief_saves_it(
        tmp_path, subprocess_env) -> None:
    code, text = _stop_mid_run(
        [sys.executable, "-c", _SPAWN, sys.executable, "-c", _SUPERVISED_REPLICA,
         str(tmp_path)], subprocess_env, r"^\[replica 1\] training")
    assert code == 0, text
    steps = re.findall(r"^(\[replica 1\] )?stopped at (\d+)$", text, re.MULTILINE)
    assert len(steps) == 2 and steps[0][1] == steps[1][1], text
    assert _latest_step(tmp_path) == int(steps[0][1])


def test_a_signal_while_a_failed_run_shuts_down_keeps_its_error_and_a_second_ends_it() -> None:
    from towerflow.training.stopping import exit_on_signals, finish_failing

    finished = []
    with exit_on_signals(), pytest.raises(RuntimeError, match="the run's own error"):
        try:
            raise RuntimeError("the run's own error")
        except RuntimeError:
            with finish_failing():
                os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode
                finished.append("shut down")
            raise
    assert finished == ["shut down"]
    with finish_failing(), pytest.raises(SystemExit) as ended:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        finished.append("not reached")
    assert ended.value.code == 128 + signal.SIGTERM and finished == ["shut down"]
