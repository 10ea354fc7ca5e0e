"""Tensors on the wire: a validated JSON header, then the raw bytes.

A message is::

    b"TFT1" | uint32 little-endian header length | header (UTF-8 JSON) | pad | data

with the header ``{"tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}``;
offsets count from the start of ``data`` (which starts at a 64-byte boundary
of the message) and every tensor starts at a 64-byte boundary of it.

Encoding does not copy contiguous CPU tensors: :func:`encode_tensors` returns
the header followed by memoryviews of the tensors' own storage. Decoding
checks the whole header *before* allocating anything (allowed dtype,
non-negative dimensions, ``nbytes == numel * itemsize``, every tensor inside
the message, total within a limit) and then makes the tensors views of the
received bytes (``torch.frombuffer``), so a reply is never copied either.

Example:
    >>> import torch
    >>> parts = encode_tensors({"w": torch.arange(4.0)})
    >>> decode_tensors(parts)["w"]
    tensor([0., 1., 2., 3.])
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from towerflow.errors import DataLossError, InvalidArgumentError

__all__ = [
    "ALLOWED_DTYPES",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_DECODE_BYTES",
    "encode_tensors",
    "encode_to_bytes",
    "decode_tensors",
    "chunk",
    "message_size",
]

MAGIC = b"TFT1"
_PREFIX = struct.Struct("<4sI")
_ALIGN = 64
_MAX_HEADER_BYTES = 16 << 20
_MAX_DIMS = 32
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_MAX_DECODE_BYTES = 8 << 30

ALLOWED_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in ALLOWED_DTYPES.items()}
# bytes-compatible dtype to expose a tensor's storage through numpy
_NUMPY_VIEW = {torch.bfloat16: torch.int16}


def _pad(n: int) -> int:
    return -n % _ALIGN


def _as_bytes_view(tensor: torch.Tensor) -> memoryview:
    """A byte memoryview of a contiguous CPU tensor's storage (no copy)."""
    flat = tensor.reshape(-1)
    flat = flat.view(_NUMPY_VIEW.get(flat.dtype, flat.dtype))
    return memoryview(flat.numpy()).cast("B")


def encode_tensors(tensors: Mapping[str, torch.Tensor]) -> list[memoryview | bytes]:
    """Encode named tensors as ``[header, data, pad, data, ...]`` without copying them.

    Tensors on another device are copied to the CPU; non-contiguous ones are
    made contiguous. The parts stay valid while the tensors are not modified.

    Raises:
        InvalidArgumentError: a tensor's dtype is not in :data:`ALLOWED_DTYPES`.
    """
    entries: list[dict[str, Any]] = []
    views: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"value of '{name}' is a {type(tensor).__name__}, not a torch.Tensor; "
                "only tensors can be encoded."
            )
        dtype_name = _NAMES.get(tensor.dtype)
        if dtype_name is None:
            raise InvalidArgumentError(
                f"tensor '{name}' has dtype {tensor.dtype}, which cannot be sent; convert it "
                f"to one of {sorted(ALLOWED_DTYPES)}."
            )
        cpu = tensor.detach()
        if cpu.device.type != "cpu":
            cpu = cpu.cpu()
        if not cpu.is_contiguous():
            cpu = cpu.contiguous()
        view = _as_bytes_view(cpu)
        offset += _pad(offset)
        entries.append(
            {"name": name, "dtype": dtype_name, "shape": list(cpu.shape), "offset": offset,
             "nbytes": view.nbytes}
        )  # fmt: skip
        views.append(view)
        offset += view.nbytes
    header = json.dumps({"tensors": entries}, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, len(header)) + header
    parts: list[memoryview | bytes] = [prefix + bytes(_pad(len(prefix)))]
    position = 0
    for entry, view in zip(entries, views, strict=True):
        if entry["offset"] > position:
            parts.append(bytes(entry["offset"] - position))
        if view.nbytes:
            parts.append(view)
        position = entry["offset"] + view.nbytes
    return parts


