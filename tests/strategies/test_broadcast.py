"""The mirrored replicas' checkpoint broadcast: what a receiving replica accepts as a header."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from towerflow.errors import DataLossError
from towerflow.strategies.broadcast import (
    MAX_HEADER_BYTES,
    _checked_size,
    _send_tensors,
    parse_header,
)

GOOD = {"checkpoint": {"path": "/runs/a/ckpt-4", "step": 4, "metadata": {"epoch": 1},
                       "tensors": [["model", "w", "float32", [2, 3]]]}}


@pytest.mark.parametrize("size", [-1, -(1 << 40), MAX_HEADER_BYTES + 1, 1 << 40, 1 << 62])
def test_a_header_length_out_of_bounds_is_refused_before_allocating(size) -> None:
    with pytest.raises(DataLossError, match=rf"replica 0 sent is malformed: its length is "
                                            rf"{size} bytes, not 0 \.\. {MAX_HEADER_BYTES}; "
                                            r"nothing was allocated"):
        _checked_size(size, 0)
    assert _checked_size(MAX_HEADER_BYTES, 0) == MAX_HEADER_BYTES


@pytest.mark.parametrize(("data", "what"), [
    (b"\xff\xfe{}", r"it is not UTF-8"),
    (b"[1, 2]", r"it is not an object with exactly 'error' or 'checkpoint'"),
    (b"{}", r"it is not an object with exactly 'error' or 'checkpoint'"),
    (b'{"checkpoint": {"path": "p", "step": 1}}', r"its 'checkpoint' is not an object of path"),
    (b'{"checkpoint": {"path": "p", "step": 1, "metadata": {}, "tensors": [["m", "w", '
     b'"float32", [-2, 3]]]}}', r"tensor entry 0 is not \[group, name, dtype, shape of "
                                r"non-negative integers\]"),
    (b'{"error": 7}', r"its 'error' is not a string"),
    (b"[" * 100_000 + b"]" * 100_000, r"it is nested more than 64 levels deep"),
    (b'{"checkpoint": nope}', r"it is not JSON"),
])
def test_each_malformed_header_is_one_data_loss_error(data, what) -> None:
    with pytest.raises(DataLossError, match=r"the checkpoint header replica 3 sent is malformed: "
                                            + what):
        parse_header(data, 3)


def test_a_good_header_is_read_back() -> None:
    assert parse_header(json.dumps(GOOD).encode()) == GOOD
    assert parse_header(b'{"checkpoint": null}') == {"checkpoint": None}


def test_tensors_larger_than_the_memory_are_refused_before_the_buffer_exists() -> None:
    layout = [["model", "w", "float32", [1 << 40]], ["model", "b", "float32", [1 << 20]]]
    with pytest.raises(DataLossError, match=r"its tensors add up to 4,398,050,705,408 bytes, more "
                                            r"than half of the [\d,]+ bytes available here"):
        _send_tensors(None, layout, 0, torch.device("cpu"))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(data=st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode()),
                      JSON.map(lambda v: json.dumps({"checkpoint": v}).encode())))
def test_any_bytes_are_a_checked_header_or_one_data_loss_error(data: bytes) -> None:
    try:
        header = parse_header(data)
    except DataLossError as exc:
        assert "nothing was allocated" in str(exc)
        return
    found = header.get("checkpoint")
    assert "error" in header or found is None or all(
        min(entry[3], default=0) >= 0 for entry in found["tensors"])
