"""Property-based fuzzing of the tensor codec: refused cleanly or decoded correctly, never a raw error.

Four sources of messages: real encodings (must round trip), random bytes,
real encodings with bytes flipped, cut or inserted, and well-framed messages
whose header fields are arbitrary JSON values. Whatever comes in, decoding
either raises a :class:`~towerflow.errors.TowerflowError` (``InvalidArgumentError``
or ``DataLossError``) or returns exactly the tensors the header describes.
"""

from __future__ import annotations

import json
import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from towerflow.cluster.codec import ALLOWED_DTYPES, MAGIC, decode_tensors, encode_to_bytes
from towerflow.errors import DataLossError, InvalidArgumentError

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_CLEAN = (InvalidArgumentError, DataLossError)

_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                 max_size=12)
_shapes = st.lists(st.integers(0, 5), max_size=3)


@st.composite
def _tensors(draw) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    out = {}
    for name in draw(st.lists(_names, max_size=4, unique=True)):
        dtype = ALLOWED_DTYPES[draw(st.sampled_from(sorted(ALLOWED_DTYPES)))]
        shape = tuple(draw(_shapes))
        numel = 1
        for dim in shape:
            numel *= dim
        values = torch.randint(0, 2, (numel,)) if dtype == torch.bool else \
            torch.randint(-50, 50, (numel,))
        out[name] = values.to(dtype).reshape(shape)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])
        for k in a
    )


def _check(message: bytes) -> None:
    """Decoding ``message`` is a clean refusal or exactly what its header describes."""
    try:
        decoded = decode_tensors(message)
    except _CLEAN:
        return
    header_len = struct.unpack_from("<I", message, 4)[0]
    header = json.loads(message[8 : 8 + header_len])
    data_start = 8 + header_len + (-(8 + header_len) % 64)
    assert list(decoded) == [e["name"] for e in header["tensors"]]
    for entry in header["tensors"]:
        tensor = decoded[entry["name"]]
        assert tensor.dtype == ALLOWED_DTYPES[entry["dtype"]]
        assert list(tensor.shape) == entry["shape"]
        start = data_start + entry["offset"]
        assert tensor.numel() * tensor.element_size() == entry["nbytes"]
        assert start + entry["nbytes"] <= len(message)
        expected = torch.frombuffer(bytearray(message[start : start + entry["nbytes"]]) or
                                    bytearray(1), dtype=torch.uint8)[: entry["nbytes"]]
        assert torch.equal(tensor.contiguous().view(-1).view(torch.uint8), expected)
    assert _same(decode_tensors(encode_to_bytes(decoded)), decoded)  # and it re-encodes


@FUZZ
@given(_tensors())
def test_every_encoding_round_trips(tensors):
    assert _same(decode_tensors(encode_to_bytes(tensors)), tensors)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_are_refused_cleanly(data):
    _check(MAGIC + data[4:] if data[:1] == b"T" else data)


@FUZZ
@given(_tensors(), st.data())
def test_damaged_encodings_are_refused_cleanly_or_decode_as_their_header_says(tensors, data):
    message = bytearray(encode_to_bytes(tensors))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert", "set"]))
        at = data.draw(st.integers(0, max(0, len(message) - 1)))
        if kind == "flip" and message:
            message[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "cut":
            del message[at : at + data.draw(st.integers(1, 70))]
        elif kind == "insert":
            message[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif message:
            message[at] = data.draw(st.sampled_from(b'0123456789[]{}",:-.eE '))
    _check(bytes(message))


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.sampled_from(sorted(ALLOWED_DTYPES)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=12,
)
_field_values = {
    "name": _names | _json,
    "dtype": st.sampled_from(sorted(ALLOWED_DTYPES)) | _json,
    "shape": _shapes | st.lists(st.integers(-3, 2**64), max_size=4) | _json,
    "offset": st.sampled_from([0, 64, 128]) | st.integers(-(2**65), 2**65) | _json,
    "nbytes": st.integers(0, 256) | _json,
}


@st.composite
def _headers(draw) -> list:  # type: ignore[no-untyped-def]
    entries = []
    for _ in range(draw(st.integers(0, 4))):
        fields = draw(st.sets(st.sampled_from(sorted(_field_values)), min_size=3))
        entry = {field: draw(_field_values[field]) for field in sorted(fields)}
        if draw(st.booleans()):
            entry[draw(st.text(max_size=5))] = draw(_json)
        entries.append(entry if draw(st.integers(0, 9)) else draw(_json))
    return entries


@FUZZ
@given(_headers(), st.binary(max_size=300))
def test_arbitrary_header_fields_are_refused_cleanly_or_decode_as_their_header_says(entries, data):
    body = json.dumps({"tensors": entries}).encode()
    prefix = struct.pack("<4sI", MAGIC, len(body)) + body
    _check(prefix + bytes(-len(prefix) % 64) + data)
