"""The on-disk checkpoint format: safetensors files plus a JSON manifest.

A checkpoint is a directory::

    ckpt-00001000/
        model.safetensors        one file per group of tensors
        optimizer.safetensors
        manifest.json            written last

``manifest.json`` records the format, the step, the creation time, free JSON
metadata and, per file, its SHA-256, its size and the name, dtype and shape of
every tensor in it::

    {"format": "towerflow.checkpoint/1", "step": 1000, "created": 1700000000.0,
     "metadata": {...},
     "files": {"model.safetensors": {"sha256": "...", "bytes": 1234,
               "tensors": {"fc.weight": {"dtype": "float32", "shape": [10, 4]}}}}}

Reading never executes code: the manifest is JSON and tensors come from
safetensors, whose header is checked against the manifest before use. Any
disagreement — a checksum, a size, a dtype, a shape, a missing file — is a
:class:`~towerflow.errors.DataLossError` that names the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from towerflow.checkpoint.atomic import fsync_dir, remove_tree, temp_dir, write_bytes_durable
from towerflow.devices.placer import resolve_device
from towerflow.errors import DataLossError, InvalidArgumentError, NotFoundError

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "Checkpoint",
    "dtype_name",
    "read_checkpoint",
    "read_manifest",
    "verify_checkpoint",
    "write_checkpoint_dir",
]

FORMAT = "towerflow.checkpoint/1"
MANIFEST_NAME = "manifest.json"
SUFFIX = ".safetensors"

_GROUP_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_MAX_HEADER = 100 << 20

# safetensors header dtype codes -> torch dtype names (``str(dtype)`` without "torch.").
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


@dataclass(slots=True)
class Checkpoint:
    """A checkpoint read from disk.

    Attributes:
        path: The checkpoint directory.
        step: The training step it was written at.
        groups: Group name (``"model"``, ``"optimizer"``, ...) -> tensor name ->
            tensor, on the device asked for.
        metadata: The JSON metadata saved with it (schedule, data position, ...).
    """

    path: Path
    step: int
    groups: dict[str, dict[str, torch.Tensor]]
    metadata: dict[str, Any]


def dtype_name(dtype: torch.dtype) -> str:
    """Return the manifest name of a dtype.

    Example:
        >>> dtype_name(torch.float32)
        'float32'
    """
    return str(dtype).removeprefix("torch.")


def check_group_name(group: str) -> None:
    """Refuse a group name that is not a plain file stem."""
    if not isinstance(group, str) or not _GROUP_RE.match(group):
        raise InvalidArgumentError(
            f"Checkpoint group name {group!r} is not allowed; use letters, digits, '_', '.' or '-' "
            "(e.g. 'model', 'optimizer')."
        )


def check_step(step: int) -> None:
    """Refuse a step that is not a non-negative integer."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgumentError(f"Checkpoint step {step!r} is not a non-negative integer.")


def _prepare(group: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, detached tensors that share no storage with each other."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(
                f"Tensor name {name!r} in group {group!r} is not a non-empty string; name every tensor."
            )
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"Value {name!r} in checkpoint group {group!r} is a {type(tensor).__name__}, not a "
                "tensor; store non-tensor values in the metadata (see flatten_state)."
            )
        if tensor.layout != torch.strided:
            raise InvalidArgumentError(
                f"Tensor {name!r} in group {group!r} is sparse; call .to_dense() before saving it."
            )
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        else:
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
            if not t.is_contiguous() or (ptr and ptr in seen):
                t = t.contiguous() if not t.is_contiguous() else t.clone()
            elif ptr:
                seen.add(ptr)
        out[name] = t
    return out


def _serialize(group: str, tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, dict[str, Any]]:
    prepared = _prepare(group, tensors)
    data = _st_save(prepared)
    entry = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "tensors": {
            name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
            for name, t in prepared.items()
        },
    }
    return data, entry


