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

This module reads one checkpoint directory; train dirs of numbered
checkpoints are :mod:`towerflow.checkpoint.manager`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from towerflow.checkpoint.atomic import fsync_dir, remove_tree, temp_dir, write_bytes_durable
from towerflow.checkpoint.files import (
    MAX_JSON_DEPTH,
    json_depth_exceeds,
    loads_bounded,
    open_dir,
    read_regular,
)
from towerflow.errors import CheckpointError, InvalidArgumentError

if TYPE_CHECKING:
    from towerflow.checkpoint.chunked import ChunkedReader

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

logger = logging.getLogger("towerflow.checkpoint")

FORMAT = "towerflow.checkpoint/2"
#: The format before manifests carried a digest; read with a warning.
LEGACY_FORMAT = "towerflow.checkpoint/1"
MANIFEST_NAME = "manifest.json"
DIGEST_NAME = "manifest.sha256"
SUFFIX = ".safetensors"
#: The largest manifest read or written (metadata included).
MAX_MANIFEST_BYTES = 64 << 20

_GROUP_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_DIGEST_LINE_RE = re.compile(rb"[0-9a-f]{64}  " + re.escape(MANIFEST_NAME.encode()) + rb"\n")
_MAX_DIGEST_BYTES = 256
_MAX_HEADER = 100 << 20
_RESTORE = "restore an earlier checkpoint"

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
_DTYPE_NAMES = frozenset(_ST_DTYPES.values())


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


def dtype_name(dtype: torch.dtype) -> str:
    """Return the manifest name of a dtype.

    Example:
        >>> dtype_name(torch.float32)
        'float32'
    """
    return str(dtype).removeprefix("torch.")


def check_group_name(group: str) -> None:
    """Refuse a group name that is not a plain file stem."""
    if not isinstance(group, str) or not _GROUP_RE.fullmatch(group):
        raise InvalidArgumentError(
            f"Checkpoint group name {group!r} is not allowed; use letters, digits, '_', '.' or '-' "
            "(e.g. 'model', 'optimizer')."
        )


def is_group_name(group: Any) -> bool:
    """Whether ``group`` is a plain file stem (a group's file is ``<group>.safetensors``)."""
    return isinstance(group, str) and _GROUP_RE.fullmatch(group) is not None


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


def serialize_group(group: str, tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, dict[str, Any]]:
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
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgumentError(
            f"Checkpoint metadata is not plain JSON ({exc}); keep it to dicts, lists, strings, "
            "finite numbers, booleans and None, and put tensors in a group."
        ) from exc
    return meta


def digest_line(manifest_bytes: bytes) -> bytes:
    """Return the content of ``manifest.sha256`` for a manifest's bytes.

    Example:
        >>> digest_line(b"{}")[:16], digest_line(b"{}")[64:]
        (b'44136fa355b3678a', b'  manifest.json\\n')
    """
    return f"{hashlib.sha256(manifest_bytes).hexdigest()}  {MANIFEST_NAME}\n".encode()


def _manifest_bytes(step: int, meta: dict[str, Any], files: dict[str, Any],
                    chunked: dict[str, Any]) -> bytes:
    manifest: dict[str, Any] = {"format": FORMAT, "step": step, "created": time.time(),
                                "metadata": meta, "files": files}
    if chunked:
        from towerflow.checkpoint.chunked import FORMAT_CHUNKED

        manifest.update(format=FORMAT_CHUNKED, chunked=chunked)
    data = json.dumps(manifest, indent=1, allow_nan=False).encode("utf-8")
    if json_depth_exceeds(data):
        raise InvalidArgumentError(
            f"Checkpoint metadata is nested deeper than the {MAX_JSON_DEPTH} levels a manifest "
            "may hold; flatten it (a checkpoint reader refuses deeper JSON)."
        )
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidArgumentError(
            f"Checkpoint manifest would be {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} "
            "a reader accepts; keep large values in tensor groups, not in the metadata."
        )
    return data


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
    from towerflow.checkpoint.chunked import ChunkedGroup, write_parts

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
        manifest = _manifest_bytes(step, meta, files, chunked)
        write_bytes_durable(tmp / MANIFEST_NAME, manifest)
        write_bytes_durable(tmp / DIGEST_NAME, digest_line(manifest))
        fsync_dir(tmp)
        if os.path.lexists(target):
            remove_tree(target)
        os.rename(tmp, target)
    fsync_dir(target.parent)
    return target


def _count(value: Any) -> bool:
    """Whether ``value`` is a non-negative int (not a bool)."""
    return type(value) is int and value >= 0


