"""Chunked groups: written part by part, every part covered by the manifest's digest."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from towerflow.checkpoint import CheckpointManager, latest_checkpoint, read_checkpoint
from towerflow.checkpoint.chunked import FORMAT_CHUNKED, ChunkedGroup, part_name
from towerflow.checkpoint.format import (
    FORMAT,
    MANIFEST_NAME,
    read_manifest,
    verify_checkpoint,
    write_checkpoint_dir,
)
from towerflow.errors import CheckpointError, InvalidArgumentError, UnavailableError

MODEL = {"w": torch.arange(4.0)}


def parts(count: int, rows: int = 3, *, produced: list[int] | None = None):
    for i in range(count):
        if produced is not None:
            produced.append(i)
        yield {"index": i, "label": f"p{i}"}, {
            "ids": torch.arange(i * rows, (i + 1) * rows, dtype=torch.int64),
            "rows": torch.full((rows, 2), float(i)),
        }


def test_parts_round_trip_one_at_a_time_in_order(tmp_path: Path) -> None:
    produced: list[int] = []
    path = write_checkpoint_dir(tmp_path / "c", 5, {
        "model": MODEL, "big": ChunkedGroup(parts(4, produced=produced))})
    assert produced == [0, 1, 2, 3]
    manifest = read_manifest(path)
    assert manifest["format"] == FORMAT_CHUNKED
    assert list(manifest["chunked"]["big"]) == [part_name("big", i) for i in range(4)]
    assert manifest["chunked"]["big"][part_name("big", 2)]["info"] == {"index": 2, "label": "p2"}
    ckpt = read_checkpoint(path)
    assert list(ckpt.groups) == ["model"]  # a chunked group is never loaded whole
    reader = ckpt.chunked["big"]
    assert len(reader) == 4 and [i["index"] for i in reader.infos] == [0, 1, 2, 3]
    seen = []
    for info, tensors in reader.parts():
        assert tensors["rows"].eq(float(info["index"])).all()
        seen.append(tensors["ids"].tolist())
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_a_checkpoint_without_chunked_groups_keeps_format_2(tmp_path: Path) -> None:
    path = write_checkpoint_dir(tmp_path / "c", 1, {"model": MODEL})
    manifest = read_manifest(path)
    assert manifest["format"] == FORMAT and "chunked" not in manifest
    assert read_checkpoint(path).chunked == {}


def test_an_empty_chunked_group_round_trips(tmp_path: Path) -> None:
    path = write_checkpoint_dir(tmp_path / "c", 1, {"model": MODEL, "big": ChunkedGroup([])})
    reader = read_checkpoint(path).chunked["big"]
    assert len(reader) == 0 and list(reader.parts()) == []


def test_a_failure_while_producing_parts_leaves_no_checkpoint(tmp_path: Path) -> None:
    def failing():
        yield from parts(2)
        raise UnavailableError("ps task 1 went away")

    run = tmp_path / "run"
    manager = CheckpointManager(run)
    manager.save(1, {"model": MODEL, "big": ChunkedGroup(parts(1))})
    with pytest.raises(UnavailableError, match="went away"):
        manager.save(2, {"model": MODEL, "big": ChunkedGroup(failing())})
    assert [p.name for p in manager.checkpoints()] == ["ckpt-00000001"]
    assert sorted(p.name for p in run.iterdir()) == ["ckpt-00000001", "latest"]


def _damage(path: Path, index: int, how: str) -> Path:
    target = path / part_name("big", index)
    if how == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0x01
        target.write_bytes(bytes(data))
    elif how == "truncate":
        target.write_bytes(target.read_bytes()[:-4])
    else:
        target.unlink()
    return target


@pytest.mark.parametrize("how, message", [
    ("flip", r"fails its checksum"),
    ("truncate", r"has \d+ bytes, the manifest says \d+"),
    ("remove", r"listed in the manifest is missing"),
])
def test_a_damaged_part_makes_the_checkpoint_damaged(tmp_path: Path, caplog, how, message
                                                     ) -> None:
    run = tmp_path / "run"
    manager = CheckpointManager(run, max_to_keep=None)
    for step in (10, 20):
        manager.save(step, {"model": {"w": torch.full((2,), float(step))},
                            "big": ChunkedGroup(parts(3))})
    newest = run / "ckpt-00000020"
    target = _damage(newest, 1, how)
    pattern = rf"{target.name}.*{message}"
    with pytest.raises(CheckpointError, match=pattern):
        read_checkpoint(newest)
    with pytest.raises(CheckpointError, match=pattern):
        verify_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger="towerflow.checkpoint"):
        ckpt = manager.restore()
    assert ckpt.step == 10 and ckpt.groups["model"]["w"].tolist() == [10.0, 10.0]
    assert "Skipping damaged checkpoint" in caplog.text and target.name in caplog.text
    assert latest_checkpoint(run) == run / "ckpt-00000010"


def test_a_part_damaged_after_the_checkpoint_was_read_is_refused_when_read(tmp_path: Path
                                                                           ) -> None:
    path = write_checkpoint_dir(tmp_path / "c", 1, {"model": MODEL, "big": ChunkedGroup(parts(3))})
    reader = read_checkpoint(path).chunked["big"]
    _damage(path, 2, "flip")
    got = []
    with pytest.raises(CheckpointError, match=r"big-00002\.safetensors.*fails its checksum"):
        for info, _ in reader.parts():
            got.append(info["index"])
    assert got == [0, 1]


def test_a_manifest_listing_parts_out_of_order_is_refused(tmp_path: Path) -> None:
    path = write_checkpoint_dir(tmp_path / "c", 1, {"model": MODEL, "big": ChunkedGroup(parts(2))})
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    entries = manifest["chunked"]["big"]
    manifest["chunked"]["big"] = dict(reversed(list(entries.items())))
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    import hashlib

    digest = hashlib.sha256((path / MANIFEST_NAME).read_bytes()).hexdigest()
    (path / "manifest.sha256").write_text(f"{digest}  {MANIFEST_NAME}\n")
    with pytest.raises(CheckpointError, match=r"chunked group 'big' lists 'big-00001"
                                              r"\.safetensors' as part 0"):
        read_checkpoint(path)


def test_bad_parts_and_clashing_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"Part 0 of chunked group 'big' has info of "
                                                   r"type list"):
        write_checkpoint_dir(tmp_path / "a", 1, {"model": MODEL,
                                                 "big": ChunkedGroup([([], MODEL)])})
    with pytest.raises(InvalidArgumentError, match=r"info of part 0 .* is not plain JSON"):
        write_checkpoint_dir(tmp_path / "b", 1, {"model": MODEL,
                                                 "big": ChunkedGroup([({"x": {1, 2}}, MODEL)])})
    with pytest.raises(InvalidArgumentError, match=r"yields \(info, tensors\) pairs"):
        write_checkpoint_dir(tmp_path / "c", 1, {"model": MODEL, "big": ChunkedGroup([MODEL])})
    with pytest.raises(InvalidArgumentError, match=r"groups clash: part 0 of chunked group 'big' "
                                                   r"would be 'big-00000\.safetensors'"):
        write_checkpoint_dir(tmp_path / "d", 1, {"big-00000": MODEL, "big": ChunkedGroup(parts(1))})
    with pytest.raises(InvalidArgumentError, match=r"needs a group of tensors besides"):
        write_checkpoint_dir(tmp_path / "e", 1, {"big": ChunkedGroup(parts(1))})
    assert not any(p.name in "abcde" for p in tmp_path.iterdir())
