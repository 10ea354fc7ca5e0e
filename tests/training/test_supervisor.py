"""Supervisor: restore or initialise, periodic and final checkpoints, summaries, preemption."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from towerflow.checkpoint import CheckpointManager
from towerflow.cluster import ClusterSpec, Server
from towerflow.cluster.transport import Credentials
from towerflow.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError
from towerflow.models.linear import LinearRegression, mse_loss, regression_data
from towerflow.ps import PSService
from towerflow.strategies import OptimizerConfig
from towerflow.strategies.single import SingleDevice
from towerflow.training.supervisor import Supervisor

DATA = regression_data(32, noise=0.0)
OPT = OptimizerConfig("sgd", lr=0.1)


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch) -> None:
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def run(sv: Supervisor, steps: int, model=None, master=None) -> tuple[LinearRegression, int]:
    model = model or LinearRegression(torch.Generator().manual_seed(0))
    with sv.managed_session(master, model=model, optimizer=OPT) as sess:
        while not sv.should_stop() and sess.global_step < steps:
            result = sess.run_step(mse_loss, DATA)
            sv.summary_computed(sess, {"loss": result.loss})
        return model, sess.global_step


def test_chief_saves_at_the_end_and_a_restart_resumes(tmp_path) -> None:
    model, step = run(Supervisor(is_chief=True, logdir=tmp_path, save_model_secs=None), 5)
    assert step == 5 and (tmp_path / "latest").read_text().strip() == "ckpt-00000005"
    again = Supervisor(is_chief=True, logdir=tmp_path, save_model_secs=None)
    fresh = LinearRegression(torch.Generator().manual_seed(42))
    with again.managed_session(model=fresh, optimizer=OPT) as sess:
        assert again.restored_from == 5 and sess.global_step == 5
        assert torch.equal(fresh.weight.detach(), model.weight.detach())
        sess.run_step(mse_loss, DATA)
    assert CheckpointManager(tmp_path).restore().step == 6


def test_init_fn_runs_only_without_a_checkpoint(tmp_path) -> None:
    calls = []

    def init_fn(model) -> None:
        calls.append(1)
        model.weight.fill_(3.0)

    model, _ = run(Supervisor(logdir=tmp_path, init_fn=init_fn), 0)
    assert calls == [1] and model.weight.item() == 3.0  # and saved at step 0
    sv = Supervisor(logdir=tmp_path, init_fn=init_fn)
    model, _ = run(sv, 1)
    assert calls == [1] and sv.restored_from == 0  # restored: no second init


def test_periodic_checkpoints_follow_save_model_secs(tmp_path) -> None:
    sv = Supervisor(logdir=tmp_path, save_model_secs=1e-9, max_to_keep=1)
    seen = []
    with sv.managed_session(model=LinearRegression(), optimizer=OPT) as sess:
        for _ in range(3):
            sess.run_step(mse_loss, DATA)
            seen.append((tmp_path / "latest").read_text().strip())
    assert seen == ["ckpt-00000001", "ckpt-00000002", "ckpt-00000003"]
    assert [p.name for p in CheckpointManager(tmp_path).checkpoints()] == ["ckpt-00000003"]


def test_manual_save_and_global_step_tensor(tmp_path) -> None:
    step = torch.zeros((), dtype=torch.int64)
    sv = Supervisor(logdir=tmp_path / "auto", save_model_secs=None, global_step=step)
    with sv.managed_session(model=LinearRegression(), optimizer=OPT) as sess:
        sess.run_step(mse_loss, DATA)
        sess.run_step(mse_loss, DATA)
        assert int(step) == 2
        path = sv.save(directory=tmp_path / "manual")
    assert path == tmp_path / "manual" / "ckpt-00000002"
    assert CheckpointManager(tmp_path / "manual").restore().step == 2


def test_summaries_are_tensorboard_event_files(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sv = Supervisor(logdir=tmp_path, save_model_secs=None)
    run(sv, 3)
    sv.stop()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]


def test_non_chief_writes_no_checkpoint_and_no_summary(tmp_path, caplog) -> None:
    sv = Supervisor(is_chief=False, logdir=tmp_path, save_model_secs=1e-9)
    with sv.managed_session(model=LinearRegression(), optimizer=OPT) as sess:
        sess.run_step(mse_loss, DATA)
        sv.summary_computed(sess, {"loss": 1.0})
        with caplog.at_level(logging.WARNING, logger="towerflow.training"):
            assert sv.save() is None
            assert sv.save(sess, directory=tmp_path / "elsewhere") is None
    assert list(tmp_path.iterdir()) == []
    said = [r.getMessage() for r in caplog.records if "only the" in r.getMessage()]
    assert len(said) == 1 and re.search(r"non-chief task writes nothing: only the chief", said[0])


def test_stop_is_requested_and_seen() -> None:
    sv = Supervisor(logdir=None)
    assert not sv.should_stop()
    sv.request_stop()
    assert sv.should_stop()


def test_bad_options_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"save_model_secs must be >= 0"):
        Supervisor(save_model_secs=-1)
    with pytest.raises(InvalidArgumentError, match=r"0-d integer tensor"):
        Supervisor(global_step=torch.zeros(2))
    with pytest.raises(InvalidArgumentError, match=r"unknown argument\(s\) modee; it takes"):
        Supervisor(modee="sync")


@pytest.mark.parametrize(("name", "instead"), [
    ("init_op", r"init_fn=lambda model"), ("ready_op", r"init_timeout="),
    ("ready_for_local_init_op", r"init_timeout="), ("local_init_op", r"initialises"),
    ("graph", r"no graph.*model="), ("init_feed_dict", r"init_fn="),
    ("recovery_wait_secs", r"init_timeout="), ("checkpoint_basename", r"ckpt-NNNNNNNN"),
    ("session_manager", r"strategy="), ("stop_grace_secs", r"no service threads"),
    ("summary_op", r"summary_computed.*summary_op=None"), ("saver", r"CheckpointManager"),
    ("summary_writer", r"SummaryWriter"),
])
def test_tf_arguments_without_a_meaning_are_refused_when_built(name, instead) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"Supervisor\({name}='op'\): .*{instead}"):
        Supervisor(is_chief=True, logdir=None, **{name: "op"})


def test_saver_none_saves_and_restores_nothing(tmp_path) -> None:
    run(Supervisor(logdir=tmp_path, save_model_secs=None), 2)
    sv = Supervisor(logdir=tmp_path, saver=None, save_model_secs=1e-9)
    _, step = run(sv, 3)
    assert sv.restored_from is None and step == 3  # did not resume from step 2
    assert CheckpointManager(tmp_path).restore().step == 2


def test_saver_is_the_checkpoint_manager_it_is_given(tmp_path) -> None:
    manager = CheckpointManager(tmp_path / "mine", max_to_keep=1)
    sv = Supervisor(logdir=tmp_path / "logs", saver=manager, save_model_secs=None)
    run(sv, 2)
    assert sv.checkpoint_manager is manager and manager.restore().step == 2
    assert sv.saver.directory == manager.directory  # TensorFlow's name passes through
    assert not (tmp_path / "logs" / "latest").exists()


def test_summary_writer_none_and_summary_op_none(tmp_path) -> None:
    from towerflow.training.summaries import SummaryWriter

    run(Supervisor(logdir=tmp_path / "a", summary_writer=None, save_model_secs=None), 2)
    assert not list((tmp_path / "a").glob("events.out.tfevents.*"))
    writer = SummaryWriter(tmp_path / "b")
    sv = Supervisor(logdir=None, summary_writer=writer, summary_op=None)
    run(sv, 2)
    sv.stop()
    assert list((tmp_path / "b").glob("events.out.tfevents.*"))


def test_save_summaries_secs_writes_the_global_step_rate(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sv = Supervisor(logdir=tmp_path, save_model_secs=None, save_summaries_secs=1e-9)
    run(sv, 3)
    sv.stop()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("global_step/sec")] == [1, 2, 3]


def test_save_model_steps_saves_every_n_global_steps(tmp_path) -> None:
    sv = Supervisor(logdir=tmp_path, save_model_secs=None, save_model_steps=2, max_to_keep=None)
    run(sv, 5)
    names = [p.name for p in CheckpointManager(tmp_path, max_to_keep=None).checkpoints()]
    assert names == ["ckpt-00000002", "ckpt-00000004", "ckpt-00000005"]


def test_a_manual_save_elsewhere_keeps_the_logdir_schedule(tmp_path) -> None:
    sv = Supervisor(logdir=tmp_path / "super", save_model_secs=3600)
    with sv.managed_session(model=LinearRegression(), optimizer=OPT) as sess:
        for _ in range(3):
            sess.run_step(mse_loss, DATA)
        assert sv.save(sess, directory=tmp_path / "linear") == tmp_path / "linear" / "ckpt-00000003"
    assert CheckpointManager(tmp_path / "super").restore().step == 3  # the final save
    again = Supervisor(logdir=tmp_path / "super", save_model_secs=3600)
    _, step = run(again, 4)
    assert again.restored_from == 3 and step == 4


def test_a_diverged_model_is_never_saved(tmp_path) -> None:
    from towerflow.errors import NanLossDuringTrainingError

    sv = Supervisor(logdir=tmp_path, save_model_secs=None)
    with pytest.raises(NanLossDuringTrainingError, match=r"weight is not finite at step 1") as err:
        with sv.managed_session(model=LinearRegression(), optimizer=OPT) as sess:
            sess.run_step(mse_loss, DATA)
            with torch.no_grad():
                sess.model.weight.fill_(float("nan"))
            sv.save(sess)
    assert CheckpointManager(tmp_path).latest() is None
    assert "checkpoint" not in str(err.value)  # none exists, so none is named


def test_a_checkpoint_of_the_supervisor_has_the_trainers_metadata(tmp_path) -> None:
    run(Supervisor(logdir=tmp_path, save_model_secs=None), 2)
    metadata = CheckpointManager(tmp_path).restore().metadata
    assert metadata["step"] == 2 and metadata["world_size"] == 1
    assert metadata["strategy"]["global_step"] == 2


def test_a_device_option_places_a_local_session(tmp_path) -> None:
    sv = Supervisor(logdir=None, device="/cpu:0")
    with sv.managed_session(model=LinearRegression(), optimizer=OPT) as sess:
        assert str(sess.strategy.device) == "cpu"


def test_a_ps_option_on_a_session_without_a_cluster_is_refused(tmp_path) -> None:
    sv = Supervisor(logdir=tmp_path, mode="sync")
    with pytest.raises(InvalidArgumentError, match=r"mode='sync'.* trains with SingleDevice \(no "
                                                   r"cluster\)"):
        run(sv, 1)


def test_a_target_of_this_processs_server_trains_through_its_ps_tasks(free_ports) -> None:
    """No ps runs: the session must fail as it does with the server, not train locally."""
    ports = free_ports(3)
    spec = ClusterSpec({"ps": [f"localhost:{ports[0]}"],
                        "worker": [f"localhost:{ports[1]}", f"localhost:{ports[2]}"]})
    server = Server(spec, "worker", 0, credentials=Credentials(secret=b"t"))
    try:
        for master in (server, server.target, f"grpc://127.0.0.1:{ports[1]}"):
            sv = Supervisor(is_chief=True, logdir=None, timeout=1.0)
            with pytest.raises(UnavailableError, match=rf"localhost:{ports[0]}"):
                run(sv, 1, master=master)
    finally:
        server.stop()


def test_a_target_that_names_no_known_task_is_refused(free_ports) -> None:
    port = free_ports(1)[0]
    with pytest.raises(InvalidArgumentError, match=rf"target 'grpc://localhost:{port}' names no "
                                                   r"task this process knows.*towerflow.Server"):
        run(Supervisor(logdir=None), 1, master=f"grpc://localhost:{port}")


def test_on_a_ps_cluster_only_the_chief_saves(tmp_path, free_ports) -> None:
    ports = free_ports(3)
    spec = ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"],
                        "worker": [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"]})
    secret = Credentials(secret=b"sv")
    service = PSService(0)
    servers = [Server(spec, "ps", 0, credentials=secret, handlers=[service.handlers()])]
    servers += [Server(spec, "worker", i, credentials=secret) for i in range(2)]
    try:
        dirs = [tmp_path / "w0", tmp_path / "w1"]
        supervisors = [Supervisor(is_chief=(i == 0), logdir=dirs[i], save_model_secs=None)
                       for i in range(2)]
        other_done = threading.Event()

        def chief() -> tuple[LinearRegression, int]:  # its final save after worker 1's pushes
            model = LinearRegression(torch.Generator().manual_seed(0))
            with supervisors[0].managed_session(servers[1], model=model, optimizer=OPT) as sess:
                while sess.global_step < 30:
                    sess.run_step(mse_loss, DATA)
                assert other_done.wait(timeout=60)
                return model, sess.global_step

        def other() -> tuple[LinearRegression, int]:
            try:
                return run(supervisors[1], 30, None, servers[2])
            finally:
                other_done.set()

        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(chief), pool.submit(other)]
            steps = [r.result(timeout=120) for r in runs]
        assert all(step >= 30 for _, step in steps)
        assert not dirs[1].exists() or list(dirs[1].iterdir()) == []
        ckpt = CheckpointManager(dirs[0]).restore()
        assert ckpt.metadata["strategy"]["mode"] == "async"
        assert ckpt.groups["model"]["weight"].tolist() == [service.shard.state.params[0]]
    finally:
        for server in servers:
            server.stop()


_PREEMPTED = textwrap.dedent("""
    import sys, torch
    from towerflow.models.linear import LinearRegression, mse_loss, regression_data
    from towerflow.strategies import OptimizerConfig
    from towerflow.training.supervisor import Supervisor
    data = regression_data(16)
    sv = Supervisor(is_chief=True, logdir=sys.argv[1], save_model_secs=None)
    with sv.managed_session(model=LinearRegression(), optimizer=OptimizerConfig()) as sess:
        while not sv.should_stop():
            sess.run_step(mse_loss, data)
            if sess.global_step == 3:
                print("training", flush=True)
    print("stopped at", sess.global_step, flush=True)
