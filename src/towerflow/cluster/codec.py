"""Tensors on the wire: a validated JSON header, then the raw bytes.

A message is::

    b"TFT1" | uint32 little-endian header length | header (UTF-8 JSON) | pad | data

with the header ``{"tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}``;
offsets count from the start of ``data`` (which starts at a 64-byte boundary
of the message) and every tensor starts at a 64-byte boundary of it.

A header comes from a peer, so :func:`read_header` validates all of it, in
checked arithmetic, before anything is allocated: bounded JSON (size, nesting,
integer digits), exactly the format's fields, dtypes from a closed list,
bounded dimensions, aligned offsets, tensors inside the message and not
overlapping, limits on the tensor count and the bytes. Each refusal is an
``InvalidArgumentError`` naming the field and the limit (``DataLossError``
when the message itself ends early).

Encoding does not copy contiguous CPU tensors: :func:`encode_tensors` returns
the header followed by memoryviews of the tensors' own storage. Decoding
checks the whole header *before* allocating anything and then makes the
tensors views of the received bytes (``torch.frombuffer``), so a reply is never copied either.

Example:
    >>> import torch
    >>> parts = encode_tensors({"w": torch.arange(4.0)})
    >>> decode_tensors(parts)["w"]
    tensor([0., 1., 2., 3.])
"""

from __future__ import annotations

import json
import math
import re
import struct
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from towerflow.errors import DataLossError, InvalidArgumentError

__all__ = [
    "ALLOWED_DTYPES",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_DECODE_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_TENSORS",
    "TensorSpec",
    "read_header",
    "encode_tensors",
    "encode_to_bytes",
    "decode_tensors",
    "chunk",
    "message_size",
]

MAGIC = b"TFT1"
_PREFIX = struct.Struct("<4sI")
_ALIGN = 64
_MAX_DIMS = 32
_MAX_NESTING = 4
_MAX_INT_DIGITS = 19
_MAX_EXTENT = 1 << 62
_MAX_NAME = 4096
_FIELDS = frozenset({"name", "dtype", "shape", "offset", "nbytes"})
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_MAX_DECODE_BYTES = 8 << 30
DEFAULT_MAX_TENSORS = 16384
DEFAULT_MAX_HEADER_BYTES = 4 << 20

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
    max_tensors: int = DEFAULT_MAX_TENSORS,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> dict[str, torch.Tensor]:
    """Decode a message of :func:`encode_tensors` (one buffer or its chunks).

    The whole header is validated before anything is allocated (see
    :func:`read_header`). The returned CPU tensors are views of ``data`` (no
    copy) when it is one buffer; treat them as read-only or clone them before
    changing them in place.

    Raises:
        DataLossError: the message is not a tensor message or ends early.
        InvalidArgumentError: the header breaks a rule or a limit; the message
            names the field and the limit.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        data = b"".join(data)
    buf = memoryview(data).cast("B")
    specs, data_start = read_header(buf, max_bytes=max_bytes, max_tensors=max_tensors,
                                    max_header_bytes=max_header_bytes)
    out: dict[str, torch.Tensor] = {}
    target = None if device is None else torch.device(device)
    for spec in specs:
        if spec.nbytes == 0:
            tensor = torch.empty(spec.shape, dtype=spec.dtype)
        else:
            flat = torch.frombuffer(buf, dtype=spec.dtype, count=spec.nbytes // spec.dtype.itemsize,
                                    offset=data_start + spec.offset)
            tensor = flat.view(spec.shape)
            if spec.dtype == torch.bool and int(flat.view(torch.uint8).max()) > 1:
                raise InvalidArgumentError(
                    f"tensor '{spec.name}' has dtype bool but holds bytes other than 0 and 1; "
                    "the sender must encode real booleans."
                )
        if target is not None and target.type != "cpu":
            tensor = tensor.to(target)
        out[spec.name] = tensor
    return out


def _consume_readonly_buffer_warning() -> None:
    """torch warns once per process when a tensor views read-only bytes; decoded tensors do
    that on purpose (zero-copy, documented as read-only), so the one warning is spent here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(bytes(1), dtype=torch.uint8)


