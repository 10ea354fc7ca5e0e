"""Step log (article 001's line, timestamp and sec/batch) and the NaN guard."""

from __future__ import annotations

import io
import re
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from towerflow.checkpoint import CheckpointManager
from towerflow.data import load_digits
from towerflow.errors import NanLossDuringTrainingError
from towerflow.models import DigitsNet, cross_entropy_loss
from towerflow.strategies.single import SingleDevice
from towerflow.testing.replicas import run_replicas
from towerflow.training import TrainConfig, Trainer
from towerflow.training.hooks import (
    CheckpointHook,
    Hook,
    NanGuard,
    StepContext,
    StepLogHook,
    format_step_line,
)

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}): step (\d+), loss = (\d+\.\d\d) "
                  r"\((\d+\.\d) examples/sec; (\d+\.\d{3}) sec/batch\)$")


@pytest.fixture(scope="module")
def digits():
    return load_digits("train")


def test_step_line_is_the_article_format_with_its_timestamp() -> None:
    line = format_step_line(10, 2.3012, 1234.54, 0.1037, datetime(2026, 11, 22, 10, 0, 0, 123456))
    assert line == ("2026-11-22 10:00:00.123456: step 10, loss = 2.30 "
                    "(1234.5 examples/sec; 0.104 sec/batch)")
    # a whole second keeps its six digits (str(datetime) would drop them)
    assert LINE.match(format_step_line(1, 1.0, 1.0, 1.0, datetime(2026, 1, 1)))


def test_trainer_prints_timestamped_lines_with_the_current_time(digits, capsys) -> None:
    before = datetime.now()
    with Trainer(DigitsNet(), cross_entropy_loss, digits, strategy=SingleDevice("/cpu:0"),
                 config=TrainConfig(max_steps=4, batch_size=16, log_every=2)) as trainer:
        trainer.fit()
    lines = capsys.readouterr().out.splitlines()
    matches = [LINE.match(line) for line in lines]
    assert all(matches) and [int(m.group(2)) for m in matches] == [2, 4], lines
    for m in matches:
        assert before <= datetime.fromisoformat(m.group(1)) <= datetime.now()


@pytest.mark.parametrize("batches", [1, 4])
def test_sec_per_batch_is_the_step_duration_over_the_batches_of_a_step(batches) -> None:
    """Article 001: examples/sec = batch * num_gpus / duration, sec/batch = duration / num_gpus."""
    stream = io.StringIO()
    hook = StepLogHook(every=5, stream=stream)
    strategy = SimpleNamespace(is_chief=True, batches_per_step=batches)
    hook.begin(SimpleNamespace(global_step=0, strategy=strategy))
    per_batch = 32
    for step in range(1, 6):
        hook.after_step(StepContext(step, 5, None, 1.0 if step == 5 else None,
                                    global_batch=per_batch * batches))
    m = LINE.match(stream.getvalue().strip())
    assert m, stream.getvalue()
    examples_per_sec, sec_per_batch = float(m.group(4)), float(m.group(5))
    if sec_per_batch >= 0.01:  # enough digits to compare
        # duration = sec_per_batch * batches; examples/sec = per_batch * batches / duration
        assert examples_per_sec == pytest.approx(per_batch / sec_per_batch, rel=0.1)


def _nan_at(step: int):
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        loss = cross_entropy_loss(model, batch)
        return loss * float("nan") if calls["n"] == step else loss

    return loss_fn


def test_nan_guard_names_the_step_where_the_loss_first_became_nan(digits, tmp_path) -> None:
    """The loss is read only at step 10, yet the message names step 7."""
    trainer = Trainer(DigitsNet(), _nan_at(7), digits, strategy=SingleDevice("/cpu:0"),
                      config=TrainConfig(max_steps=30, batch_size=16, log_every=10,
                                         summary_every=0, checkpoint_every=5,
                                         train_dir=tmp_path))
    with trainer, pytest.raises(NanLossDuringTrainingError) as info:
        trainer.fit()
    message = str(info.value)
    assert re.match(r"Model diverged with loss = NaN at step 7 \(loss nan, read at step 10\)",
                    message), message
    newest = CheckpointManager(tmp_path).latest()
    assert newest.name == "ckpt-00000005" and f"'{newest}', holds finite parameters" in message


def test_nan_guard_without_checkpoints_mentions_none(digits, tmp_path) -> None:
    for train_dir in (None, tmp_path):  # no train dir, and one where no save was due yet
        trainer = Trainer(DigitsNet(), _nan_at(3), digits, strategy=SingleDevice("/cpu:0"),
                          config=TrainConfig(max_steps=30, batch_size=16, log_every=4,
                                             summary_every=0, checkpoint_every=1000,
                                             train_dir=train_dir))
        with trainer, pytest.raises(NanLossDuringTrainingError,
                                    match=r"at step 3 \(") as info:
            trainer.fit()
        assert "checkpoint" not in str(info.value)


