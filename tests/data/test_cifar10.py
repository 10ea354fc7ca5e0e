"""CIFAR-10 binary reader, download with checksum, safe extraction, synthetic data."""

from __future__ import annotations

import hashlib
import http.server
import io
import tarfile
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import torch

from towerflow.data import load_cifar10, read_batch_file, synthetic_cifar10, write_batch_file
from towerflow.data.cifar10 import ARCHIVE_NAME, RECORD_BYTES
from towerflow.errors import DataLossError, InvalidArgumentError, NotFoundError, UnavailableError


def _record(label: int, seed: int) -> bytes:
    """One record laid out by hand: label byte, then the R, G and B 32x32 planes."""
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (3 * 32 * 32,), generator=gen, dtype=torch.uint8)
    return bytes([label]) + bytes(pixels.tolist())


def _write_split_files(directory: Path, per_file: int = 2) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for f, name in enumerate(names):
        records = [_record((f + r) % 10, seed=100 * f + r) for r in range(per_file)]
        (directory / name).write_bytes(b"".join(records))


def test_reader_maps_label_byte_and_rgb_planes_to_nchw(tmp_path: Path) -> None:
    raw = _record(7, seed=1) + _record(3, seed=2)
    (tmp_path / "test_batch.bin").write_bytes(raw)
    images, labels = read_batch_file(tmp_path / "test_batch.bin")
    assert images.dtype == torch.uint8 and images.shape == (2, 3, 32, 32)
    assert labels.tolist() == [7, 3] and labels.dtype == torch.int64
    # pixel (channel c, row y, column x) of record r is byte r*3073 + 1 + c*1024 + y*32 + x
    for r, c, y, x in [(0, 0, 0, 0), (0, 1, 5, 9), (1, 2, 31, 31), (1, 0, 17, 3)]:
        assert images[r, c, y, x].item() == raw[r * RECORD_BYTES + 1 + c * 1024 + y * 32 + x]


def test_writer_produces_the_binary_format(tmp_path: Path) -> None:
    raw = _record(4, seed=3) + _record(9, seed=4)
    (tmp_path / "one.bin").write_bytes(raw)
    images, labels = read_batch_file(tmp_path / "one.bin")
    write_batch_file(tmp_path / "again.bin", images, labels)
    assert (tmp_path / "again.bin").read_bytes() == raw


@pytest.mark.parametrize("subdir", ["", "cifar-10-batches-bin"])
def test_load_reads_both_splits_from_data_dir_or_its_subfolder(tmp_path: Path, subdir: str) -> None:
    _write_split_files(tmp_path / subdir, per_file=2)
    train = load_cifar10(tmp_path, "train", download=False)
    test = load_cifar10(tmp_path, "test", download=False)
    assert train.images.shape == (10, 3, 32, 32) and len(test) == 2
    assert train.labels.tolist() == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5]
    assert test.num_classes == 10


def test_file_of_the_wrong_size_is_data_loss_naming_it(tmp_path: Path) -> None:
    _write_split_files(tmp_path)
    bad = tmp_path / "data_batch_3.bin"
    bad.write_bytes(bad.read_bytes()[:-1])
    with pytest.raises(DataLossError, match=r"data_batch_3\.bin' has 6145 bytes, not a positive multiple of the 3073"):
        load_cifar10(tmp_path, download=False)


def test_label_out_of_range_is_data_loss(tmp_path: Path) -> None:
    (tmp_path / "test_batch.bin").write_bytes(_record(12, seed=0))
    with pytest.raises(DataLossError, match=r"test_batch\.bin' has a label 12 outside 0\.\.9"):
        load_cifar10(tmp_path, "test", download=False)


def test_missing_files_without_download_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match=r"test_batch\.bin are not in .* pass download=True"):
        load_cifar10(tmp_path, "test", download=False)


def test_unknown_split_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"split 'validation' does not exist"):
        load_cifar10(tmp_path, "validation")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory served over HTTP on 127.0.0.1, and its base URL."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _archive(root: Path, members: dict[str, bytes]) -> str:
    with tarfile.open(root / ARCHIVE_NAME, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.md5((root / ARCHIVE_NAME).read_bytes()).hexdigest()


def _cifar_members() -> dict[str, bytes]:
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    return {f"cifar-10-batches-bin/{n}": _record(i, seed=i) for i, n in enumerate(names)}


def test_download_verifies_and_extracts_when_files_are_absent(
    tmp_path: Path, served: tuple[Path, str]
) -> None:
    root, base = served
    md5 = _archive(root, _cifar_members())
    data_dir = tmp_path / "data"
    test = load_cifar10(data_dir, "test", url=f"{base}/{ARCHIVE_NAME}", md5=md5)
    assert test.labels.tolist() == [5]
    assert (data_dir / ARCHIVE_NAME).is_file()
    assert (data_dir / "cifar-10-batches-bin" / "data_batch_1.bin").is_file()
    train = load_cifar10(data_dir, "train", download=False)
    assert train.labels.tolist() == [0, 1, 2, 3, 4]


def test_bad_checksum_is_data_loss_and_the_download_is_deleted(
    tmp_path: Path, served: tuple[Path, str]
) -> None:
    root, base = served
    actual = _archive(root, _cifar_members())
    data_dir = tmp_path / "data"
    wrong = "0" * 32
    with pytest.raises(DataLossError, match=rf"cifar-10-binary\.tar\.gz' has MD5 {actual}, expected {wrong}"):
        load_cifar10(data_dir, "test", url=f"{base}/{ARCHIVE_NAME}", md5=wrong)
    assert list(data_dir.iterdir()) == []


def test_archive_member_escaping_the_data_dir_is_refused(tmp_path: Path, served: tuple[Path, str]) -> None:
    root, base = served
    md5 = _archive(root, {"../escaped.bin": b"x", **_cifar_members()})
    data_dir = tmp_path / "data"
    with pytest.raises(DataLossError, match=r"unsafe member '\.\./escaped\.bin'"):
        load_cifar10(data_dir, "test", url=f"{base}/{ARCHIVE_NAME}", md5=md5)
    assert not (tmp_path / "escaped.bin").exists()
    assert not (data_dir / "cifar-10-batches-bin").exists()


def test_unreachable_url_is_unavailable(tmp_path: Path, free_ports: Callable[[int], list[int]]) -> None:
    (port,) = free_ports(1)
    with pytest.raises(UnavailableError, match=r"Cannot download CIFAR-10 from http://127\.0\.0\.1"):
        load_cifar10(tmp_path, "test", url=f"http://127.0.0.1:{port}/{ARCHIVE_NAME}")
    assert list(tmp_path.iterdir()) == []


def test_synthetic_data_is_deterministic_per_seed() -> None:
    a, b, c = synthetic_cifar10(16, seed=3), synthetic_cifar10(16, seed=3), synthetic_cifar10(16, seed=4)
    assert a.images.dtype == torch.uint8 and a.images.shape == (16, 3, 32, 32)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)
    assert int(a.labels.min()) >= 0 and int(a.labels.max()) <= 9
