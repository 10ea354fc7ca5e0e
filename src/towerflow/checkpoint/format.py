"""The on-disk checkpoint format: safetensors files plus a JSON manifest.

A checkpoint is a directory::

    ckpt-00001000/
        model.safetensors        one file per group of tensors
        optimizer.safetensors
        manifest.json            what the files hold
        manifest.sha256          the manifest's own digest

``manifest.json`` records the format, the step, the creation time, free JSON
metadata and, per file, its SHA-256, its size and the name, dtype and shape of
every tensor in it::

    {"format": "towerflow.checkpoint/2", "step": 1000, "created": 1700000000.0,
     "metadata": {...},
     "files": {"model.safetensors": {"sha256": "...", "bytes": 1234,
               "tensors": {"fc.weight": {"dtype": "float32", "shape": [10, 4]}}}}}

A group too large for memory may be a chunked group, written and read part
by part (format ``towerflow.checkpoint/3``: :mod:`towerflow.checkpoint.chunked`).

``manifest.sha256`` is one line in ``sha256sum`` form
(``<sha256 of manifest.json>  manifest.json``; ``sha256sum -c manifest.sha256``
checks it by hand). The digest covers the manifest, the manifest covers every
data file, so a change to any byte of a checkpoint — one flipped bit, a step
edited by hand — is detected. Checkpoints of the earlier format
(``towerflow.checkpoint/1``, no digest file) are still read, with a warning
that their manifest cannot be verified.

Reading never executes code and never reads outside the checkpoint
directory: the manifest is JSON of bounded size and depth, every file is
opened without following links and must be a regular file of the expected
size (:mod:`towerflow.checkpoint.files`), and tensors come from safetensors,
whose header is checked against the manifest before use. Any damage — a
digest, a checksum, a size, a dtype, a shape, a missing file, a link, a FIFO
— is a :class:`~towerflow.errors.CheckpointError` that names the file.

This module writes and reads one checkpoint directory as a whole; the
manifest and its digest are :mod:`towerflow.checkpoint.manifest`'s, one
group's file and its manifest entry :mod:`towerflow.checkpoint.data_file`'s,
and train dirs of numbered checkpoints :mod:`towerflow.checkpoint.manager`'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from towerflow.checkpoint.atomic import fsync_dir, remove_tree, temp_dir, write_bytes_durable
from towerflow.checkpoint.chunked import ChunkedGroup, ChunkedReader, scan_chunked, write_parts
from towerflow.checkpoint.data_file import (
    SUFFIX,
    as_torch_device,
    check_group_name,
    dtype_name,
    read_data_file,
    serialize_group,
    to_tensors,
)
from towerflow.checkpoint.files import open_dir
from towerflow.checkpoint.manifest import (
    DIGEST_NAME,
    FORMAT,
    LEGACY_FORMAT,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    check_step,
    digest_line,
    encode_manifest,
    load_manifest,
    read_manifest,
)
from towerflow.errors import InvalidArgumentError

__all__ = [
    "DIGEST_NAME",
    "FORMAT",
    "LEGACY_FORMAT",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "Checkpoint",
    "as_torch_device",
    "digest_line",
    "dtype_name",
    "read_checkpoint_dir",
    "read_manifest",
    "verify_checkpoint",
    "write_checkpoint_dir",
]


@dataclass(slots=True)
class Checkpoint:
    """A checkpoint read from disk.

    Attributes:
        path: The checkpoint directory.
        step: The training step it was written at.
        groups: Group name (``"model"``, ``"optimizer"``, ...) -> tensor name ->
            tensor, on the device asked for.
        metadata: The JSON metadata saved with it (schedule, data position, ...).
        chunked: Chunked group name -> a reader of its parts, one at a time
            (:mod:`towerflow.checkpoint.chunked`; verified, not loaded).
    """

    path: Path
    step: int
    groups: dict[str, dict[str, torch.Tensor]]
    metadata: dict[str, Any]
    chunked: dict[str, ChunkedReader] = field(default_factory=dict)


def _metadata_json(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    meta = dict(metadata or {})
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgumentError(
            f"Checkpoint metadata is not plain JSON ({exc}); keep it to dicts, lists, strings, "
            "finite numbers, booleans and None, and put tensors in a group."
        ) from exc
    return meta


def write_checkpoint_dir(
    target: str | Path,
    step: int,
    groups: Mapping[str, Mapping[str, torch.Tensor]],
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint directory at ``target`` atomically.

    Files go to a temporary sibling directory, each fsynced, the manifest and
    its digest last; the directory is then renamed to ``target`` (an existing
    one, or anything else by that name, is replaced) and the parent fsynced.
    A crash at any moment leaves either no ``target``, the old one, or the
    complete new one. A group given as a
    :class:`~towerflow.checkpoint.chunked.ChunkedGroup` is written part by
    part as it is produced; a failure while producing it leaves no ``target``.

    Returns:
        ``target`` as a Path.
    """
    target = Path(target)
    check_step(step)
    meta = _metadata_json(metadata)
    if not groups:
        raise InvalidArgumentError("A checkpoint needs at least one group of tensors, got none.")
    for group in groups:
        check_group_name(group)
    if all(isinstance(tensors, ChunkedGroup) for tensors in groups.values()):
        raise InvalidArgumentError("A checkpoint needs a group of tensors besides its chunked "
                                   "groups (e.g. 'model'), got none.")
    target.parent.mkdir(parents=True, exist_ok=True)
    with temp_dir(target.parent, target.name) as tmp:
        files: dict[str, Any] = {}
        chunked: dict[str, Any] = {}
        for group, tensors in groups.items():
            if isinstance(tensors, ChunkedGroup):
                taken = {f"{g}{SUFFIX}" for g in groups}
                chunked[group] = write_parts(tmp, group, tensors, taken)
                continue
            data, entry = serialize_group(group, tensors)
            write_bytes_durable(tmp / f"{group}{SUFFIX}", data)
            files[f"{group}{SUFFIX}"] = entry
            del data
        manifest = encode_manifest(step, meta, files, chunked)
        write_bytes_durable(tmp / MANIFEST_NAME, manifest)
        write_bytes_durable(tmp / DIGEST_NAME, digest_line(manifest))
        fsync_dir(tmp)
        if os.path.lexists(target):
            remove_tree(target)
        os.rename(tmp, target)
    fsync_dir(target.parent)
    return target