_consume_readonly_buffer_warning()


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One validated tensor entry of a header: where its bytes lie in the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(
    buf: memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_DECODE_BYTES,
    max_tensors: int = DEFAULT_MAX_TENSORS,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> tuple[list[TensorSpec], int]:
    """Validate a message's header; its tensor entries and where its data section starts.

    The rules, all checked before anything is allocated: at most
    ``max_header_bytes`` of JSON nested at most 4 deep with integers of at most
    19 digits, no floats and no repeated keys; exactly the fields of the format;
    at most ``max_tensors`` tensors with distinct non-empty names; dtypes from
    :data:`ALLOWED_DTYPES`; at most 32 dimensions, each at most 2**62, whose
    product (a zero dimension counted as 1) stays at most 2**62; ``nbytes``
    equal to elements x itemsize; offsets 64-byte aligned; every tensor inside
    the message; tensors' bytes not overlapping; at most ``max_bytes`` in all.
    """
    header, data_start = _parse_header(buf, max_header_bytes)
    entries = header["tensors"]
    if len(entries) > max_tensors:
        raise InvalidArgumentError(
            f"tensor message header lists {len(entries)} tensors, more than max_tensors="
            f"{max_tensors}; send fewer tensors per message or raise the limit."
        )
    if entries and data_start > buf.nbytes:
        raise DataLossError("tensor message ends before its data section; it was truncated.")
    data_len = max(0, buf.nbytes - data_start)
    specs = [_check_entry(i, e, data_len) for i, e in enumerate(entries)]
    _check_totals(specs, max_bytes)
    return specs, data_start


def _parse_header(buf: memoryview, max_header_bytes: int) -> tuple[dict[str, Any], int]:
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
    if header_len > max_header_bytes:
        raise InvalidArgumentError(
            f"tensor message header length {header_len} exceeds max_header_bytes="
            f"{max_header_bytes}; send fewer tensors per message."
        )
    end = _PREFIX.size + header_len
    if end > buf.nbytes:
        raise DataLossError(
            f"tensor message header length {header_len} runs past the end of the "
            f"{buf.nbytes}-byte message; the message was truncated."
        )
    raw = bytes(buf[_PREFIX.size : end])
    _check_nesting(raw)
    try:
        header = json.loads(raw, parse_int=_parse_int, parse_float=_refuse_float,
                            parse_constant=_refuse_float, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"tensor message header is not UTF-8 ({exc}).") from None
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"tensor message header is not valid JSON ({exc}).") from None
    if not isinstance(header, dict) or set(header) != {"tensors"} \
            or not isinstance(header["tensors"], list):
        raise InvalidArgumentError(
            "tensor message header must be an object with exactly one field, a 'tensors' list."
        )
    return header, end + _pad(end)


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


def _check_nesting(raw: bytes) -> None:
    """Refuse JSON nested deeper than the format's 4 levels, before parsing it."""
    brackets = _BRACKET.findall(_STRING.sub(b'""', raw))
    depth = 0
    for bracket in brackets:
        depth += 1 if bracket in (b"[", b"{") else -1
        if depth > _MAX_NESTING:
            raise InvalidArgumentError(
                f"tensor message header is nested more than {_MAX_NESTING} levels deep; the "
                "format nests an object, its 'tensors' list, each tensor and its shape."
            )


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise InvalidArgumentError(
            f"tensor message header has a {len(text.lstrip('-'))}-digit integer; integers of "
            f"the format have at most {_MAX_INT_DIGITS} digits."
        )
    return int(text)


def _refuse_float(text: str) -> Any:
    raise InvalidArgumentError(
        f"tensor message header has the number {text[:40]}; every number of the format is an "
        "integer."
    )


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise InvalidArgumentError("tensor message header repeats a key in one object.")
    return out


