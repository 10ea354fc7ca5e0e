"""Tensor codec: round trips, zero-copy, and every header validation error."""

from __future__ import annotations

import json
import struct
import time

import pytest
import torch

from towerflow.cluster.codec import (
    ALLOWED_DTYPES,
    MAGIC,
    chunk,
    decode_tensors,
    encode_tensors,
    encode_to_bytes,
    message_size,
)
from towerflow.errors import DataLossError, InvalidArgumentError


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, dtype=dtype)


@pytest.mark.parametrize("dtype_name", sorted(ALLOWED_DTYPES))
def test_round_trip_of_every_allowed_dtype(dtype_name):
    dtype = ALLOWED_DTYPES[dtype_name]
    tensors = {"scalar": _sample(dtype, ()), "matrix": _sample(dtype, (3, 5)), "empty": _sample(dtype, (0, 4))}
    out = decode_tensors(encode_to_bytes(tensors))
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert out[name].dtype == dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor)


def test_non_contiguous_tensors_round_trip():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t(), "strided": base[:, ::2]}
    out = decode_tensors(encode_to_bytes(tensors))
    assert torch.equal(out["t"], base.t()) and torch.equal(out["strided"], base[:, ::2])


def test_encode_does_not_copy_contiguous_tensors():
    weights = torch.arange(1000, dtype=torch.float32)
    parts = encode_tensors({"w": weights})
    views = [p for p in parts if isinstance(p, memoryview)]
    assert len(views) == 1
    weights[0] = 42.0  # the part is a view of the tensor's own storage
    assert decode_tensors(parts)["w"][0].item() == 42.0


def test_decode_returns_views_of_the_received_buffer():
    buffer = bytearray(encode_to_bytes({"w": torch.zeros(16, dtype=torch.float64)}))
    decoded = decode_tensors(buffer)["w"]
    buffer[-8:] = struct.pack("<d", 7.5)
    assert decoded[-1].item() == 7.5


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_chunked_message_decodes_to_the_same_tensors(chunk_bytes):
    tensors = {"a": torch.randn(33, 3), "b": torch.arange(5, dtype=torch.int16).to(torch.bfloat16)}
    parts = encode_tensors(tensors)
    chunks = list(chunk(parts, chunk_bytes))
    assert all(len(c) == chunk_bytes for c in chunks[:-1])
    assert sum(len(c) for c in chunks) == message_size(parts)
    out = decode_tensors(chunks)
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)


def test_encode_refuses_a_dtype_that_cannot_be_sent():
    with pytest.raises(InvalidArgumentError, match="tensor 'c' has dtype torch.complex64"):
        encode_tensors({"c": torch.zeros(2, dtype=torch.complex64)})


def _forge(entries: list[dict], data: bytes = b"", header: bytes | None = None) -> bytes:
    body = header if header is not None else json.dumps({"tensors": entries}).encode()
    prefix = struct.pack("<4sI", MAGIC, len(body)) + body
    return prefix + bytes(-len(prefix) % 64) + data


