"""The on-disk checkpoint format: round trips, manifest, corruption, atomic helpers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from towerflow.checkpoint.atomic import (
    FOREIGN_STALE_SECONDS,
    HOST_TAG,
    remove_stale_temps,
    temp_dir,
    temp_name,
    write_bytes_durable,
    write_file_atomic,
)
from towerflow.checkpoint.format import (
    DIGEST_NAME,
    FORMAT,
    MANIFEST_NAME,
    digest_line,
    read_manifest,
    verify_checkpoint,
    write_checkpoint_dir,
)
from towerflow.checkpoint.format import read_checkpoint_dir as read_checkpoint
from towerflow.errors import CheckpointError, DataLossError, InvalidArgumentError, NotFoundError


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "f32": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "f16": torch.tensor([1.5, -2.0], dtype=torch.float16),
        "bf16": torch.tensor([0.25, 3.0], dtype=torch.bfloat16),
        "f64": torch.tensor([1e-300], dtype=torch.float64),
        "i64": torch.tensor([2**40, -1]),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(7.0),
        "empty": torch.zeros(0, 4),
    }


def _write(tmp_path: Path, **groups: dict[str, torch.Tensor]) -> Path:
    return write_checkpoint_dir(tmp_path / "ckpt", 3, groups or {"model": _tensors()}, {"lr": 0.1})


def _edit_manifest(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a manifest and record its new digest, so that what follows the digest is tested."""
    mpath = path / MANIFEST_NAME
    manifest = json.loads(mpath.read_text())
    edit(manifest)
    mpath.write_text(json.dumps(manifest))
    (path / DIGEST_NAME).write_bytes(digest_line(mpath.read_bytes()))


def test_round_trip_preserves_values_dtypes_and_shapes(tmp_path: Path) -> None:
    ckpt = read_checkpoint(_write(tmp_path))
    assert ckpt.step == 3
    assert ckpt.metadata == {"lr": 0.1}
    loaded = ckpt.groups["model"]
    for name, tensor in _tensors().items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name


def test_manifest_records_step_checksums_sizes_dtypes_and_shapes(tmp_path: Path) -> None:
    path = _write(tmp_path)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["format"] == FORMAT
    assert manifest["step"] == 3
    entry = manifest["files"]["model.safetensors"]
    assert entry["bytes"] == (path / "model.safetensors").stat().st_size
    assert len(entry["sha256"]) == 64
    assert entry["tensors"]["f32"] == {"dtype": "float32", "shape": [2, 3]}
    assert entry["tensors"]["scalar"] == {"dtype": "float32", "shape": []}
    assert sorted(os.listdir(path)) == ["manifest.json", "manifest.sha256", "model.safetensors"]
    digest = hashlib.sha256((path / MANIFEST_NAME).read_bytes()).hexdigest()
    assert (path / DIGEST_NAME).read_text() == f"{digest}  manifest.json\n"


def test_views_sharing_storage_and_non_contiguous_tensors_are_saved(tmp_path: Path) -> None:
    flat = torch.arange(12, dtype=torch.float32)
    groups = {"model": {"a": flat[:6], "b": flat[6:], "t": flat.reshape(3, 4).t()}}
    loaded = read_checkpoint(write_checkpoint_dir(tmp_path / "c", 0, groups)).groups["model"]
    assert torch.equal(loaded["a"], flat[:6])
    assert torch.equal(loaded["b"], flat[6:])
    assert torch.equal(loaded["t"], flat.reshape(3, 4).t())


def test_several_groups_are_separate_files(tmp_path: Path) -> None:
    path = _write(tmp_path, model={"w": torch.ones(2)}, optimizer={"m": torch.zeros(2)})
    assert (path / "optimizer.safetensors").is_file()
    ckpt = read_checkpoint(path)
    assert set(ckpt.groups) == {"model", "optimizer"}


