"""CIFAR-10 in its binary format, downloaded and verified when absent.

The binary version of CIFAR-10 (what the TensorFlow tutorial reads) is six
files of fixed-size records::

    cifar-10-batches-bin/data_batch_1.bin ... data_batch_5.bin   training, 50 000 images
    cifar-10-batches-bin/test_batch.bin                          test, 10 000 images

Each record is 3073 bytes: one label byte (0..9) then 3072 pixel bytes, the
red, green and blue 32x32 planes in turn — exactly an NCHW uint8 image.

:func:`load_cifar10` looks for the files under ``data_dir`` or
``data_dir/cifar-10-batches-bin``; when they are absent it downloads the
archive, checks its MD5 against the published digest, and extracts it,
refusing members that would land outside ``data_dir``.
"""

from __future__ import annotations

import logging
import tarfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from towerflow.data.dataset import Dataset
from towerflow.data.fetch import fetch_url, md5_of
from towerflow.errors import DataLossError, InvalidArgumentError, NotFoundError

__all__ = [
    "ARCHIVE_NAME",
    "CIFAR10_MD5",
    "CIFAR10_URL",
    "RECORD_BYTES",
    "download_cifar10",
    "load_cifar10",
    "read_batch_file",
    "synthetic_cifar10",
    "write_batch_file",
]

logger = logging.getLogger("towerflow.data")

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
# how the messages name the way out, in the library and on the command line
_NO_FETCH = "download=False, or --no-download"
_SYNTHETIC = "synthetic_cifar10(), or --data synthetic"
CIFAR10_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
ARCHIVE_NAME = "cifar-10-binary.tar.gz"
SUBDIR = "cifar-10-batches-bin"
NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
RECORD_BYTES = 1 + 3 * 32 * 32
SPLIT_FILES: dict[str, tuple[str, ...]] = {
    "train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
    "test": ("test_batch.bin",),
}


