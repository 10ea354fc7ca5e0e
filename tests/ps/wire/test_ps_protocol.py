"""The ps wire contract: headers round-trip, tensors travel as raw buffers, the worker loads no
server module, the shard owns its counters."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from towerflow.errors import DataLossError, InvalidArgumentError
from towerflow.ps.placement import plan_placement
from towerflow.ps.server.dense.optimizers import make_optimizer
from towerflow.ps.server.dense.shard import ShardState
from towerflow.ps.wire.calls import METHODS, method_path
from towerflow.ps.wire.framing import CHUNK_BYTES, chunks, pack, pack_parts, split_parts, unpack
from towerflow.ps.wire.messages import (
    AggregationConfig,
    PushHeader,
    aggregation_to_proto,
    decode_push_header,
    encode_push_header,
    push_records,
    push_rows,
    signature_bytes,
)
from towerflow.ps.wire.tensors import decode, encode, raw_bytes

names = st.text(min_size=1, max_size=8)
shapes = st.lists(st.integers(0, 1 << 40), max_size=4).map(tuple)
headers = st.builds(
    PushHeader, worker_id=st.integers(0, 2**31 - 1), seq=st.integers(0, 2**64 - 1),
    token=st.integers(-(2**63), 2**63 - 1), lr=st.floats(allow_nan=False),
    numel=st.integers(-(2**63), 2**63 - 1), dtype=st.sampled_from(["float32", "float64"]),
    incarnation=st.integers(0, 2**64 - 1),
    segments=st.lists(st.tuples(names, shapes), max_size=3).map(tuple), finite=st.booleans())


@settings(max_examples=80, deadline=None, derandomize=True)
@given(header=headers, want=st.booleans())
def test_every_push_header_round_trips_through_the_wire(header: PushHeader, want: bool) -> None:
    assert decode_push_header(encode_push_header(header, want_params=want)) == (header, want)


def test_a_layout_signature_prefixed_once_stands_for_the_segments() -> None:
    layout = plan_placement({"w": (2, 3), "b": (3,)}, 1).shards[0]
    header = PushHeader(worker_id=1, seq=2, token=3, lr=0.5, numel=layout.numel)
    decoded, _ = decode_push_header(encode_push_header(header, signature=signature_bytes(layout)))
    assert decoded.segments == layout.signature and decoded.seq == 2


@settings(max_examples=60, deadline=None, derandomize=True)
@given(head=st.binary(max_size=64), payload=st.binary(max_size=64))
def test_a_packed_message_splits_into_its_header_and_payload(head: bytes, payload: bytes) -> None:
    got_head, got_payload = unpack(pack(head, payload))
    assert got_head == head and bytes(got_payload) == payload


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.binary(max_size=16))
def test_a_truncated_packed_message_is_data_loss_never_a_crash(data: bytes) -> None:
    try:
        head, payload = unpack(data)
    except DataLossError as exc:
        assert "header" in str(exc)
    else:
        assert 4 + len(head) + len(payload) == len(data)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(head=st.binary(max_size=32), parts=st.lists(st.binary(max_size=24), max_size=6))
def test_a_framed_message_splits_into_its_parts_as_views(head: bytes,
                                                         parts: list[bytes]) -> None:
    data = pack_parts(head, [memoryview(p) for p in parts])
    got_head, payload = unpack(data)
    views = split_parts(payload, [len(p) for p in parts], "batch")
    assert got_head == head and [bytes(v) for v in views] == parts
    assert all(v.obj is payload.obj for v in views)  # views of the received bytes, no copy


@settings(max_examples=80, deadline=None, derandomize=True)
@given(payload=st.binary(max_size=24), sizes=st.lists(st.integers(-4, 30), max_size=5))
def test_parts_that_do_not_add_up_are_data_loss_never_a_crash(payload: bytes,
                                                              sizes: list[int]) -> None:
    try:
        views = split_parts(memoryview(payload), sizes, "RowBatch")
    except DataLossError as exc:
        assert "RowBatch" in str(exc) and "same towerflow version" in str(exc)
    else:
        assert [len(v) for v in views] == sizes and sum(sizes) == len(payload)


def test_a_malformed_push_header_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgumentError, match=r"Malformed PushRequest message \(3 bytes\)"):
        decode_push_header(b"\xff\xff\xff")


def test_buffers_travel_in_chunks_of_the_contract_size() -> None:
    buffer = np.arange(CHUNK_BYTES // 4 + 3, dtype=np.float32)
    parts = list(chunks(buffer))
    assert [len(p) for p in parts] == [CHUNK_BYTES, 12]
    assert np.array_equal(np.frombuffer(b"".join(parts), np.float32), buffer)


def test_push_table_rows_and_aggregation_become_messages_and_back() -> None:
    rows = [(0, 7, 3, "applied"), (2, 9, 1, "stale")]
    assert list(push_rows(push_records(rows))) == rows
    spec = aggregation_to_proto(AggregationConfig(mode="sync", total_num_replicas=3, timeout=None))
    assert (spec.mode, spec.total_num_replicas, spec.wait_forever, spec.timeout) == \
        ("sync", 3, True, 0.0)
    assert method_path(METHODS[0]) == "/towerflow.ps.PS/Init"


def test_tensors_travel_as_raw_buffers_and_come_back_as_read_only_views() -> None:
    rows = torch.arange(6, dtype=torch.float64).view(2, 3)
    data = encode(rows)
    assert bytes(raw_bytes(rows.t().contiguous().t())) == data  # row-major, whatever the strides
    got = decode(data, torch.float64, (2, 3))
    assert torch.equal(got, rows)
    assert decode(data, torch.float64, 6, "rows").shape == (6,)
    assert decode(b"", torch.int64, (0, 4)).shape == (0, 4)


def test_a_raw_buffer_of_the_wrong_size_is_refused_in_its_readers_words() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^A ps answered 8 bytes where \(2, 1\) "
                       r"torch.int64 values need 16; client and ps must run the same"):
        decode(bytes(8), torch.int64, (2, 1))
    with pytest.raises(InvalidArgumentError, match=r"^Table 't' ids holds 8 bytes but 3 values "
                       r"of torch.int64 need 24; client and ps"):
        decode(bytes(8), torch.int64, 3, "Table 't' ids")
    with pytest.raises(InvalidArgumentError, match=r"holds 0 bytes but -1 values of torch.int64 "
                       r"need 0;"):
        decode(b"", torch.int64, -1, "Table 't' ids")


def test_the_worker_side_loads_no_server_module() -> None:
    """A worker process (the strategy, the dense client, the sparse tables) never imports a
    module of a ps task's half (``towerflow.ps.server``), not even its package."""
    program = (
        "import sys\n"
        "import towerflow.strategies.parameter_server, towerflow.ps.worker.dense.client\n"
        "import towerflow.ps.worker.dense.variables, towerflow.ps.worker.tables.embedding\n"
        "import towerflow.ps.worker.tables.checkpoint, towerflow.ps.worker.observe\n"
        "towerflow.ps.PSClient, towerflow.ps.ShardedEmbedding, towerflow.ps.TableClient\n"
        "print(sorted(m for m in sys.modules if m.startswith('towerflow.ps.server')))\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_shard_owns_its_counters() -> None:
    """Readers get copies: changing what ``stats`` returned changes nothing in the shard."""
    layout = plan_placement({"w": (4,)}, 1).shards[0]
    state = ShardState(layout, np.zeros(4, np.float32), make_optimizer("sgd", 4))
    state.apply(np.ones(4, np.float32), lr=0.5)
    seen = state.stats
    seen.updates = 99
    seen.refusals.append("forged")
    assert state.stats.updates == 1 and state.stats.refusals == []
    state.admission.count_bytes_in(16)
    figures = state.figures()
    assert (figures.step, figures.stats["updates"], figures.stats["bytes_in"]) == (1, 1, 16)
    assert not hasattr(state, "cond") and not hasattr(state, "table")