def test_flipped_byte_fails_the_checksum_naming_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path)
    fpath = path / "model.safetensors"
    data = bytearray(fpath.read_bytes())
    data[-3] ^= 0xFF
    fpath.write_bytes(bytes(data))
    with pytest.raises(DataLossError, match=r"model\.safetensors.*fails its checksum"):
        read_checkpoint(path)
    with pytest.raises(DataLossError, match=r"model\.safetensors.*checksum"):
        verify_checkpoint(path)


def test_truncated_file_is_detected_even_without_checksums(tmp_path: Path) -> None:
    path = _write(tmp_path)
    fpath = path / "model.safetensors"
    fpath.write_bytes(fpath.read_bytes()[:-10])
    with pytest.raises(DataLossError, match=r"model\.safetensors.*truncated"):
        read_checkpoint(path, verify=False)


def test_missing_file_and_missing_manifest_are_data_loss(tmp_path: Path) -> None:
    path = _write(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(DataLossError, match=r"model\.safetensors.*missing"):
        read_checkpoint(path)
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(DataLossError, match=r"no manifest\.json"):
        read_manifest(path)


def test_manifest_that_is_not_json_is_data_loss(tmp_path: Path) -> None:
    path = _write(tmp_path)
    (path / MANIFEST_NAME).write_text('{"format": "towerflow.checkpoint/2", "st')
    (path / DIGEST_NAME).write_bytes(digest_line((path / MANIFEST_NAME).read_bytes()))
    with pytest.raises(CheckpointError, match=r"manifest\.json.*not valid JSON"):
        read_checkpoint(path)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "1e999", "1" * 5000])
def test_manifest_numbers_json_cannot_hold_are_refused(tmp_path: Path, number: str) -> None:
    path = _write(tmp_path)
    text = (path / MANIFEST_NAME).read_text().replace('"lr": 0.1', f'"lr": {number}')
    (path / MANIFEST_NAME).write_text(text)
    (path / DIGEST_NAME).write_bytes(digest_line(text.encode()))
    with pytest.raises(CheckpointError, match=r"manifest\.json.*not valid JSON"):
        read_checkpoint(path)


def test_manifest_disagreeing_with_the_header_is_data_loss(tmp_path: Path) -> None:
    path = _write(tmp_path)
    _edit_manifest(path, lambda m: m["files"]["model.safetensors"]["tensors"]["f32"].update(shape=[3, 2]))
    with pytest.raises(DataLossError, match=r"tensor 'f32' is float32 \[2, 3\] but the manifest"):
        read_checkpoint(path)


def test_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path)

    def escape(manifest: dict[str, Any]) -> None:
        manifest["files"]["../escape.safetensors"] = manifest["files"].pop("model.safetensors")

    _edit_manifest(path, escape)
    with pytest.raises(DataLossError, match=r"entry for '\.\./escape\.safetensors' is malformed"):
        read_checkpoint(path)


def test_a_pickle_in_place_of_safetensors_is_refused_without_running_it(tmp_path: Path) -> None:
    path = _write(tmp_path)
    marker = tmp_path / "pwned"
    # A protocol-0 pickle that would call os.system if it were unpickled.
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    (path / "model.safetensors").write_bytes(payload)
    _edit_manifest(
        path,
        lambda m: m["files"]["model.safetensors"].update(
            sha256=hashlib.sha256(payload).hexdigest(), bytes=len(payload)
        ),
    )
    with pytest.raises(DataLossError, match=r"model\.safetensors"):
        read_checkpoint(path)
    assert not marker.exists()


def test_not_a_checkpoint_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match=r"No checkpoint found at .*nowhere"):
        read_checkpoint(tmp_path / "nowhere")


def test_metadata_must_be_plain_json(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"metadata is not plain JSON"):
        write_checkpoint_dir(tmp_path / "c", 0, {"model": {}}, {"bad": float("nan")})
    with pytest.raises(InvalidArgumentError, match=r"metadata is not plain JSON"):
        write_checkpoint_dir(tmp_path / "c", 0, {"model": {}}, {"bad": torch.ones(1)})
    assert not (tmp_path / "c").exists()