def entry_problem(fname: Any, entry: Any) -> str | None:
    if not (
        isinstance(fname, str)
        and fname.endswith(SUFFIX)
        and _GROUP_RE.fullmatch(fname.removesuffix(SUFFIX))
        and isinstance(entry, dict)
        and isinstance(entry.get("sha256"), str)
        and _SHA256_RE.fullmatch(entry["sha256"])
        and _count(entry.get("bytes"))
        and isinstance(entry.get("tensors"), dict)
    ):
        return f"its entry for {fname!r} is malformed"
    for name, info in entry["tensors"].items():
        if not (
            name
            and isinstance(info, dict)
            and isinstance(info.get("dtype"), str)
            and info["dtype"] in _DTYPE_NAMES
            and isinstance(info.get("shape"), list)
            and all(_count(d) for d in info["shape"])
        ):
            return f"its entry for tensor {name!r} in {fname!r} is malformed"
    return None


def _manifest_problem(manifest: Any) -> str | None:
    from towerflow.checkpoint.chunked import FORMAT_CHUNKED, chunked_problem

    formats = (FORMAT, FORMAT_CHUNKED, LEGACY_FORMAT)
    if not isinstance(manifest, dict) or manifest.get("format") not in formats:
        return f"its format is not {FORMAT!r} or {FORMAT_CHUNKED!r}"
    if not _count(manifest.get("step")):
        return "its step is not a non-negative integer"
    if not isinstance(manifest.get("metadata", {}), dict):
        return "its metadata is not an object"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "it lists no files"
    problem = next((p for p in (entry_problem(k, v) for k, v in files.items()) if p), None)
    return problem or chunked_problem(manifest)


def _check_digest(path: Path, manifest: bytes, sealed: bytes) -> None:
    expected = digest_line(manifest)
    if sealed == expected:
        return
    if _DIGEST_LINE_RE.fullmatch(sealed):
        raise CheckpointError(
            f"Checkpoint manifest {str(path / MANIFEST_NAME)!r} does not match its digest in "
            f"{DIGEST_NAME} (sha256 {expected[:64].decode()}, recorded {sealed[:64].decode()}): "
            f"one of the two is damaged; {_RESTORE}."
        )
    raise CheckpointError(
        f"Checkpoint digest file {str(path / DIGEST_NAME)!r} is malformed (expected one line "
        f"'<sha256>  {MANIFEST_NAME}'): it is damaged; {_RESTORE}."
    )


def _load_manifest(dir_fd: int, path: Path) -> dict[str, Any]:
    """Read, authenticate and validate the manifest of the opened checkpoint ``path``."""
    mpath = path / MANIFEST_NAME
    raw = read_regular(dir_fd, path, MANIFEST_NAME, max_bytes=MAX_MANIFEST_BYTES, what="manifest")
    if raw is None:
        raise CheckpointError(
            f"Checkpoint {str(path)!r} has no {MANIFEST_NAME} (an incomplete save); {_RESTORE}."
        )
    sealed = read_regular(dir_fd, path, DIGEST_NAME, max_bytes=_MAX_DIGEST_BYTES,
                          what="digest file")
    if sealed is not None:
        _check_digest(path, raw, sealed)
    manifest = loads_bounded(raw, mpath)
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(
            f"Checkpoint manifest {str(mpath)!r} is not a towerflow checkpoint manifest: "
            f"{problem}; {_RESTORE}."
        )
    if sealed is None:
        if manifest["format"] != LEGACY_FORMAT:
            raise CheckpointError(
                f"Checkpoint {str(path)!r} has no {DIGEST_NAME}, so its manifest cannot be "
                f"verified (the file was lost or removed); {_RESTORE}."
            )
        logger.warning(
            "Checkpoint %s predates manifest digests (format %r): its files are verified but "
            "its step and metadata cannot be; save it again to add a digest.",
            path, LEGACY_FORMAT,
        )
    return manifest


def read_manifest(path: str | Path, *, follow_symlinks: bool = True) -> dict[str, Any]:
    """Read, authenticate and validate the manifest of the checkpoint directory ``path``.

    Args:
        path: A checkpoint directory.
        follow_symlinks: Whether ``path`` itself may be a symbolic link.

    Raises:
        NotFoundError: ``path`` is not a directory.
        CheckpointError: the manifest is missing, damaged, malformed or does
            not match its digest (the message says which).
    """
    path = Path(path)
    with open_dir(path, follow_symlinks=follow_symlinks) as dir_fd:
        return _load_manifest(dir_fd, path)


def _parse_header(fpath: Path, data: bytes) -> dict[str, Any]:
    if len(data) < 8:
        raise CheckpointError(f"Checkpoint file {str(fpath)!r} is truncated ({len(data)} bytes).")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(len(data) - 8, _MAX_HEADER):
        raise CheckpointError(
            f"Checkpoint file {str(fpath)!r} has a header length {n} beyond its size; it is corrupt."
        )
    header = loads_bounded(data[8 : 8 + n], fpath)
    if not isinstance(header, dict):
        raise CheckpointError(f"Checkpoint file {str(fpath)!r} has a corrupt header.")
    header.pop("__metadata__", None)
    return header


