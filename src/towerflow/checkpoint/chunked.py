"""Chunked groups: tensors too large for one process's memory, written and read part by part.

A group of a checkpoint is one safetensors file, built whole in memory
before it is written. A :class:`ChunkedGroup` is a group given as an
iterator of parts instead: the writer asks for one part at a time, writes it
as its own safetensors file ``<group>-<n:05d>.safetensors`` (fsynced, in the
checkpoint's temporary directory), drops it and asks for the next, so a save
never holds more than one part. Each part carries a small JSON object
(``info``: what the part is, for whoever reads it back).

The manifest (format ``towerflow.checkpoint/3``, written only when a
checkpoint has a chunked group) lists the parts next to the groups, each
with its SHA-256, size and tensors as a group's file, plus its ``info``::

    "chunked": {"ps_tables": {
        "ps_tables-00000.safetensors": {"sha256": "...", "bytes": 4194432,
            "tensors": {"ids": {"dtype": "int64", "shape": [16384]}, ...},
            "info": {"table": "emb", "shard": 0, "part": 0}}, ...}}

The manifest's digest covers the manifest and the manifest covers every
part, so a part is verified like any data file: reading or verifying a
checkpoint hashes every part (block by block, never holding one whole) and
checks its header, and a damaged part makes the checkpoint damaged (a
:class:`~towerflow.errors.CheckpointError` naming the file; a train dir's
restore falls back to the previous checkpoint). :class:`ChunkedReader` then
hands the parts out one at a time, each checked again against its checksum
on the bytes it read.

Example:
    >>> import tempfile, torch
    >>> from towerflow.checkpoint.format import read_checkpoint_dir, write_checkpoint_dir
    >>> parts = ((({"n": i}, {"x": torch.full((2,), float(i))})) for i in range(3))
    >>> path = write_checkpoint_dir(tempfile.mkdtemp() + "/c", 1,
    ...                             {"model": {}, "big": ChunkedGroup(parts)})
    >>> reader = read_checkpoint_dir(path).chunked["big"]
    >>> len(reader), [(info["n"], t["x"].tolist()) for info, t in reader.parts()][2]
    (3, (2, [2.0, 2.0]))
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from towerflow.checkpoint.atomic import write_bytes_durable
from towerflow.checkpoint.data_file import (
    RESTORE,
    SUFFIX,
    check_file,
    check_group_name,
    entry_problem,
    is_group_name,
    read_data_file,
    serialize_group,
    to_tensors,
)
from towerflow.checkpoint.files import open_dir, open_regular
from towerflow.errors import CheckpointError, InvalidArgumentError

__all__ = ["FORMAT_CHUNKED", "ChunkedGroup", "ChunkedReader", "part_name"]

#: The format of a checkpoint with chunked groups (format 2 plus ``"chunked"``).
FORMAT_CHUNKED = "towerflow.checkpoint/3"
_BLOCK = 1 << 20
_PART_RE = re.compile(r"-(\d{5,})\.safetensors")


def part_name(group: str, index: int) -> str:
    """The file name of part ``index`` of the chunked group ``group``.

    Example:
        >>> part_name("ps_tables", 7)
        'ps_tables-00007.safetensors'
    """
    return f"{group}-{index:05d}{SUFFIX}"


class ChunkedGroup:
    """A checkpoint group written part by part (see the module docstring).

    Args:
        parts: ``(info, tensors)`` pairs, produced lazily: ``info`` a JSON
            object, ``tensors`` a name -> tensor mapping as a group's. It is
            iterated once, by the save that writes it.
    """

    __slots__ = ("_parts",)

    def __init__(self, parts: Iterable[tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]]
                 ) -> None:
        self._parts = parts

    def __iter__(self) -> Iterator[tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]]:
        return iter(self._parts)


def _info_json(group: str, index: int, info: Any) -> dict[str, Any]:
    if not isinstance(info, Mapping):
        raise InvalidArgumentError(
            f"Part {index} of chunked group {group!r} has info of type {type(info).__name__}; "
            "give each part a JSON object (a dict) as its info."
        )
    try:
        json.dumps(dict(info), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgumentError(
            f"The info of part {index} of chunked group {group!r} is not plain JSON ({exc}); "
            "keep it to dicts, lists, strings, finite numbers, booleans and None."
        ) from exc
    return dict(info)


def write_parts(directory: Path, group: str, chunked: ChunkedGroup,
                taken: set[str]) -> dict[str, Any]:
    """Write every part of ``chunked`` into ``directory``; return their manifest entries.

    ``taken``: the file names of the checkpoint's other groups, which no part may have.
    """
    entries: dict[str, Any] = {}
    for index, item in enumerate(chunked):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise InvalidArgumentError(
                f"Part {index} of chunked group {group!r} is a {type(item).__name__}; a chunked "
                "group yields (info, tensors) pairs."
            )
        fname = part_name(group, index)
        check_group_name(fname.removesuffix(SUFFIX))
        if fname in taken:
            raise InvalidArgumentError(
                f"Checkpoint groups clash: part {index} of chunked group {group!r} would be "
                f"{fname!r}, the file of group {fname.removesuffix(SUFFIX)!r}; rename a group."
            )
        info = _info_json(group, index, item[0])
        data, entry = serialize_group(group, item[1])
        write_bytes_durable(directory / fname, data)
        del data, item
        entry["info"] = info
        entries[fname] = entry
    return entries


def chunked_problem(manifest: Mapping[str, Any]) -> str | None:
    """What is wrong with a (format-checked) manifest's chunked groups, or None."""
    chunked = manifest.get("chunked")
    if manifest["format"] != FORMAT_CHUNKED:
        return None if chunked is None else \
            f"it lists chunked groups but its format is {manifest['format']!r}"
    if not isinstance(chunked, dict):
        return "its chunked groups are not an object"
    files = manifest["files"]
    for group, entries in chunked.items():
        if not isinstance(entries, dict) or not is_group_name(group):
            return f"its chunked group {group!r} is malformed"
        for index, (fname, entry) in enumerate(entries.items()):
            if fname != part_name(group, index):
                return f"its chunked group {group!r} lists {fname!r} as part {index}"
            if fname in files:
                return f"it lists {fname!r} both as a group and as a part of {group!r}"
            problem = entry_problem(fname, entry)
            if problem is None and not isinstance(entry.get("info", {}), dict):
                problem = f"its entry for {fname!r} has an info that is not an object"
            if problem:
                return problem
    return None


