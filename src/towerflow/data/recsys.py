"""Recommendation data in memory: categorical id fields, dense features, 0/1 labels.

:class:`FieldData` is what the MovieLens and Criteo readers
(:mod:`towerflow.data.movielens`, :mod:`towerflow.data.criteo`) produce: one
int64 tensor of ids per categorical field (``(N,)``, or ``(N, L)`` for a
field of several ids per example padded with id 0), float32 dense features
``(N, D)`` and float32 0/1 labels ``(N,)``, with each field's table rows
(ids are ``0 .. rows - 1``). :class:`FieldBatches` is one replica's
endless, resumable, sharded stream of training batches of it, each batch
``(fields, dense, labels)``, the batch a model such as
:class:`towerflow.models.deepfm.DeepFM` and its loss take.

Example:
    >>> import torch
    >>> data = FieldData(("user",), (torch.tensor([1, 2, 3, 1]),), {"user": 4},
    ...                  torch.zeros(4, 0), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    >>> len(data), data.rows
    (4, (4,))
    >>> fields, dense, labels = next(iter(FieldBatches(data, batch_size=2, seed=0)))
    >>> tuple(fields[0].shape), tuple(labels.shape)
    ((2,), (2,))
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from towerflow.data.fetch import fetch_url, md5_of
from towerflow.data.sampler import ShardedBatches
from towerflow.errors import DataLossError, InvalidArgumentError

__all__ = ["FieldData", "FieldBatches", "RecsysBatch", "bad_row", "download_zip", "time_split"]

logger = logging.getLogger(__name__)

#: a batch: one id tensor per field, the dense features, the 0/1 labels
RecsysBatch = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class FieldData:
    """Examples of categorical id fields, dense features and 0/1 labels, as CPU tensors.

    Attributes:
        names: the categorical fields, in the order of ``fields``.
        fields: int64 ids per field: ``(N,)``, or ``(N, L)`` for a field of
            several ids per example (0 pads, and is no value).
        field_rows: rows of each field's table by name (its ids are below).
        dense: float32 ``(N, D)`` dense features (``D`` may be 0).
        labels: float32 ``(N,)`` 0/1 labels.
    """

    names: tuple[str, ...]
    fields: tuple[torch.Tensor, ...]
    field_rows: Mapping[str, int]
    dense: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        n = len(self.labels)
        if len(self.names) != len(self.fields) or set(self.names) != set(self.field_rows):
            raise InvalidArgumentError(f"FieldData: fields {list(self.names)} need one id "
                                       f"tensor and one row count each, got {len(self.fields)} "
                                       f"tensors and rows for {sorted(self.field_rows)}.")
        for name, ids in zip(self.names, self.fields, strict=True):
            if ids.dtype != torch.int64 or ids.shape[:1] != (n,) or ids.dim() > 2:
                raise InvalidArgumentError(f"FieldData: field {name!r} must be int64 ({n},) or "
                                           f"({n}, L), got {ids.dtype} {list(ids.shape)}.")
        if self.dense.dim() != 2 or len(self.dense) != n:
            raise InvalidArgumentError(f"FieldData: dense features must be ({n}, D), got "
                                       f"{list(self.dense.shape)}.")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def rows(self) -> tuple[int, ...]:
        """Each field's table rows, in the order of :attr:`fields`."""
        return tuple(int(self.field_rows[name]) for name in self.names)

    def take(self, index: torch.Tensor | slice) -> FieldData:
        """The examples at ``index`` (a slice or int64 positions)."""
        return FieldData(self.names, tuple(f[index] for f in self.fields), self.field_rows,
                         self.dense[index], self.labels[index])

    def batch(self, index: torch.Tensor | slice) -> RecsysBatch:
        """The examples at ``index`` as a model's batch ``(fields, dense, labels)``."""
        part = self.take(index)
        return list(part.fields), part.dense, part.labels


def time_split(timestamps: torch.Tensor, split: str, test_fraction: float) -> torch.Tensor:
    """Positions of the ``train`` or ``test`` examples: the last ``test_fraction`` by time is test.

    Ties in time keep the files' order (a stable sort), so the split is the
    same on every read.

    Example:
        >>> time_split(torch.tensor([5, 1, 4, 2, 3]), "test", 0.2).tolist()
        [0]
    """
    if split not in ("train", "test"):
        raise InvalidArgumentError(f"Split {split!r} does not exist; use 'train' or 'test'.")
    if not 0.0 < test_fraction < 1.0:
        raise InvalidArgumentError(f"test_fraction={test_fraction} must be strictly between 0 "
                                   "and 1.")
    order = torch.sort(timestamps, stable=True).indices
    cut = len(order) - max(1, round(len(order) * test_fraction))
    return order[:cut] if split == "train" else order[cut:]


def bad_row(path: Path, line: int, what: str, way_out: str) -> DataLossError:
    """The error for a row a reader refuses: the file, the line (1-based), what is wrong."""
    return DataLossError(f"{path}, line {line}: {what}; {way_out}")


class FieldBatches:
    """One replica's endless, resumable batches ``(fields, dense, labels)`` of a FieldData.

    The order is :class:`~towerflow.data.ShardedBatches`' (a permutation per
    epoch from the seed; replica ``rank`` of ``world_size`` takes its own share),
    so :meth:`state` / :meth:`load_state` resume exactly where a run stopped.
    """

    def __init__(self, data: FieldData, *, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        self.data = data
        self.seed = seed
        self._batches = ShardedBatches(len(data), batch_size, rank=rank, world_size=world_size,
                                       seed=seed)

    def for_replica(self, rank: int, world_size: int, *, batch_size: int) -> FieldBatches:
        """The same data's batches for replica ``rank`` of ``world_size`` (from the start)."""
        return FieldBatches(self.data, batch_size=batch_size, seed=self.seed, rank=rank,
                            world_size=world_size)

    def __iter__(self) -> Iterator[RecsysBatch]:
        for index in self._batches:
            yield self.data.batch(index)

    def state(self) -> dict[str, int]:
        """The position (epoch, batches taken in it)."""
        return self._batches.state()

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Go back to a position :meth:`state` returned."""
        self._batches.load_state(state)


def download_zip(url: str, md5: str, data_dir: Path, *, what: str, way_out: str,
                 timeout: float = 60.0) -> None:
    """Fetch the zip archive at ``url`` into ``data_dir``, check its MD5 and extract it there.

    An archive already in ``data_dir`` is checked and reused.

    Raises:
        UnavailableError: the download failed (``way_out`` says what else to do).
        DataLossError: the MD5 differs (the file is deleted), or the archive is
            corrupt or has a member that would land outside ``data_dir``.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    archive = data_dir / PurePosixPath(url).name
    if not archive.is_file():
        fetch_url(url, archive, what=what, way_out=way_out, timeout=timeout)
    actual = md5_of(archive)
    if actual != md5:
        archive.unlink(missing_ok=True)
        raise DataLossError(f"Downloaded file {str(archive)!r} has MD5 {actual}, expected {md5}; "
                            "it was deleted, download it again (or check the URL).")
    try:
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                parts = PurePosixPath(name).parts
                if PurePosixPath(name).is_absolute() or ".." in parts:
                    raise DataLossError(f"Archive {str(archive)!r} has an unsafe member {name!r}; "
                                        "refusing to extract it.")
            zf.extractall(data_dir)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DataLossError(f"Archive {str(archive)!r} cannot be extracted ({exc}); delete it to "
                            "download it again.") from exc