def check_file(fpath: Path, data: bytes, entry: Mapping[str, Any], verify: bool) -> None:
    """Compare one safetensors file's bytes with its (validated) manifest entry."""
    if verify:
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"Checkpoint file {str(fpath)!r} fails its checksum (sha256 {digest}, manifest "
                f"{entry['sha256']}): it is corrupt; {_RESTORE}."
            )
    header = _parse_header(fpath, data)
    expected = entry["tensors"]
    if set(header) != set(expected):
        raise CheckpointError(
            f"Checkpoint file {str(fpath)!r} holds tensors {sorted(header)} but the manifest lists "
            f"{sorted(expected)}; it is corrupt."
        )
    for name, info in header.items():
        want = expected[name]
        ok = isinstance(info, dict) and isinstance(info.get("dtype"), str)
        got_dtype = _ST_DTYPES.get(info["dtype"]) if ok else None
        got_shape = info.get("shape") if ok else None
        if got_dtype != want["dtype"] or got_shape != want["shape"]:
            raise CheckpointError(
                f"Checkpoint file {str(fpath)!r}: tensor {name!r} is {got_dtype} {got_shape} but the "
                f"manifest says {want}; it is corrupt."
            )


def read_data_file(dir_fd: int, path: Path, fname: str, entry: Mapping[str, Any],
                verify: bool) -> bytes:
    """The bytes of one data file, checked against its manifest entry."""
    data = read_regular(dir_fd, path, fname, max_bytes=entry["bytes"], exact=entry["bytes"],
                        what="data file")
    if data is None:
        raise CheckpointError(
            f"Checkpoint file {str(path / fname)!r} listed in the manifest is missing; {_RESTORE}."
        )
    check_file(path / fname, data, entry, verify)
    return data


def verify_checkpoint(path: str | Path, *, follow_symlinks: bool = True) -> dict[str, Any]:
    """Check the manifest and every file of a checkpoint directory; return the manifest.

    Raises:
        NotFoundError: ``path`` is not a directory.
        CheckpointError: naming the first file that is missing, truncated,
            corrupt or not a regular file.
    """
    from towerflow.checkpoint.chunked import scan_chunked

    path = Path(path)
    with open_dir(path, follow_symlinks=follow_symlinks) as dir_fd:
        manifest = _load_manifest(dir_fd, path)
        for fname, entry in manifest["files"].items():
            read_data_file(dir_fd, path, fname, entry, verify=True)
        scan_chunked(dir_fd, path, manifest, verify=True)
    return manifest


def as_torch_device(device: str | torch.device | None) -> torch.device:
    """Return the ``torch.device`` that loaded tensors go to (None: the CPU).

    Names are torch's (``"cpu"``, ``"cuda:1"``); a TensorFlow-style name
    (``"/gpu:0"``) is turned into a device by ``towerflow.resolve_device``.

    Raises:
        InvalidArgumentError: the name is not a torch device name, or names a
            CUDA device this process does not have.

    Example:
        >>> as_torch_device("cpu"), as_torch_device(None)
        (device(type='cpu'), device(type='cpu'))
    """
    if device is None:
        return torch.device("cpu")
    if isinstance(device, torch.device):
        target = device
    elif isinstance(device, str):
        try:
            target = torch.device(device)
        except (RuntimeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"Device {device!r} is not a torch device name such as 'cpu' or 'cuda:0'; pass "
                f"one, or a torch.device (towerflow.resolve_device({device!r}) gives one for a "
                "TensorFlow-style name)."
            ) from exc
    else:
        raise InvalidArgumentError(
            f"Device {device!r} is a {type(device).__name__}; pass a torch.device or a name such "
            "as 'cpu' or 'cuda:0'."
        )
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (target.index or 0) >= count:
            raise InvalidArgumentError(
                f"Device {str(target)!r} does not exist in this process ({count} CUDA devices "
                "visible); load onto 'cpu' or a device that exists."
            )
    return target


def to_tensors(fpath: Path, data: bytes, target: torch.device) -> dict[str, torch.Tensor]:
    try:
        tensors = _st_load(data)
    except (SafetensorError, ValueError, KeyError, AssertionError, RuntimeError,
            TypeError, OverflowError) as exc:
        raise CheckpointError(f"Checkpoint file {str(fpath)!r} cannot be parsed ({exc}); "
                              f"{_RESTORE}.") from exc
    return {k: v.to(target) for k, v in tensors.items()}


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
    from towerflow.checkpoint.chunked import ChunkedReader, scan_chunked

    target = as_torch_device(device)
    path = Path(path)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    with open_dir(path, follow_symlinks=follow_symlinks) as dir_fd:
        manifest = _load_manifest(dir_fd, path)
        for fname, entry in manifest["files"].items():
            data = read_data_file(dir_fd, path, fname, entry, verify)
            groups[fname.removesuffix(SUFFIX)] = to_tensors(path / fname, data, target)
            del data
        scan_chunked(dir_fd, path, manifest, verify)
    chunked = {group: ChunkedReader(path, group, entries, target, follow_symlinks)
               for group, entries in manifest.get("chunked", {}).items()}
    return Checkpoint(path=path, step=manifest["step"], groups=groups,
                      metadata=manifest.get("metadata", {}), chunked=chunked)