def _metadata_json(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    meta = dict(metadata or {})
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
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

    Files go to a temporary sibling directory, each fsynced, the manifest last;
    the directory is then renamed to ``target`` (an existing one is replaced)
    and the parent fsynced. A crash at any moment leaves either no ``target``,
    the old one, or the complete new one.

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
    target.parent.mkdir(parents=True, exist_ok=True)
    with temp_dir(target.parent, target.name) as tmp:
        files: dict[str, Any] = {}
        for group, tensors in groups.items():
            data, entry = _serialize(group, tensors)
            write_bytes_durable(tmp / f"{group}{SUFFIX}", data)
            files[f"{group}{SUFFIX}"] = entry
            del data
        manifest = {
            "format": FORMAT,
            "step": step,
            "created": time.time(),
            "metadata": meta,
            "files": files,
        }
        write_bytes_durable(tmp / MANIFEST_NAME, json.dumps(manifest, indent=1).encode("utf-8"))
        fsync_dir(tmp)
        if target.exists():
            remove_tree(target)
        os.rename(tmp, target)
    fsync_dir(target.parent)
    return target


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Read and validate the manifest of the checkpoint directory ``path``.

    Raises:
        NotFoundError: ``path`` is not a directory.
        DataLossError: the manifest is missing, not JSON, or malformed.
    """
    path = Path(path)
    if not path.is_dir():
        raise NotFoundError(
            f"No checkpoint found at {str(path)!r}: it is not a directory; check the path or "
            "the train dir."
        )
    mpath = path / MANIFEST_NAME
    try:
        manifest = json.loads(mpath.read_bytes())
    except FileNotFoundError as exc:
        raise DataLossError(
            f"Checkpoint {str(path)!r} has no {MANIFEST_NAME} (an incomplete save); "
            "restore an earlier checkpoint."
        ) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataLossError(
            f"Checkpoint file {str(mpath)!r} is not valid JSON ({exc}); the file is corrupt, "
            "restore an earlier checkpoint."
        ) from exc
    _check_manifest(mpath, manifest)
    return manifest


def _check_manifest(mpath: Path, manifest: Any) -> None:
    problem = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        problem = f"its format is not {FORMAT!r}"
    elif isinstance(manifest.get("step"), bool) or not isinstance(manifest.get("step"), int):
        problem = "its step is not an integer"
    elif not isinstance(manifest.get("metadata", {}), dict):
        problem = "its metadata is not an object"
    elif not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        problem = "it lists no files"
    else:
        for fname, entry in manifest["files"].items():
            stem = fname.removesuffix(SUFFIX)
            if (
                not fname.endswith(SUFFIX)
                or not _GROUP_RE.match(stem)
                or not isinstance(entry, dict)
                or not isinstance(entry.get("sha256"), str)
                or not isinstance(entry.get("bytes"), int)
                or not isinstance(entry.get("tensors"), dict)
            ):
                problem = f"its entry for {fname!r} is malformed"
                break
    if problem:
        raise DataLossError(
            f"Checkpoint manifest {str(mpath)!r} is not a towerflow checkpoint manifest: {problem}; "
            "restore an earlier checkpoint."
        )


def _parse_header(fpath: Path, data: bytes) -> dict[str, Any]:
    if len(data) < 8:
        raise DataLossError(f"Checkpoint file {str(fpath)!r} is truncated ({len(data)} bytes).")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(len(data) - 8, _MAX_HEADER):
        raise DataLossError(
            f"Checkpoint file {str(fpath)!r} has a header length {n} beyond its size; it is corrupt."
        )
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataLossError(f"Checkpoint file {str(fpath)!r} has a corrupt header ({exc}).") from exc
    if not isinstance(header, dict):
        raise DataLossError(f"Checkpoint file {str(fpath)!r} has a corrupt header.")
    header.pop("__metadata__", None)
    return header


def _check_file(fpath: Path, data: bytes, entry: Mapping[str, Any], verify: bool) -> None:
    """Compare one safetensors file's bytes with its manifest entry."""
    if len(data) != entry["bytes"]:
        raise DataLossError(
            f"Checkpoint file {str(fpath)!r} has {len(data)} bytes, the manifest says "
            f"{entry['bytes']}: it is truncated or corrupt; restore an earlier checkpoint."
        )
    if verify:
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"]:
            raise DataLossError(
                f"Checkpoint file {str(fpath)!r} fails its checksum (sha256 {digest}, manifest "
                f"{entry['sha256']}): it is corrupt; restore an earlier checkpoint."
            )
    header = _parse_header(fpath, data)
    expected = entry["tensors"]
    if set(header) != set(expected):
        raise DataLossError(
            f"Checkpoint file {str(fpath)!r} holds tensors {sorted(header)} but the manifest lists "
            f"{sorted(expected)}; it is corrupt."
        )
    for name, info in header.items():
        want = expected[name]
        got_dtype = _ST_DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
        got_shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(want, dict) or got_dtype != want.get("dtype") or got_shape != want.get("shape"):
            raise DataLossError(
                f"Checkpoint file {str(fpath)!r}: tensor {name!r} is {got_dtype} {got_shape} but the "
                f"manifest says {want}; it is corrupt."
            )


def _read_file(path: Path, fname: str) -> bytes:
    fpath = path / fname
    try:
        return fpath.read_bytes()
    except FileNotFoundError as exc:
        raise DataLossError(
            f"Checkpoint file {str(fpath)!r} listed in the manifest is missing; restore an earlier "
            "checkpoint."
        ) from exc


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest; return the manifest.

    Raises:
        DataLossError: naming the first file that is missing, truncated or corrupt.
    """
    path = Path(path)
    manifest = read_manifest(path)
    for fname, entry in manifest["files"].items():
        _check_file(path / fname, _read_file(path, fname), entry, verify=True)
    return manifest


def _holds_checkpoints(path: Path) -> bool:
    """Whether ``path`` is a train dir (a ``latest`` pointer or ``ckpt-*`` entries)."""
    if (path / "latest").is_file():
        return True
    return path.is_dir() and any(p.name.startswith("ckpt-") for p in path.iterdir())


def read_checkpoint(
    path: str | Path, device: str | torch.device | None = "cpu", verify: bool = True
) -> Checkpoint:
    """Read a checkpoint directory onto ``device``.

    Args:
        path: A checkpoint directory (``.../ckpt-00001000``), or a directory
            of checkpoints with a ``latest`` pointer, whose latest complete
            checkpoint is read.
        device: Where the tensors go (``"cpu"``, ``"cuda:0"``, ``"/gpu:0"``).
        verify: Check every file's SHA-256 (sizes, dtypes and shapes are
            always checked).

    Raises:
        NotFoundError: there is no checkpoint at ``path``.
        DataLossError: a file is missing, truncated or corrupt (the message
            names it).
    """
    path = Path(path)
    if not (path / MANIFEST_NAME).exists() and _holds_checkpoints(path):
        from towerflow.checkpoint.manager import latest_checkpoint

        found = latest_checkpoint(path)
        if found is None:
            raise NotFoundError(
                f"No checkpoint found at {str(path)!r}: none of its checkpoints is complete; "
                "train again or restore a backup."
            )
        path = found
    target = resolve_device(device)
    manifest = read_manifest(path)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for fname, entry in manifest["files"].items():
        fpath = path / fname
        data = _read_file(path, fname)
        _check_file(fpath, data, entry, verify)
        try:
            tensors = _st_load(data)
        except (SafetensorError, ValueError, KeyError, AssertionError) as exc:
            raise DataLossError(f"Checkpoint file {str(fpath)!r} cannot be parsed ({exc}).") from exc
        del data
        groups[fname.removesuffix(SUFFIX)] = {k: v.to(target) for k, v in tensors.items()}
    return Checkpoint(
        path=path, step=manifest["step"], groups=groups, metadata=manifest.get("metadata", {})
    )