def _entry(**fields) -> dict:
    entry = {"name": "w", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
    entry.update(fields)
    return entry


@pytest.mark.parametrize(
    ("message", "error", "pattern"),
    [
        (b"TF", DataLossError, "shorter than its 8-byte prefix"),
        (b"XXXX\x00\x00\x00\x00", DataLossError, "starts with b'XXXX'"),
        (struct.pack("<4sI", MAGIC, 100) + b"{}", DataLossError, "header length 100 runs past"),
        (struct.pack("<4sI", MAGIC, 1 << 30), InvalidArgumentError, "header length 1073741824 exceeds max_header_bytes=4194304"),
        (_forge([], header=b"{not json"), InvalidArgumentError, "header is not valid JSON"),
        (_forge([], header=b'{"t": 1}'), InvalidArgumentError, "exactly one field, a 'tensors' list"),
        (_forge([_entry(dtype="object")], bytes(8)), InvalidArgumentError, "dtype='object', which is not allowed"),
        (_forge([_entry(shape=[-2], nbytes=8)], bytes(8)), InvalidArgumentError, r"negative shape\[0\]=-2"),
        (_forge([_entry(shape=[2.5])], bytes(8)), InvalidArgumentError, r"the number 2.5; every number of the format is an integer"),
        (_forge([_entry(shape=[True])], bytes(8)), InvalidArgumentError, r"shape\[0\]=True; it must be an integer"),
        (_forge([_entry(shape="2")], bytes(8)), InvalidArgumentError, "shape=2; it must be a list of at most 32"),
        (_forge([_entry(nbytes=12)], bytes(16)), InvalidArgumentError, "nbytes=12 but shape \\[2\\] of float32 needs 8"),
        (_forge([_entry(offset=-64)], bytes(8)), InvalidArgumentError, "negative offset=-64"),
        (_forge([_entry(offset=64)], bytes(8)), DataLossError, "offset=64 and nbytes=8, past the end"),
        (_forge([_entry()], bytes(4)), DataLossError, "past the end of the 4-byte data section"),
        (_forge([_entry(shape=[2**62, 2**62], nbytes=8)], bytes(8)), InvalidArgumentError, r"multiply to more than 4611686018427387904 \(2\*\*62"),
        (_forge([_entry(name="")], bytes(8)), InvalidArgumentError, "name=''"),
        (_forge([_entry(), _entry()], bytes(8)), InvalidArgumentError, "'w' appears twice"),
        (_forge([_entry(dtype="bool", nbytes=2)], b"\x01\x05"), InvalidArgumentError, "bytes other than 0 and 1"),
        (_forge([_entry(nbytes=True)], bytes(8)), InvalidArgumentError, "nbytes=True"),
        # the forms that used to escape as raw Python errors or be accepted
        (_forge([_entry(dtype=["float32"])], bytes(8)), InvalidArgumentError, r"dtype=\"\['float32'\]\", which is not allowed"),
        (_forge([_entry(shape=[2**64], nbytes=8)], bytes(8)), InvalidArgumentError, "a 20-digit integer; integers of the format have at most 19 digits"),
        (_forge([_entry(shape=[0, 2**62, 2**62], nbytes=0)], bytes(8)), InvalidArgumentError, r"zero dimensions counted as 1"),
        (_forge([], header=b'{"tensors":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), InvalidArgumentError, "nested more than 4 levels deep"),
        (_forge([], header=b'{"tensors":[{"name":"w","dtype":"float32","shape":[' + b"9" * 5000 + b'],"offset":0,"nbytes":8}]}'), InvalidArgumentError, "a 5000-digit integer"),
        (_forge([_entry(offset=4)], bytes(16)), InvalidArgumentError, "offset=4, not a multiple of 64"),
        (_forge([_entry(name=f"v{i}", shape=[262144], nbytes=1 << 20) for i in range(100_000)], bytes(1 << 20)), InvalidArgumentError, "exceeds max_header_bytes=4194304"),
        (_forge([_entry(name=f"v{i}", shape=[262144], nbytes=1 << 20) for i in range(20_000)], bytes(1 << 20)), InvalidArgumentError, "lists 20000 tensors, more than max_tensors=16384"),
        (_forge([_entry(name="a", shape=[32], nbytes=128), _entry(name="b", shape=[16], nbytes=64, offset=64)], bytes(128)), InvalidArgumentError, "tensor 'b' \\(offset=64\\) overlaps tensor 'a', which ends at 128"),
        (_forge([_entry(extra=1)], bytes(8)), InvalidArgumentError, r"exactly the fields \['dtype', 'name', 'nbytes', 'offset', 'shape'\]"),
        (_forge([], header=b'{"tensors": [], "tensors": []}'), InvalidArgumentError, "repeats a key"),
        (_forge([], header=b'{"tensors": [NaN]}'), InvalidArgumentError, "the number NaN"),
        (_forge([], header=b'{"tensors": "\xff"}'), InvalidArgumentError, "not UTF-8|not valid JSON"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_decode_validates_the_header_before_allocating(message, error, pattern):
    with pytest.raises(error, match=pattern):
        decode_tensors(message)


def test_decode_refuses_more_tensor_bytes_than_the_limit():
    message = encode_to_bytes({"w": torch.zeros(1024)})
    with pytest.raises(InvalidArgumentError, match="holds 4096 bytes of tensors, more than max_bytes=1000"):
        decode_tensors(message, max_bytes=1000)
    assert decode_tensors(message, max_bytes=4096)["w"].numel() == 1024


def test_a_message_of_many_zero_size_tensors_is_refused_before_any_work():
    header = json.dumps({"tensors": [_entry(name=f"t{i}", shape=[0], nbytes=0)
                                     for i in range(200_000)]}).encode()
    started = time.perf_counter()
    with pytest.raises(InvalidArgumentError, match="exceeds max_header_bytes=4194304"):
        decode_tensors(_forge([], header=header))
    assert time.perf_counter() - started < 1.0
    # within the limits, the most tensors a message may hold decode quickly
    most = encode_to_bytes({f"t{i}": torch.empty(0) for i in range(16384)})
    started = time.perf_counter()
    assert len(decode_tensors(most)) == 16384
    assert time.perf_counter() - started < 5.0
    with pytest.raises(InvalidArgumentError, match="lists 16384 tensors, more than max_tensors=100"):
        decode_tensors(most, max_tensors=100)