def test_group_names_values_and_steps_are_validated(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"group name '\.\./x' is not allowed"):
        write_checkpoint_dir(tmp_path / "c", 0, {"../x": {"w": torch.ones(1)}})
    with pytest.raises(InvalidArgumentError, match=r"'lr' in checkpoint group 'model' is a float"):
        write_checkpoint_dir(tmp_path / "c", 0, {"model": {"lr": 0.1}})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError, match=r"step -1 is not a non-negative integer"):
        write_checkpoint_dir(tmp_path / "c", -1, {"model": {}})
    assert os.listdir(tmp_path) == []


def test_rewriting_a_checkpoint_replaces_it_whole(tmp_path: Path) -> None:
    write_checkpoint_dir(tmp_path / "c", 1, {"model": {"w": torch.ones(2)}, "ema": {"w": torch.ones(2)}})
    write_checkpoint_dir(tmp_path / "c", 2, {"model": {"w": torch.zeros(3)}})
    ckpt = read_checkpoint(tmp_path / "c")
    assert ckpt.step == 2 and set(ckpt.groups) == {"model"}
    assert torch.equal(ckpt.groups["model"]["w"], torch.zeros(3))
    assert os.listdir(tmp_path) == ["c"]


def test_loads_go_to_torch_devices_and_refuse_other_names(tmp_path: Path) -> None:
    path = _write(tmp_path)
    for device in ("cpu", torch.device("cpu"), None):
        assert read_checkpoint(path, device=device).groups["model"]["f32"].device.type == "cpu"
    with pytest.raises(InvalidArgumentError, match=r"'/gpu:0' is not a torch device name.*"
                       r"towerflow\.resolve_device\('/gpu:0'\)"):
        read_checkpoint(path, device="/gpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match=r"'cuda:0' does not exist in this process"):
            read_checkpoint(path, device="cuda:0")


def test_write_file_atomic_replaces_content_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    write_file_atomic(target, "one\n")
    write_file_atomic(target, "two\n")
    assert target.read_text() == "two\n"
    assert os.listdir(tmp_path) == ["latest"]


def test_a_durable_write_never_writes_through_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "link").symlink_to(victim)
    (tmp_path / "dangling").symlink_to(tmp_path / "created-through-the-link")
    for name in ("link", "dangling"):
        with pytest.raises(FileExistsError):
            write_bytes_durable(tmp_path / name, b"payload")
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "created-through-the-link").exists()


def test_stale_temps_of_dead_writers_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True, timeout=60)
    dead_pid = int(child.stdout)
    live_pid = os.getppid()
    dead = tmp_path / f".tmp-ckpt-00000001-{HOST_TAG}-{dead_pid}-0badf00d"
    live = tmp_path / f".tmp-ckpt-00000002-{HOST_TAG}-{live_pid}-0badf00d"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    live.mkdir()
    (tmp_path / temp_name("latest")).write_text("x")  # ours, not in use: a leftover
    with temp_dir(tmp_path, "busy") as busy:
        removed = remove_stale_temps(tmp_path)
        assert busy.exists()
    assert dead.name in removed
    assert not dead.exists()
    assert live.exists()
    assert sorted(os.listdir(tmp_path)) == [live.name]


def test_temps_of_another_machine_are_removed_only_once_old(tmp_path: Path) -> None:
    other_host = "0" * 8 if HOST_TAG != "0" * 8 else "1" * 8
    fresh = tmp_path / f".tmp-ckpt-00000003-{other_host}-1-0badf00d"
    old = tmp_path / f".tmp-ckpt-00000002-{other_host}-1-0badf00d"
    fresh.mkdir()
    old.mkdir()
    long_ago = old.stat().st_mtime - FOREIGN_STALE_SECONDS - 60
    os.utime(old, (long_ago, long_ago))
    assert remove_stale_temps(tmp_path) == [old.name]
    assert fresh.exists()


def test_an_empty_group_round_trips(tmp_path: Path) -> None:
    groups = {"model": {"w": torch.ones(1)}, "optimizer": {}}
    ckpt = read_checkpoint(write_checkpoint_dir(tmp_path / "c", 0, groups))
    assert ckpt.groups["optimizer"] == {}