class _HostReads(TorchFunctionMode):
    """Records the tensor methods that copy a value to the host."""

    SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.__bool__,
             torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.numpy,
             torch.Tensor.__index__}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCS:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_nan_guard_observes_every_step_without_reading_the_device() -> None:
    guard = NanGuard()
    losses = [2.3, float("inf"), float("nan"), 2.0]
    with _HostReads() as mode:
        for step, value in enumerate(losses, start=11):
            guard.observe(step, torch.tensor(value))
    assert mode.reads == []
    one = SimpleNamespace(rank=0, world_size=1, reduce_mean=lambda value: value)
    with pytest.raises(NanLossDuringTrainingError, match=r"NaN at step 12 \(loss 2\.0, read at"):
        guard.read(one, torch.tensor(2.0), 14)


@pytest.mark.parametrize("bad_steps", [[300], [40, 700], [256], [257, 258]])
def test_nan_guard_names_the_first_bad_step_across_many_unread_steps(bad_steps) -> None:
    guard = NanGuard()
    with _HostReads() as mode:
        for step in range(1, 1001):  # steps gone by unread, several windows of them
            guard.observe(step, torch.tensor(float("nan") if step in bad_steps else 0.5,
                                             dtype=torch.float64))
    assert mode.reads == []
    one = SimpleNamespace(rank=0, world_size=1, reduce_mean=lambda value: value)
    with pytest.raises(NanLossDuringTrainingError, match=rf"at step {bad_steps[0]} "):
        guard.read(one, torch.tensor(0.5), 1000)


def test_nan_guard_checks_a_loss_that_is_not_a_scalar() -> None:
    guard = NanGuard()
    guard.observe(1, torch.tensor([0.5, 0.5]))
    guard.observe(2, torch.tensor([0.5, float("inf")]))
    one = SimpleNamespace(rank=0, world_size=1, reduce_mean=lambda value: value)
    with pytest.raises(NanLossDuringTrainingError, match=r"at step 2 "):
        guard.read(one, torch.tensor(0.5), 2)


def test_nan_guard_reads_nothing_while_the_losses_are_finite() -> None:
    guard = NanGuard()
    one = SimpleNamespace(rank=0, world_size=1, reduce_mean=lambda value: value)
    for step in range(1, 4):
        guard.observe(step, torch.tensor(1.5))
    assert guard.read(one, torch.tensor(1.5), 3) == 1.5


def test_nan_guard_keeps_large_step_numbers_exact() -> None:
    guard = NanGuard()
    guard.observe(123_456_789, torch.tensor(float("nan")))
    three = SimpleNamespace(rank=2, world_size=3, reduce_mean=lambda value: value / 3)
    with pytest.raises(NanLossDuringTrainingError, match=r"at step 123456789 "):
        guard.read(three, torch.tensor(1.0), 123_456_800)


_REPLICA = r"""
import sys, torch
from towerflow.data import load_digits
from towerflow.errors import NanLossDuringTrainingError
from towerflow.models import DigitsNet, cross_entropy_loss
from towerflow.strategies.mirrored import Mirrored
from towerflow.training import TrainConfig, Trainer

strategy = Mirrored(timeout_s=60)
calls = {"n": 0}

def loss_fn(model, batch):
    calls["n"] += 1
    loss = cross_entropy_loss(model, batch)
    # only replica 1 sees a NaN at step 5; the all-reduced gradient spreads it
    return loss * float("nan") if strategy.rank == 1 and calls["n"] == 5 else loss

torch.manual_seed(0)
trainer = Trainer(DigitsNet(), loss_fn, load_digits("train"), strategy=strategy,
                  config=TrainConfig(max_steps=50, batch_size=8, log_every=10, summary_every=0))
try:
    trainer.fit()
except NanLossDuringTrainingError as exc:
    print("stopped:", exc, flush=True)
strategy.shutdown()
"""


@pytest.mark.slow
def test_every_replica_names_the_earliest_bad_step_of_any_replica(
        free_ports, subprocess_env, python) -> None:
    results = run_replicas([python, "-c", _REPLICA], world_size=2, port=free_ports(1)[0],
                           env=subprocess_env)
    outputs = [out for _, out in results]
    assert [status for status, _ in results] == [0, 0], outputs
    for out in outputs:
        assert re.search(r"stopped: Model diverged with loss = NaN at step 5 \(loss nan, "
                         r"read at step 10\)", out), out


