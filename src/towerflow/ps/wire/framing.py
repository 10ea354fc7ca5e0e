"""How bytes travel on the ps wire: streamed chunks, one-message frames and their parts.

Control messages are protobuf (``ps.proto``, ``tables.proto``); tensors never
travel inside them. A streamed call sends its header message first, then the
raw little-endian float32 bytes of a flat buffer in chunks of
:data:`CHUNK_BYTES` (:func:`chunks`); the header says how many elements
follow, so the receiver validates before it copies (:func:`receive_into`). A
one-message call carries header and payload as :func:`pack` lays them out (a
4-byte little-endian header length, the header, the payload); a payload of
several raw buffers end to end (:func:`pack_parts`) is split back by the byte
lengths its header lists (:func:`split_parts`). Nothing is unpickled.

Example:
    >>> header, payload = unpack(pack(b"head", b"body"))
    >>> header, bytes(payload)
    (b'head', b'body')
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from towerflow.errors import DataLossError

__all__ = [
    "CHUNK_BYTES",
    "ITEM",
    "chunks",
    "receive_into",
    "PayloadCutOff",
    "pack",
    "unpack",
    "pack_parts",
    "split_parts",
]

#: bytes per streamed chunk (1-4 MiB measured fastest for Python gRPC)
CHUNK_BYTES = 1 << 20
#: bytes of one element: every streamed buffer on the ps wire is float32
ITEM = 4

_LENGTH = struct.Struct("<I")


class PayloadCutOff(DataLossError):
    """A push's payload ended before the size its header announced (the sender went away)."""


def chunks(buffer: np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The raw bytes of ``buffer`` (made contiguous) in chunks of ``chunk_bytes``."""
    raw = memoryview(np.ascontiguousarray(buffer)).cast("B")
    for start in range(0, len(raw), chunk_bytes):
        yield bytes(raw[start:start + chunk_bytes])


def pack(header: bytes, payload: bytes | memoryview = b"") -> bytes:
    """One message: a 4-byte little-endian header length, the header, the raw payload."""
    return b"".join((_LENGTH.pack(len(header)), header, payload))


def unpack(message: bytes) -> tuple[bytes, memoryview]:
    """Split a :func:`pack` message into its header and (zero-copy) payload.

    Raises:
        DataLossError: the message is shorter than its header length says.
    """
    view = memoryview(message)
    if len(view) < _LENGTH.size:
        raise DataLossError(f"A {len(view)}-byte message is too short for its header length.")
    (length,) = _LENGTH.unpack_from(view)
    end = _LENGTH.size + length
    if end > len(view):
        raise DataLossError(
            f"A message announces a {length}-byte header but holds {len(view)} bytes in all."
        )
    return bytes(view[_LENGTH.size:end]), view[end:]


def pack_parts(header: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
    """:func:`pack` of a payload of several raw buffers end to end (each copied once)."""
    return b"".join((_LENGTH.pack(len(header)), header, *parts))


def split_parts(payload: memoryview, sizes: Sequence[int], what: str) -> list[memoryview]:
    """The buffers of a :func:`pack_parts` payload, by their byte lengths (zero-copy views).

    Raises:
        DataLossError: the lengths are negative or do not add up to the payload.
    """
    out, start = [], 0
    for size in sizes:
        if size < 0 or start + size > len(payload):
            break
        out.append(payload[start:start + size])
        start += size
    if len(out) != len(sizes) or start != len(payload):
        raise DataLossError(
            f"A {what} of {len(payload)} payload bytes announces parts of {list(sizes)[:8]} "
            "bytes; client and ps must run the same towerflow version."
        )
    return out


def receive_into(target: np.ndarray | None, chunks: Iterable[bytes | memoryview], numel: int,
                 *, who: str,
                 on_chunk: Callable[[int, np.ndarray], None] | None = None) -> int:
    """Copy a payload of ``numel`` float32 elements from ``chunks`` into ``target``.

    ``on_chunk(offset, values)`` (when given) handles each chunk instead of the
    copy (``values`` is a read-only view of the chunk; ``target`` may then be
    None). Returns the number of bytes received.

    Raises:
        DataLossError: a chunk not a whole number of elements, or a payload
            shorter or longer than announced.
    """
    expected = numel * ITEM
    received = 0
    for chunk in chunks:
        size = len(chunk)
        if size % ITEM or received + size > expected:
            raise DataLossError(
                f"Payload from {who} does not match its header: a {size}-byte chunk at byte "
                f"{received} of {expected}; the push was refused."
            )
        values = np.frombuffer(chunk, dtype=np.float32)
        first = received // ITEM
        if on_chunk is None:
            target[first:first + values.size] = values  # type: ignore[index]
        else:
            on_chunk(first, values)
        received += size
    if received != expected:
        raise PayloadCutOff(
            f"Payload from {who} ended after {received} of {expected} bytes; the push was "
            "refused."
        )
    return received
