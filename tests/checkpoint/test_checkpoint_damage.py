"""Damaged checkpoints on disk: every form refused with a CheckpointError, restore falls back.

Each test plants one kind of damage an unlucky disk or operator makes — a
manifest nested 100,000 deep, a symlink to ``/dev/zero``, a FIFO, a
directory in place of a file, a checkpoint directory symlinked from outside
the train dir, a hand-edited step — and checks that a named checkpoint is
refused with a message saying what is damaged, and that ``restore`` falls
back to the previous good checkpoint with a warning that says the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from towerflow.checkpoint import CheckpointManager, latest_checkpoint, load, read_checkpoint
from towerflow.checkpoint.format import MANIFEST_NAME, read_manifest, write_checkpoint_dir
from towerflow.errors import CheckpointError, InvalidArgumentError

DIGEST_NAME = "manifest.sha256"


def _train_dir(tmp_path: Path, steps: tuple[int, ...] = (10, 20, 30)) -> Path:
    run = tmp_path / "run"
    mgr = CheckpointManager(run, max_to_keep=None)
    for step in steps:
        mgr.save(step, {"model": {"w": torch.full((3,), float(step))}}, {"epoch": step})
    return run


def _reseal(ckpt: Path) -> None:
    """Record the digest of the manifest as it is now (as a careful forger would)."""
    digest = hashlib.sha256((ckpt / MANIFEST_NAME).read_bytes()).hexdigest()
    (ckpt / DIGEST_NAME).write_text(f"{digest}  {MANIFEST_NAME}\n")


def _nest_metadata(ckpt: Path, depth: int) -> None:
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    text = json.dumps(manifest)
    deep = "[" * depth + "]" * depth
    text = text.replace('"metadata": {', f'"metadata": {{"deep": {deep}, ', 1)
    (ckpt / MANIFEST_NAME).write_text(text)


def _restore_warns(run: Path, caplog: pytest.LogCaptureFixture, expect_step: int, pattern: str):
    with caplog.at_level(logging.WARNING, logger="towerflow.checkpoint"):
        ckpt = CheckpointManager(run).restore()
    assert ckpt is not None and ckpt.step == expect_step
    assert ckpt.path == run / f"ckpt-{expect_step:08d}"
    assert pattern in caplog.text, caplog.text
    return ckpt


def test_manifest_nested_100000_deep_is_refused_by_read_load_and_restore(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _train_dir(tmp_path)
    newest = run / "ckpt-00000030"
    _nest_metadata(newest, 100_000)
    _reseal(newest)
    with pytest.raises(CheckpointError, match=r"manifest\.json.*nested deeper than 64 levels"):
        read_checkpoint(newest)
    with pytest.raises(CheckpointError, match=r"nested deeper"):
        load(newest)
    _restore_warns(run, caplog, 20, "nested deeper than 64 levels")


def test_metadata_too_deep_to_read_back_is_refused_when_saving(tmp_path: Path) -> None:
    deep: object = 1
    for _ in range(70):
        deep = [deep]
    with pytest.raises(InvalidArgumentError, match=r"metadata is nested deeper than the 64 levels"):
        write_checkpoint_dir(tmp_path / "c", 0, {"model": {"w": torch.ones(1)}}, {"deep": deep})
    assert not (tmp_path / "c").exists()


def test_a_tensor_file_symlinked_to_dev_zero_is_refused_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _train_dir(tmp_path)
    target = run / "ckpt-00000030" / "model.safetensors"
    target.unlink()
    target.symlink_to("/dev/zero")
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"model\.safetensors' is a symbolic link"):
        read_checkpoint(run / "ckpt-00000030")
    assert time.monotonic() - start < 2.0
    _restore_warns(run, caplog, 20, "is a symbolic link")


def test_latest_pointer_symlinked_to_dev_zero_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _train_dir(tmp_path)
    (run / "latest").unlink()
    (run / "latest").symlink_to("/dev/zero")
    _restore_warns(run, caplog, 30, "latest' is a symbolic link")


def test_a_directory_in_place_of_a_tensor_file_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _train_dir(tmp_path)
    target = run / "ckpt-00000030" / "model.safetensors"
    target.unlink()
    target.mkdir()
    with pytest.raises(CheckpointError, match=r"model\.safetensors' is a directory, not a regular"):
        load(run / "ckpt-00000030")
    _restore_warns(run, caplog, 20, "is a directory, not a regular file")


def test_an_oversized_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    run = _train_dir(tmp_path, (10,))
    manifest = run / "ckpt-00000010" / MANIFEST_NAME
    with open(manifest, "r+b") as f:
        f.truncate(1 << 40)  # a sparse terabyte: reading it whole would exhaust memory
    with pytest.raises(CheckpointError, match=r"manifest\.json' is 1099511627776 bytes, more than"):
        read_manifest(run / "ckpt-00000010")


_FIFO_CHILD = textwrap.dedent(
    """
    import sys
    from towerflow.checkpoint import CheckpointManager, load
    from towerflow.errors import CheckpointError
    try:
        load(sys.argv[1] + "/ckpt-00000030")
    except CheckpointError as exc:
        print("load refused:", exc)
    ckpt = CheckpointManager(sys.argv[1]).restore()
    print("restored step", ckpt.step)
    """
)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_a_tensor_file_is_refused_without_blocking(tmp_path: Path) -> None:
    run = _train_dir(tmp_path)
    target = run / "ckpt-00000030" / "model.safetensors"
    target.unlink()
    os.mkfifo(target)
    proc = subprocess.run([sys.executable, "-c", _FIFO_CHILD, str(run)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "load refused:" in proc.stdout and "is a FIFO, not a regular file" in proc.stdout
    assert "restored step 20" in proc.stdout
    assert "is a FIFO" in proc.stderr  # the restore's warning


def test_a_checkpoint_dir_symlinked_from_outside_the_train_dir_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _train_dir(tmp_path)
    outside = tmp_path / "elsewhere" / "ckpt-00000020"
    shutil.copytree(run / "ckpt-00000020", outside)
    shutil.rmtree(run / "ckpt-00000030")
    (run / "ckpt-00000030").symlink_to(outside, target_is_directory=True)
    _restore_warns(run, caplog, 20, "ckpt-00000030' is a symbolic link")
    assert latest_checkpoint(run) == run / "ckpt-00000020"


def test_a_checkpoint_copied_in_under_another_steps_name_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _train_dir(tmp_path)
    shutil.rmtree(run / "ckpt-00000030")
    shutil.copytree(run / "ckpt-00000020", run / "ckpt-00000030")
    ckpt = _restore_warns(run, caplog, 20, "holds step 20 but its name says step 30")
    assert torch.equal(ckpt.groups["model"]["w"], torch.full((3,), 20.0))


def test_a_hand_edited_step_is_detected_by_the_manifest_digest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _train_dir(tmp_path)
    manifest = run / "ckpt-00000030" / MANIFEST_NAME
    text = manifest.read_text()
    assert '"step": 30' in text
    manifest.write_text(text.replace('"step": 30', '"step": 70'))
    with pytest.raises(CheckpointError, match=r"manifest\.json' does not match its digest"):
        read_checkpoint(run / "ckpt-00000030")
    _restore_warns(run, caplog, 20, "does not match its digest")


def test_a_missing_digest_file_is_named(tmp_path: Path) -> None:
    run = _train_dir(tmp_path, (10,))
    (run / "ckpt-00000010" / DIGEST_NAME).unlink()
    with pytest.raises(CheckpointError, match=r"has no manifest\.sha256"):
        read_checkpoint(run / "ckpt-00000010")


def test_a_checkpoint_that_predates_manifest_digests_is_read_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _train_dir(tmp_path, (10,))
    ckpt = run / "ckpt-00000010"
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    manifest["format"] = "towerflow.checkpoint/1"
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
    (ckpt / DIGEST_NAME).unlink()
    with caplog.at_level(logging.WARNING, logger="towerflow.checkpoint"):
        assert read_checkpoint(ckpt).step == 10
    assert "predates manifest digests" in caplog.text
    # the legacy form is no way around the digest for a checkpoint of the current format
    manifest["format"] = "towerflow.checkpoint/2"
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
    with pytest.raises(CheckpointError, match=r"has no manifest\.sha256, so its manifest cannot"):
        read_checkpoint(ckpt)


def _flip_each_bit(path: Path, read) -> list[int]:
    """Flip every bit of ``path`` in turn; return the bit positions ``read`` accepted."""
    original = path.read_bytes()
    missed = []
    try:
        for bit in range(len(original) * 8):
            damaged = bytearray(original)
            damaged[bit // 8] ^= 1 << (bit % 8)
            path.write_bytes(bytes(damaged))
            try:
                read()
            except CheckpointError:
                continue
            missed.append(bit)
    finally:
        path.write_bytes(original)
    return missed


def test_every_single_bit_flip_of_manifest_digest_or_data_is_detected(tmp_path: Path) -> None:
    ckpt = write_checkpoint_dir(tmp_path / "ckpt-00000030", 30,
                                {"model": {"w": torch.arange(3.0)}}, {"lr": 0.5, "tag": "x"})
    for name in (MANIFEST_NAME, DIGEST_NAME, "model.safetensors"):
        assert _flip_each_bit(ckpt / name, lambda: read_checkpoint(ckpt)) == [], name
    assert read_checkpoint(ckpt).step == 30


def test_every_checkpoint_damaged_is_a_checkpoint_error_naming_each(tmp_path: Path) -> None:
    run = _train_dir(tmp_path, (10, 20))
    for name in ("ckpt-00000010", "ckpt-00000020"):
        (run / name / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"(?s)Every checkpoint in .*run.* is damaged.*"
                       r"ckpt-00000020.*ckpt-00000010"):
        latest_checkpoint(run)
    with pytest.raises(CheckpointError, match=r"Every checkpoint"):
        read_checkpoint(run)


def test_a_resumed_run_continues_from_the_last_good_step_not_an_edited_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from towerflow.strategies.single import SingleDevice
    from towerflow.training import TrainConfig, run_training

    def train(max_steps: int) -> None:
        run_training("digits", TrainConfig(train_dir=tmp_path, max_steps=max_steps, batch_size=16,
                                           log_every=10 ** 6, summary_every=0,
                                           checkpoint_every=2),
                     strategy=SingleDevice("/cpu:0"))

    train(6)
    manifest = tmp_path / "ckpt-00000006" / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace('"step": 6', '"step": 9'))
    with caplog.at_level(logging.INFO):
        train(8)
    assert re.search(r"ckpt-00000006/manifest\.json' does not match its digest", caplog.text)
    assert re.search(r"restored .*ckpt-00000004 at step 4", caplog.text)
    assert read_checkpoint(tmp_path / "ckpt-00000008").step == 8


def test_a_symlink_planted_where_a_save_writes_is_replaced_and_its_target_untouched(
    tmp_path: Path,
) -> None:
    run = _train_dir(tmp_path, (10,))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    (run / "ckpt-00000020").symlink_to(victim, target_is_directory=True)
    (run / "ckpt-00000030").symlink_to(tmp_path / "nowhere")  # dangling
    (run / "latest").unlink()
    (run / "latest").symlink_to(victim / "precious")
    mgr = CheckpointManager(run, max_to_keep=None)
    for step in (20, 30):
        path = mgr.save(step, {"model": {"w": torch.full((3,), float(step))}})
        assert path.is_dir() and not path.is_symlink()
    assert not (run / "latest").is_symlink() and (run / "latest").read_text() == "ckpt-00000030\n"
    assert sorted(os.listdir(victim)) == ["precious"]
    assert (victim / "precious").read_text() == "keep me"
    assert sorted(os.listdir(run)) == ["ckpt-00000010", "ckpt-00000020", "ckpt-00000030", "latest"]
    assert mgr.restore().step == 30


def test_pruning_a_symlinked_checkpoint_removes_the_link_not_what_it_points_to(
    tmp_path: Path,
) -> None:
    run = _train_dir(tmp_path, (10,))
    victim = tmp_path / "victim"
    shutil.copytree(run / "ckpt-00000010", victim)
    (run / "ckpt-00000005").symlink_to(victim, target_is_directory=True)
    mgr = CheckpointManager(run, max_to_keep=2)
    mgr.save(20, {"model": {"w": torch.ones(3)}})
    assert sorted(os.listdir(run)) == ["ckpt-00000010", "ckpt-00000020", "latest"]
    assert sorted(os.listdir(victim)) == ["manifest.json", "manifest.sha256", "model.safetensors"]


def test_a_bool_tensor_holding_another_byte_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save

    from towerflow.checkpoint.data_file import to_tensors

    data = bytearray(save({"mask": torch.tensor([True, False, True])}))
    assert data[-3:] == b"\x01\x00\x01"
    to_tensors(tmp_path / "m.safetensors", bytes(data), torch.device("cpu"))
    data[-2] = 2
    with pytest.raises(CheckpointError, match=r"bool tensor 'mask' holds a byte other than 0 or "
                                              r"1; it is corrupt, restore an earlier checkpoint"):
        to_tensors(tmp_path / "m.safetensors", bytes(data), torch.device("cpu"))


def test_a_file_of_too_many_tensors_is_refused_before_they_are_built(tmp_path: Path) -> None:
    from towerflow.checkpoint.data_file import MAX_TENSORS, check_file, entry_problem

    count = MAX_TENSORS + 10
    header = json.dumps({f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
                         for i in range(count)}).encode()
    data = len(header).to_bytes(8, "little") + header
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
             "tensors": {f"t{i}": {"dtype": "float32", "shape": [0]} for i in range(count)}}
    assert entry_problem("model.safetensors", entry) == (
        f"its entry for 'model.safetensors' lists {count:,} tensors, more than {MAX_TENSORS:,}")
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"holds {count:,} tensors, more than "
                                              rf"{MAX_TENSORS:,}; it is corrupt"):
        check_file(tmp_path / "model.safetensors", data, entry, verify=True)
    assert time.monotonic() - started < 5
