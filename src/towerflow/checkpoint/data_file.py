"""One data file of a checkpoint: a group's tensors as safetensors bytes, and its manifest entry.

A group ``model`` is the file ``model.safetensors``; its entry in the
manifest (:mod:`towerflow.checkpoint.manifest`) records the file's SHA-256, its
size and the name, dtype and shape of every tensor in it::

    {"sha256": "...", "bytes": 1234,
     "tensors": {"fc.weight": {"dtype": "float32", "shape": [10, 4]}}}

Writing turns a group into those bytes and that entry (:func:`serialize_group`);
reading checks a file's bytes against its entry before safetensors parses
them (:func:`read_data_file`, :func:`to_tensors`). A chunked group's parts
(:mod:`towerflow.checkpoint.chunked`) are data files too.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from towerflow.checkpoint.files import loads_bounded, read_regular
from towerflow.errors import CheckpointError, InvalidArgumentError

__all__ = [
    "RESTORE",
    "SUFFIX",
    "as_torch_device",
    "check_file",
    "check_group_name",
    "dtype_name",
    "entry_problem",
    "is_count",
    "is_group_name",
    "read_data_file",
    "serialize_group",
    "to_tensors",
]

SUFFIX = ".safetensors"
#: the way out that ends the message of a damaged checkpoint
RESTORE = "restore an earlier checkpoint"

_GROUP_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_MAX_HEADER = 100 << 20
#: most tensors one data file may hold (a model's parameters and their optimizer state)
MAX_TENSORS = 65_536

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


def is_count(value: Any) -> bool:
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
        and is_count(entry.get("bytes"))
        and isinstance(entry.get("tensors"), dict)
    ):
        return f"its entry for {fname!r} is malformed"
    if len(entry["tensors"]) > MAX_TENSORS:
        return (f"its entry for {fname!r} lists {len(entry['tensors']):,} tensors, more than "
                f"{MAX_TENSORS:,}")
    for name, info in entry["tensors"].items():
        if not (
            name
            and isinstance(info, dict)
            and isinstance(info.get("dtype"), str)
            and info["dtype"] in _DTYPE_NAMES
            and isinstance(info.get("shape"), list)
            and all(is_count(d) for d in info["shape"])
        ):
            return f"its entry for tensor {name!r} in {fname!r} is malformed"
    return None


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
    if len(header) > MAX_TENSORS:
        raise CheckpointError(
            f"Checkpoint file {str(fpath)!r} holds {len(header):,} tensors, more than "
            f"{MAX_TENSORS:,}; it is corrupt or not written by towerflow, {RESTORE}."
        )
    return header


def check_file(fpath: Path, data: bytes, entry: Mapping[str, Any], verify: bool) -> None:
    """Compare one safetensors file's bytes with its (validated) manifest entry."""
    if verify:
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"Checkpoint file {str(fpath)!r} fails its checksum (sha256 {digest}, manifest "
                f"{entry['sha256']}): it is corrupt; {RESTORE}."
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
            f"Checkpoint file {str(path / fname)!r} listed in the manifest is missing; {RESTORE}."
        )
    check_file(path / fname, data, entry, verify)
    return data


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
                              f"{RESTORE}.") from exc
    for name, tensor in tensors.items():
        if tensor.dtype == torch.bool and tensor.numel() and int(tensor.view(torch.uint8).max()) > 1:
            raise CheckpointError(
                f"Checkpoint file {str(fpath)!r}: bool tensor {name!r} holds a byte other than "
                f"0 or 1; it is corrupt, {RESTORE}."
            )
    return {k: v.to(target) for k, v in tensors.items()}