def _int_field(name: str, entry: dict[str, Any], field: str) -> int:
    value = entry[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(
            f"tensor '{name}' has {field}={value!r}; it must be an integer."
        )
    if value < 0:
        raise InvalidArgumentError(f"tensor '{name}' has negative {field}={value}; it must be >= 0.")
    return value


def _check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
        raise InvalidArgumentError(
            f"tensor '{name}' has shape={str(shape)[:80]}; it must be a list of at most "
            f"{_MAX_DIMS} dimensions."
        )
    extent = 1
    for axis, dim in enumerate(shape):
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise InvalidArgumentError(
                f"tensor '{name}' has shape[{axis}]={dim!r}; it must be an integer."
            )
        if dim < 0:
            raise InvalidArgumentError(
                f"tensor '{name}' has negative shape[{axis}]={dim}; dimensions must be >= 0."
            )
        extent *= max(dim, 1)  # a zero dimension still strides over the others
        if extent > _MAX_EXTENT:
            raise InvalidArgumentError(
                f"tensor '{name}' has shape {shape[: _MAX_DIMS]}, whose dimensions multiply to "
                f"more than {_MAX_EXTENT} (2**62, zero dimensions counted as 1); the header "
                "is inconsistent."
            )
    return tuple(shape)


def _check_entry(index: int, entry: Any, data_len: int) -> TensorSpec:
    if not isinstance(entry, dict) or set(entry) != _FIELDS:
        fields = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise InvalidArgumentError(
            f"tensor #{index} of the header is {str(fields)[:80]}; it must be an object with "
            f"exactly the fields {sorted(_FIELDS)}."
        )
    name = entry["name"]
    if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
        raise InvalidArgumentError(
            f"tensor #{index} has name={str(name)[:80]!r}; it must be a non-empty string of at "
            f"most {_MAX_NAME} characters."
        )
    dtype_name = entry["dtype"]
    dtype = ALLOWED_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise InvalidArgumentError(
            f"tensor '{name}' has dtype={str(dtype_name)[:40]!r}, which is not allowed; allowed "
            f"dtypes are {sorted(ALLOWED_DTYPES)}."
        )
    shape = _check_shape(name, entry["shape"])
    nbytes, offset = _int_field(name, entry, "nbytes"), _int_field(name, entry, "offset")
    numel = math.prod(shape)
    if nbytes != numel * dtype.itemsize:
        raise InvalidArgumentError(
            f"tensor '{name}' has nbytes={nbytes} but shape {list(shape)} of {dtype_name} needs "
            f"{numel * dtype.itemsize} bytes; the header is inconsistent."
        )
    if offset % _ALIGN:
        raise InvalidArgumentError(
            f"tensor '{name}' has offset={offset}, not a multiple of {_ALIGN}; every tensor "
            f"starts at a {_ALIGN}-byte boundary of the data section."
        )
    if offset + nbytes > data_len:
        raise DataLossError(
            f"tensor '{name}' has offset={offset} and nbytes={nbytes}, past the end of the "
            f"{data_len}-byte data section; the message was truncated."
        )
    return TensorSpec(name, dtype, shape, offset, nbytes)


def _check_totals(specs: list[TensorSpec], max_bytes: int) -> None:
    names: set[str] = set()
    for spec in specs:
        if spec.name in names:
            raise InvalidArgumentError(f"tensor name '{spec.name}' appears twice in the header.")
        names.add(spec.name)
    total = sum(spec.nbytes for spec in specs)
    if total > max_bytes:
        raise InvalidArgumentError(
            f"tensor message holds {total} bytes of tensors, more than max_bytes={max_bytes}; "
            "raise the limit or send smaller tensors."
        )
    end, last = 0, None
    for spec in sorted((s for s in specs if s.nbytes), key=lambda s: s.offset):
        if spec.offset < end:
            raise InvalidArgumentError(
                f"tensor '{spec.name}' (offset={spec.offset}) overlaps tensor '{last}', which "
                f"ends at {end}; the tensors of a message do not share bytes."
            )
        end, last = spec.offset + spec.nbytes, spec.name