def scan_part(dir_fd: int, path: Path, fname: str, entry: Mapping[str, Any],
              verify: bool) -> None:
    """Check one part on disk without holding it: size, header, and (``verify``) SHA-256.

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    size = entry["bytes"]
    with open_regular(dir_fd, path, fname, max_bytes=size, exact=size,
                      what="data file") as opened:
        if opened is None:
            raise CheckpointError(
                f"Checkpoint file {str(path / fname)!r} listed in the manifest is missing; "
                f"{RESTORE}."
            )
        f, _ = opened
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        prefix = head + f.read(min(length, max(size - 8, 0)))
        digest = hashlib.sha256(prefix)
        read = len(prefix)
        while verify and (block := f.read(_BLOCK)):
            digest.update(block)
            read += len(block)
    if verify:
        if read != size:
            raise CheckpointError(f"Checkpoint file {str(path / fname)!r} changed size while it "
                                  "was read; read it again once no other process writes it.")
        if digest.hexdigest() != entry["sha256"]:
            raise CheckpointError(
                f"Checkpoint file {str(path / fname)!r} fails its checksum (sha256 "
                f"{digest.hexdigest()}, manifest {entry['sha256']}): it is corrupt; {RESTORE}."
            )
    check_file(path / fname, prefix, entry, verify=False)


def scan_chunked(dir_fd: int, path: Path, manifest: Mapping[str, Any], verify: bool) -> None:
    """:func:`scan_part` for every part of every chunked group of ``manifest``."""
    for entries in manifest.get("chunked", {}).values():
        for fname, entry in entries.items():
            scan_part(dir_fd, path, fname, entry, verify)


class ChunkedReader:
    """The parts of a chunked group of a checkpoint on disk, read one at a time.

    Args:
        path: The checkpoint directory.
        group: The group's name.
        entries: Its manifest entries (file name -> entry), in order.
        device: Where the tensors go.
        follow_symlinks: Whether ``path`` itself may be a symbolic link.
    """

    __slots__ = ("path", "group", "_entries", "_device", "_follow")

    def __init__(self, path: Path, group: str, entries: Mapping[str, Any],
                 device: torch.device, follow_symlinks: bool = True) -> None:
        self.path, self.group = path, group
        self._entries = dict(entries)
        self._device, self._follow = device, follow_symlinks

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ChunkedReader({str(self.path)!r}, {self.group!r}, {len(self)} parts)"

    @property
    def infos(self) -> list[dict[str, Any]]:
        """Every part's info, in order (from the manifest: no file is read)."""
        return [dict(entry.get("info", {})) for entry in self._entries.values()]

    def parts(self) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        """``(info, tensors)`` of each part in order, one part in memory at a time.

        Raises:
            CheckpointError: a part is missing or damaged (checked on the bytes read).
        """
        for fname, entry in self._entries.items():
            with open_dir(self.path, follow_symlinks=self._follow) as dir_fd:
                data = read_data_file(dir_fd, self.path, fname, entry, verify=True)
            tensors = to_tensors(self.path / fname, data, self._device)
            del data
            yield dict(entry.get("info", {})), tensors