def encode_to_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """:func:`encode_tensors` joined into one ``bytes`` (one copy, for a unary call)."""
    return b"".join(encode_tensors(tensors))


def message_size(parts: Sequence[bytes | memoryview]) -> int:
    """Total bytes of an encoded message given as parts."""
    return sum(memoryview(p).nbytes for p in parts)


def chunk(
    buf: bytes | bytearray | memoryview | Sequence[bytes | memoryview],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[memoryview]:
    """Cut a message (one buffer, or the parts of :func:`encode_tensors`) into chunks.

    Every chunk but the last has exactly ``chunk_bytes`` bytes; a chunk that
    lies inside one part is a view of it, one that spans parts is joined.

    Example:
        >>> [len(c) for c in chunk(b"abcdefg", 3)]
        [3, 3, 1]
    """
    if chunk_bytes <= 0:
        raise InvalidArgumentError(f"chunk_bytes={chunk_bytes} must be positive; use e.g. 4 MiB.")
    parts = [buf] if isinstance(buf, bytes | bytearray | memoryview) else buf
    pending: list[memoryview] = []
    pending_bytes = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            take = min(chunk_bytes - pending_bytes, view.nbytes)
            pending.append(view[:take])
            pending_bytes += take
            view = view[take:]
            if pending_bytes == chunk_bytes:
                yield _joined(pending)
                pending, pending_bytes = [], 0
    if pending:
        yield _joined(pending)


def _joined(views: list[memoryview]) -> memoryview:
    return views[0] if len(views) == 1 else memoryview(b"".join(views))


def decode_tensors(
    data: bytes | bytearray | memoryview | Sequence[bytes | memoryview],
    *,
    device: str | torch.device | None = "cpu",
    max_bytes: int = DEFAULT_MAX_DECODE_BYTES,
) -> dict[str, torch.Tensor]:
    """Decode a message of :func:`encode_tensors` (one buffer or its chunks).

    The returned CPU tensors are views of ``data`` (no copy) when it is one
    buffer; treat them as read-only or clone them before changing them in place.

    Raises:
        DataLossError: the message is truncated or its header inconsistent.
        InvalidArgumentError: a dtype that is not allowed, a negative dimension,
            or more than ``max_bytes`` of tensor data.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        data = b"".join(data)
    buf = memoryview(data).cast("B")
    entries, data_start = _read_header(buf)
    specs = [_check_entry(i, e, buf.nbytes - data_start) for i, e in enumerate(entries)]
    _check_totals(specs, max_bytes)
    out: dict[str, torch.Tensor] = {}
    target = None if device is None else torch.device(device)
    for name, dtype, shape, offset, nbytes in specs:
        if nbytes == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            numel = nbytes // dtype.itemsize
            flat = torch.frombuffer(buf, dtype=dtype, count=numel, offset=data_start + offset)
            tensor = flat.view(shape)
            if dtype == torch.bool and int(flat.view(torch.uint8).max()) > 1:
                raise DataLossError(
                    f"tensor '{name}' has dtype bool but holds bytes other than 0 and 1; "
                    "the sender must encode real booleans."
                )
        if target is not None and target.type != "cpu":
            tensor = tensor.to(target)
        out[name] = tensor
    return out


def _consume_readonly_buffer_warning() -> None:
    """torch warns once per process when a tensor views read-only bytes; decoded tensors do
    that on purpose (zero-copy, documented as read-only), so the one warning is spent here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(bytes(1), dtype=torch.uint8)


_consume_readonly_buffer_warning()


def _read_header(buf: memoryview) -> tuple[list[Any], int]:
    if buf.nbytes < _PREFIX.size:
        raise DataLossError(
            f"tensor message of {buf.nbytes} bytes is shorter than its {_PREFIX.size}-byte "
            "prefix; the message was truncated."
        )
    magic, header_len = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise DataLossError(
            f"tensor message starts with {bytes(magic)!r}, not {MAGIC!r}; it is not a "
            "towerflow tensor message (or the sender's version differs)."
        )
    if header_len > _MAX_HEADER_BYTES:
        raise InvalidArgumentError(
            f"tensor message header length {header_len} exceeds {_MAX_HEADER_BYTES} bytes; "
            "send fewer tensors per message."
        )
    end = _PREFIX.size + header_len
    if end > buf.nbytes:
        raise DataLossError(
            f"tensor message header length {header_len} runs past the end of the "
            f"{buf.nbytes}-byte message; the message was truncated."
        )
    try:
        header = json.loads(bytes(buf[_PREFIX.size : end]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataLossError(f"tensor message header is not valid JSON ({exc}).") from None
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise DataLossError("tensor message header has no 'tensors' list.")
    data_start = end + _pad(end)
    if data_start > buf.nbytes and header["tensors"]:
        raise DataLossError("tensor message ends before its data section; it was truncated.")
    return header["tensors"], data_start


def _int_field(entry: dict[str, Any], field: str, index: int) -> int:
    value = entry.get(field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataLossError(f"tensor #{index} has {field}={value!r}; it must be an integer.")
    if value < 0:
        raise InvalidArgumentError(
            f"tensor #{index} has negative {field}={value}; it must be >= 0."
        )
    return value


def _check_entry(
    index: int, entry: Any, data_len: int
) -> tuple[str, torch.dtype, tuple[int, ...], int, int]:
    if not isinstance(entry, dict):
        raise DataLossError(f"tensor #{index} of the header is {entry!r}, not an object.")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise DataLossError(f"tensor #{index} has name={name!r}; it must be a non-empty string.")
    dtype = ALLOWED_DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise InvalidArgumentError(
            f"tensor '{name}' has dtype={entry.get('dtype')!r}, which is not allowed; "
            f"allowed dtypes are {sorted(ALLOWED_DTYPES)}."
        )
    shape = entry.get("shape")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
        raise DataLossError(
            f"tensor '{name}' has shape={shape!r}; it must be a list of at most {_MAX_DIMS} "
            "dimensions."
        )
    for axis, dim in enumerate(shape):
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise DataLossError(f"tensor '{name}' has shape[{axis}]={dim!r}; it must be an integer.")
        if dim < 0:
            raise InvalidArgumentError(
                f"tensor '{name}' has negative shape[{axis}]={dim}; dimensions must be >= 0."
            )
    numel = 0 if 0 in shape else 1
    for dim in shape if numel else ():
        numel *= dim
        if numel > data_len:  # checked as it grows: no huge products, no overflow
            raise DataLossError(
                f"tensor '{name}' has shape {shape}, more elements than the {data_len}-byte "
                "data section holds; the header is inconsistent or the message truncated."
            )
    nbytes = _int_field(entry, "nbytes", index)
    offset = _int_field(entry, "offset", index)
    if nbytes != numel * dtype.itemsize:
        raise DataLossError(
            f"tensor '{name}' has nbytes={nbytes} but shape {shape} of {entry['dtype']} needs "
            f"{numel * dtype.itemsize} bytes; the header is inconsistent."
        )
    if offset + nbytes > data_len:
        raise DataLossError(
            f"tensor '{name}' has offset={offset} and nbytes={nbytes}, past the end of the "
            f"{data_len}-byte data section; the message was truncated."
        )
    return name, dtype, tuple(shape), offset, nbytes


def _check_totals(
    specs: list[tuple[str, torch.dtype, tuple[int, ...], int, int]], max_bytes: int
) -> None:
    names: set[str] = set()
    total = 0
    for name, _, _, _, nbytes in specs:
        if name in names:
            raise DataLossError(f"tensor name '{name}' appears twice in the header.")
        names.add(name)
        total += nbytes
    if total > max_bytes:
        raise InvalidArgumentError(
            f"tensor message holds {total} bytes of tensors, more than max_bytes={max_bytes}; "
            "raise the limit or send smaller tensors."
        )