def read_batch_file(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one binary batch file.

    Returns:
        ``(images, labels)``: uint8 ``(N, 3, 32, 32)`` and int64 ``(N,)``.

    Raises:
        DataLossError: the size is not a whole number of records, or a label
            is not 0..9 (the message names the file).
    """
    path = Path(path)
    data = np.fromfile(path, dtype=np.uint8)  # one writable copy of the file, no more
    if len(data) == 0 or len(data) % RECORD_BYTES:
        raise DataLossError(
            f"CIFAR-10 file {str(path)!r} has {len(data)} bytes, not a positive multiple of the "
            f"{RECORD_BYTES}-byte record; it is truncated or not CIFAR-10 binary data, delete it "
            "to download it again."
        )
    records = torch.from_numpy(data).view(-1, RECORD_BYTES)
    labels = records[:, 0].to(torch.int64)
    if int(labels.max()) >= NUM_CLASSES:
        raise DataLossError(
            f"CIFAR-10 file {str(path)!r} has a label {int(labels.max())} outside 0..9; it is corrupt."
        )
    images = records[:, 1:].reshape(-1, *IMAGE_SHAPE).contiguous()  # the pixels, copied once
    return images, labels


def write_batch_file(path: str | Path, images: torch.Tensor, labels: torch.Tensor) -> None:
    """Write images and labels as a CIFAR-10 binary batch file.

    Args:
        path: The file to write.
        images: uint8 ``(N, 3, 32, 32)``.
        labels: integers 0..9, ``(N,)``.
    """
    if images.dtype != torch.uint8 or tuple(images.shape[1:]) != IMAGE_SHAPE:
        raise InvalidArgumentError(
            f"CIFAR-10 images must be uint8 (N, 3, 32, 32), got {images.dtype} {list(images.shape)}."
        )
    records = torch.cat([labels.to(torch.uint8).reshape(-1, 1), images.reshape(len(images), -1)], 1)
    Path(path).write_bytes(records.contiguous().numpy().tobytes())


def synthetic_cifar10(num_examples: int, seed: int = 0) -> Dataset:
    """Random CIFAR-10-shaped data, the same for the same seed (for speed runs).

    Example:
        >>> ds = synthetic_cifar10(4, seed=1)
        >>> ds.images.shape, ds.images.dtype, ds.num_classes
        (torch.Size([4, 3, 32, 32]), torch.uint8, 10)
    """
    if num_examples < 1:
        raise InvalidArgumentError(f"num_examples={num_examples} must be at least 1.")
    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (num_examples, *IMAGE_SHAPE), generator=gen, dtype=torch.uint8)
    labels = torch.randint(0, NUM_CLASSES, (num_examples,), generator=gen, dtype=torch.int64)
    return Dataset(images, labels, NUM_CLASSES)


def _find_files(data_dir: Path, files: Sequence[str]) -> list[Path] | None:
    for base in (data_dir, data_dir / SUBDIR):
        paths = [base / name for name in files]
        if all(p.is_file() for p in paths):
            return paths
    return None


def _check_md5(path: Path, md5: str) -> None:
    actual = md5_of(path)
    if actual != md5:
        path.unlink(missing_ok=True)
        raise DataLossError(
            f"Downloaded file {str(path)!r} has MD5 {actual}, expected {md5}; it was deleted, "
            "download it again (or check the URL)."
        )


def _safe_members(archive: tarfile.TarFile, archive_path: Path) -> list[tarfile.TarInfo]:
    members = []
    for member in archive.getmembers():
        name = PurePosixPath(member.name)
        if name.is_absolute() or ".." in name.parts or not (member.isfile() or member.isdir()):
            raise DataLossError(
                f"Archive {str(archive_path)!r} has an unsafe member {member.name!r} (absolute, "
                "escaping with '..', or a link); refusing to extract it."
            )
        members.append(member)
    return members


def _extract(archive_path: Path, data_dir: Path) -> None:
    try:
        with tarfile.open(archive_path, "r:*") as archive:
            members = _safe_members(archive, archive_path)
            archive.extractall(data_dir, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise DataLossError(
            f"Archive {str(archive_path)!r} cannot be extracted ({exc}); delete it to download it again."
        ) from exc


def download_cifar10(
    data_dir: str | Path, *, url: str = CIFAR10_URL, md5: str = CIFAR10_MD5, timeout: float = 60.0
) -> Path:
    """Download the CIFAR-10 binary archive into ``data_dir``, verify and extract it.

    An archive already in ``data_dir`` is verified and reused.

    Returns:
        The extracted ``cifar-10-batches-bin`` directory.

    Raises:
        UnavailableError: the download failed.
        DataLossError: the MD5 does not match (the bad file is deleted) or the
            archive is corrupt or unsafe.
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    archive = data_dir / ARCHIVE_NAME
    if not archive.is_file():
        fetch_url(url, archive, what="CIFAR-10", timeout=timeout, way_out=(
            f"check the network, put the binary files in {str(data_dir)!r} yourself "
            f"({_NO_FETCH} then reads only them), or train on random images of the same shape "
            f"({_SYNTHETIC})."))
    _check_md5(archive, md5)
    _extract(archive, data_dir)
    return data_dir / SUBDIR


def load_cifar10(
    data_dir: str | Path,
    split: str = "train",
    *,
    download: bool = True,
    url: str = CIFAR10_URL,
    md5: str = CIFAR10_MD5,
) -> Dataset:
    """Load a CIFAR-10 split from the binary files under ``data_dir``.

    Args:
        data_dir: Holds the ``.bin`` files, directly or in ``cifar-10-batches-bin``.
        split: ``"train"`` (data_batch_1..5) or ``"test"`` (test_batch).
        download: Fetch, verify and extract the archive when the files are absent.
        url: Where to download from.
        md5: The archive's expected MD5.

    Raises:
        InvalidArgumentError: an unknown split.
        NotFoundError: files absent and ``download`` is False.
        DataLossError: a file is not whole records, or the download is corrupt.
    """
    if split not in SPLIT_FILES:
        raise InvalidArgumentError(f"CIFAR-10 split {split!r} does not exist; use 'train' or 'test'.")
    data_dir = Path(data_dir)
    files = SPLIT_FILES[split]
    paths = _find_files(data_dir, files)
    if paths is None:
        if not download:
            raise NotFoundError(
                f"CIFAR-10 {split} files {', '.join(files)} are not in {str(data_dir)!r} nor in its "
                f"{SUBDIR} folder; pass download=True (on the command line: leave out "
                f"--no-download) to fetch them, copy them there, or train on random images of "
                f"the same shape ({_SYNTHETIC})."
            )
        download_cifar10(data_dir, url=url, md5=md5)
        paths = _find_files(data_dir, files)
        if paths is None:
            raise DataLossError(
                f"The archive from {url} did not contain the CIFAR-10 {split} files {', '.join(files)}."
            )
    parts = [read_batch_file(p) for p in paths]
    images = torch.cat([im for im, _ in parts]) if len(parts) > 1 else parts[0][0]
    labels = torch.cat([lb for _, lb in parts]) if len(parts) > 1 else parts[0][1]
    logger.debug("Read %d CIFAR-10 %s images from %s", len(labels), split, paths[0].parent)
    return Dataset(images, labels, NUM_CLASSES)