def test_the_loop_reads_the_device_only_on_log_steps(digits) -> None:
    """The NaN guard watches every step; the host reads values only where a line is printed."""
    mode = _HostReads()
    seen: dict[int, int] = {}

    class Count(Hook):
        def after_step(self, ctx: StepContext) -> None:
            seen[ctx.step] = len(mode.reads)

    trainer = Trainer(DigitsNet(), cross_entropy_loss, digits, strategy=SingleDevice("/cpu:0"),
                      config=TrainConfig(max_steps=20, batch_size=16, log_every=10,
                                         summary_every=0, ema_decay=0.99), hooks=[Count()])
    with trainer:
        trainer.fit(max_steps=2)  # the pipeline's start is not a step
        with mode:
            trainer.fit(max_steps=20)
    grew = [step for step in range(4, 21) if seen[step] > seen[step - 1]]
    assert grew == [10, 20], seen


def test_article_flags_reach_the_trainer(tmp_path: Path) -> None:
    from towerflow.cli import build_parser

    args = build_parser().parse_args([
        "train", "cifar10", "--train_dir", str(tmp_path), "--max_steps", "7", "--num_gpus", "2",
        "--log_device_placement", "--batch_size", "64", "--data_dir", str(tmp_path / "d")])
    dashed = build_parser().parse_args([
        "train", "cifar10", "--train-dir", str(tmp_path), "--max-steps", "7", "--num-gpus", "2",
        "--log-device-placement", "--batch-size", "64", "--data-dir", str(tmp_path / "d")])
    assert vars(args) == vars(dashed)
    assert (args.train_dir, args.max_steps, args.num_gpus, args.log_device_placement,
            args.batch_size) == (str(tmp_path), 7, 2, True, 64)


def test_the_last_checkpoint_is_written_when_another_worker_passed_max_steps(tmp_path) -> None:
    # async ps: the chief's last push may return a global step beyond max_steps
    manager = CheckpointManager(tmp_path)
    trainer = SimpleNamespace(
        global_step=0, max_steps=300, strategy=SimpleNamespace(is_chief=True),
        non_finite_state=lambda: None,
        checkpoint_state=lambda: ({"model": {"w": torch.ones(2)}}, {}))
    hook = CheckpointHook(manager, every=0)
    hook.begin(trainer)
    assert hook.wants_loss(302)
    hook.after_step(StepContext(302, 300, None, 0.5, 32))
    assert manager.latest() is not None and manager.latest().name.endswith("302")


def test_periodic_hooks_act_once_per_multiple_when_other_workers_skip_the_steps(tmp_path) -> None:
    """Async ps: one worker sees global steps 3, 7, 12, 18, 21, ... — every multiple passed acts."""
    steps = [3, 7, 12, 18, 21, 22, 29, 33, 41]
    trainer = SimpleNamespace(
        global_step=0, max_steps=1000, strategy=SimpleNamespace(is_chief=True, batches_per_step=1),
        non_finite_state=lambda: None,
        checkpoint_state=lambda: ({"model": {"w": torch.ones(2)}}, {}))
    stream = io.StringIO()
    log_hook, ckpt_hook = StepLogHook(every=10, stream=stream), CheckpointHook(
        CheckpointManager(tmp_path, max_to_keep=None), every=10)
    for hook in (log_hook, ckpt_hook):
        hook.begin(trainer)
    for step in steps:
        loss = 1.0 if any(h.wants_loss(step) for h in (log_hook, ckpt_hook)) else None
        for hook in (log_hook, ckpt_hook):
            hook.after_step(StepContext(step, 1000, None, loss, 32))
    logged = [int(LINE.match(line).group(2)) for line in stream.getvalue().splitlines()]
    assert logged == [12, 21, 33, 41]
    assert sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("ckpt-*")) == [12, 21, 33, 41]


def test_a_resumed_run_acts_at_the_next_multiple_not_at_its_first_step() -> None:
    stream = io.StringIO()
    hook = StepLogHook(every=10, stream=stream)
    hook.begin(SimpleNamespace(global_step=20, strategy=SimpleNamespace(is_chief=True,
                                                                        batches_per_step=1)))
    assert [s for s in range(21, 32) if hook.wants_loss(s)] == [30, 31]
    hook.after_step(StepContext(30, 100, None, 1.0, 32))
    assert not hook.wants_loss(31) and hook.wants_loss(40)


def test_the_supervisors_step_schedule_saves_past_each_multiple_a_worker_skips() -> None:
    from towerflow.training.session import SaveSchedule

    schedule, saved = SaveSchedule(every_steps=10), []
    for step in (1001, 1004, 1009, 1013, 1018, 1020, 1033):  # resumed at 1000, steps skip
        if schedule.due(step):
            schedule.saved(step)
            saved.append(step)
    assert saved == [1013, 1020, 1033]
