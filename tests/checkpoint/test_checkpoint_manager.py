"""CheckpointManager: latest pointer, max_to_keep, corruption fallback, crash safety."""

from __future__ import annotations

import logging
import os
import random
import re
import select
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch

from towerflow.checkpoint import CheckpointManager, latest_checkpoint, read_checkpoint
from towerflow.checkpoint.atomic import HOST_TAG
from towerflow.checkpoint.format import write_checkpoint_dir
from towerflow.errors import CheckpointError, InvalidArgumentError, NotFoundError


def _groups(step: int) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {"w": torch.full((3,), float(step))}, "optimizer": {"m": torch.ones(2) * step}}


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 + 4] ^= 0x5A
    path.write_bytes(bytes(data))


def test_save_writes_numbered_dir_and_points_latest_at_it(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(10, _groups(10), {"epoch": 1})
    assert path == tmp_path / "ckpt-00000010"
    assert (tmp_path / "latest").read_text() == "ckpt-00000010\n"
    ckpt = mgr.restore()
    assert ckpt is not None and ckpt.step == 10 and ckpt.metadata == {"epoch": 1}
    assert torch.equal(ckpt.groups["model"]["w"], torch.full((3,), 10.0))


def test_max_to_keep_deletes_the_oldest_after_the_new_one_is_in_place(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, _groups(step))
    assert [p.name for p in mgr.checkpoints()] == ["ckpt-00000003", "ckpt-00000004"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000003", "ckpt-00000004", "latest"]


def test_max_to_keep_none_keeps_every_checkpoint(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, max_to_keep=None)
    for step in range(7):
        mgr.save(step, _groups(step))
    assert len(mgr.checkpoints()) == 7


def test_max_to_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"max_to_keep=0 must be a positive integer"):
        CheckpointManager(tmp_path, max_to_keep=0)


@pytest.mark.parametrize("step", [-1, True, "7"])
def test_bad_step_is_refused_before_anything_is_written(tmp_path: Path, step: object) -> None:
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"step .* is not a non-negative integer"):
        mgr.save(step, _groups(1))  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


def test_empty_directory_has_no_checkpoint(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "new")
    assert mgr.latest() is None
    assert mgr.restore() is None
    assert latest_checkpoint(tmp_path / "missing") is None
    with pytest.raises(NotFoundError, match=r"No checkpoint in .*new"):
        mgr.restore_or_raise()


def test_corrupt_latest_falls_back_to_previous_with_warning_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _groups(1))
    newest = mgr.save(2, _groups(2))
    _corrupt(newest / "optimizer.safetensors")
    with caplog.at_level(logging.WARNING, logger="towerflow.checkpoint"):
        assert mgr.latest() == tmp_path / "ckpt-00000001"
        ckpt = mgr.restore()
    assert ckpt is not None and ckpt.step == 1
    assert re.search(r"ckpt-00000002/optimizer\.safetensors.*checksum", caplog.text)


def test_truncated_latest_falls_back_to_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(5, _groups(5))
    newest = mgr.save(6, _groups(6))
    fpath = newest / "model.safetensors"
    fpath.write_bytes(fpath.read_bytes()[:20])
    with caplog.at_level(logging.WARNING, logger="towerflow.checkpoint"):
        ckpt = mgr.restore()
    assert ckpt is not None and ckpt.step == 5
    assert re.search(r"ckpt-00000006/model\.safetensors.*truncated", caplog.text)


def test_all_corrupt_is_refused_and_nothing_is_pruned(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    only = mgr.save(1, _groups(1))
    (only / "manifest.json").write_text("garbage")
    with pytest.raises(CheckpointError, match=r"Every checkpoint in .* is damaged: .*ckpt-00000001"
                       r".*Restore a backup of the train dir, or train again in a new one"):
        mgr.restore()
    assert only.is_dir() and (only / "manifest.json").read_text() == "garbage"


def test_temp_dirs_are_ignored_by_readers_and_removed_by_the_next_manager(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _groups(1))
    # What a writer killed mid-save leaves: a temp dir (pid 0 never runs a user process).
    stale = tmp_path / f".tmp-ckpt-00000002-{HOST_TAG}-0-0badf00d"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    (tmp_path / f".tmp-latest-{HOST_TAG}-0-0badf00d").write_text("ckpt-00000002\n")
    assert [p.name for p in mgr.checkpoints()] == ["ckpt-00000001"]
    assert mgr.latest() == tmp_path / "ckpt-00000001"
    CheckpointManager(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001", "latest"]


def test_checkpoint_renamed_in_but_never_pointed_at_is_ignored(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _groups(1))
    # A writer killed between the rename and the pointer update.
    write_checkpoint_dir(tmp_path / "ckpt-00000002", 2, _groups(2))
    assert mgr.latest() == tmp_path / "ckpt-00000001"


def test_missing_pointer_uses_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _groups(1))
    mgr.save(2, _groups(2))
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-00000002"


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, _groups(3))
    mgr.save(3, {"model": {"w": torch.zeros(1)}})
    ckpt = mgr.restore()
    assert ckpt is not None and set(ckpt.groups) == {"model"}
    assert [p.name for p in mgr.checkpoints()] == ["ckpt-00000003"]


_SAVER = textwrap.dedent(
    """
    import sys, torch
    from towerflow.checkpoint import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], max_to_keep=2)
    ckpt = mgr.restore()
    step = 0 if ckpt is None else ckpt.step + 1
    while True:
        t = torch.full((64, 1024), float(step))
        mgr.save(step, {"model": {"w": t, "b": t[0].clone()}, "optimizer": {"m": t * 2}},
                 {"step": step})
        print(step, flush=True)
        step += 1
    """
)


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's next output line, waiting at most ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the saving child printed nothing within {timeout} s"
    return proc.stdout.readline()


@pytest.mark.slow
def test_sigkill_at_any_moment_of_a_save_leaves_latest_complete(
    tmp_path: Path, python: str, subprocess_env: dict[str, str]
) -> None:
    rng = random.Random(1234)
    last_step = -1
    for _round in range(4):
        proc = subprocess.Popen(
            [python, "-c", _SAVER, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=subprocess_env,
            text=True,
        )
        try:
            # Wait (bounded) until the child has committed at least one save.
            first = _read_line(proc, timeout=60)
            assert first.strip().isdigit(), "the saving child did not start"
            # The fault: SIGKILL at a random moment among the following saves.
            time.sleep(rng.uniform(0.0, 0.3))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            if proc.stdout:
                proc.stdout.close()
        latest = latest_checkpoint(tmp_path)
        assert latest is not None
        ckpt = read_checkpoint(latest)
        assert ckpt.step >= int(first) > last_step
        assert ckpt.metadata == {"step": ckpt.step}
        assert torch.equal(ckpt.groups["model"]["w"], torch.full((64, 1024), float(ckpt.step)))
        last_step = ckpt.step
        CheckpointManager(tmp_path, max_to_keep=2)
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]



def test_checkpoint_without_manifest_is_warned_about_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _groups(1))
    (mgr.save(2, _groups(2)) / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="towerflow.checkpoint"):
        ckpt = mgr.restore()
    assert ckpt is not None and ckpt.step == 1
    assert re.search(r"ckpt-00000002' has no manifest\.json", caplog.text)