""")


@pytest.mark.slow
def test_sigterm_on_the_chief_checkpoints_and_exits_zero(tmp_path, python, subprocess_env) -> None:
    proc = subprocess.Popen([python, "-c", _PREEMPTED, str(tmp_path)], env=subprocess_env,
                            stdout=subprocess.PIPE, text=True)
    try:
        ready = threading.Event()
        lines: list[str] = []

        def read() -> None:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("training"):
                    ready.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert ready.wait(60), lines
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0
        reader.join(10)
    finally:
        proc.kill()
        proc.wait(10)
    stopped = int(next(line for line in lines if line.startswith("stopped at")).split()[-1])
    ckpt = CheckpointManager(Path(tmp_path)).restore()
    assert ckpt is not None and ckpt.step == stopped >= 3


class _PeerLostAt(SingleDevice):
    """One device, but the step to ``fail_at`` fails as a step missing a peer does."""

    def __init__(self, fail_at: int, error: type[Exception]) -> None:
        super().__init__("cpu")
        self.fail_at, self.error = fail_at, error

    def run_step(self, loss_fn, batch, *, lr=None):
        if self.global_step + 1 == self.fail_at:
            raise self.error("Step 7 waited 4 s for 2 gradients but received 1.")
        return super().run_step(loss_fn, batch, lr=lr)


@pytest.mark.parametrize("error", [DeadlineExceededError, UnavailableError])
def test_a_step_missing_a_peer_makes_the_chief_save_then_fail_naming_the_way_out(
        tmp_path, error) -> None:
    sv = Supervisor(logdir=tmp_path, save_model_secs=0, summary_writer=None)
    with pytest.raises(error, match=re.escape(
            "Step 7 waited 4 s for 2 gradients but received 1. The chief saved "
            f"{tmp_path / 'ckpt-00000006'} (global step 6) before stopping. Restart the missing "
            "task with the same command: a restarted worker rejoins the running job")):
        _run_with(sv, _PeerLostAt(7, error), 100)
    latest = CheckpointManager(tmp_path).restore()
    assert latest is not None and latest.step == 6


def _run_with(sv: Supervisor, strategy, steps: int) -> None:
    model = LinearRegression(torch.Generator().manual_seed(0))
    with sv.managed_session(model=model, optimizer=OPT, strategy=strategy) as sess:
        while sess.global_step < steps:
            sess.run_step(mse_loss, DATA)


def test_a_non_chief_missing_a_peer_saves_nothing_and_still_says_the_way_out(tmp_path) -> None:
    sv = Supervisor(is_chief=False, logdir=tmp_path, save_model_secs=0, summary_writer=None)
    with pytest.raises(DeadlineExceededError, match=r"received 1\. Restart the missing task"):
        _run_with(sv, _PeerLostAt(3, DeadlineExceededError), 100)
    assert CheckpointManager(tmp_path).restore() is None


def test_the_trainer_saves_before_stopping_on_a_step_missing_a_peer(tmp_path) -> None:
    from towerflow.training.loop import Trainer

    data = [DATA] * 100
    trainer = Trainer(LinearRegression(torch.Generator().manual_seed(0)), mse_loss, data,
                      strategy=_PeerLostAt(5, DeadlineExceededError), optimizer=OPT,
                      train_dir=tmp_path, checkpoint_every=1000, summary_every=0)
    with trainer, pytest.raises(DeadlineExceededError,
                                match=r"The chief saved .*ckpt-00000004 \(global step 4\) "
                                      r"before stopping\. Restart the missing task"):
        trainer.fit(max_steps=100)
    latest = CheckpointManager(tmp_path).restore()
    assert latest is not None and latest.step == 4


def test_the_articles_saver_call_with_a_global_step_saves_there(tmp_path) -> None:
    sv = Supervisor(is_chief=True, logdir=tmp_path / "logs", save_model_secs=None)
    with sv.managed_session(model=LinearRegression(), optimizer=OPT) as sess:
        for _ in range(3):
            result = sess.run_step(mse_loss, DATA)
        path = sv.saver.save(sess, str(tmp_path / "linear" / "model.ckpt"),
                             global_step=result.global_step)
        assert path == str(tmp_path / "linear" / "ckpt-00000003")
        with pytest.raises(InvalidArgumentError, match="write_meta_graph, which towerflow"):
            sv.saver.save(sess, str(tmp_path / "linear/"), write_meta_graph=False)
    assert CheckpointManager(tmp_path / "linear").restore().step == 3


def test_a_custom_loop_gets_back_the_restored_step_and_its_own_data_position(tmp_path) -> None:
    sv = Supervisor(is_chief=True, logdir=tmp_path, save_model_secs=None)
    with sv.managed_session(model=LinearRegression(), optimizer=OPT) as sess:
        assert sess.restored_step is None and sess.data_position is None
        for batch in range(4):
            sess.run_step(mse_loss, DATA)
            sess.data_position = {"epoch": 1, "batch": batch + 1}
    again = Supervisor(is_chief=True, logdir=tmp_path, save_model_secs=None)
    with again.managed_session(model=LinearRegression(), optimizer=OPT) as sess:
        assert sess.restored_step == 4 and sess.data_position == {"epoch": 1, "batch": 4}