def verify_checkpoint(path: str | Path, *, follow_symlinks: bool = True) -> dict[str, Any]:
    """Check the manifest and every file of a checkpoint directory; return the manifest.

    Raises:
        NotFoundError: ``path`` is not a directory.
        CheckpointError: naming the first file that is missing, truncated,
            corrupt or not a regular file.
    """
    path = Path(path)
    with open_dir(path, follow_symlinks=follow_symlinks) as dir_fd:
        manifest = load_manifest(dir_fd, path)
        for fname, entry in manifest["files"].items():
            read_data_file(dir_fd, path, fname, entry, verify=True)
        scan_chunked(dir_fd, path, manifest, verify=True)
    return manifest


def read_checkpoint_dir(
    path: str | Path,
    device: str | torch.device | None = "cpu",
    verify: bool = True,
    *,
    follow_symlinks: bool = True,
) -> Checkpoint:
    """Read the checkpoint directory ``path`` onto ``device``.

    Args:
        path: A checkpoint directory (``.../ckpt-00001000`` or one written
            by ``towerflow.save``).
        device: Where the tensors go: a ``torch.device`` or a torch name
            (``"cpu"``, ``"cuda:0"``); None is the CPU.
        verify: Check every data file's SHA-256 (the manifest's digest,
            sizes, dtypes and shapes are always checked).
        follow_symlinks: Whether ``path`` itself may be a symbolic link.

    Raises:
        NotFoundError: there is no checkpoint directory at ``path``.
        CheckpointError: the checkpoint is damaged (the message names the
            file and what is wrong with it).
        InvalidArgumentError: ``device`` is not a device of this process.
    """
    target = as_torch_device(device)
    path = Path(path)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    with open_dir(path, follow_symlinks=follow_symlinks) as dir_fd:
        manifest = load_manifest(dir_fd, path)
        for fname, entry in manifest["files"].items():
            data = read_data_file(dir_fd, path, fname, entry, verify)
            groups[fname.removesuffix(SUFFIX)] = to_tensors(path / fname, data, target)
            del data
        scan_chunked(dir_fd, path, manifest, verify)
    chunked = {group: ChunkedReader(path, group, entries, target, follow_symlinks)
               for group, entries in manifest.get("chunked", {}).items()}
    return Checkpoint(path=path, step=manifest["step"], groups=groups,
                      metadata=manifest.get("metadata", {}), chunked=chunked)
