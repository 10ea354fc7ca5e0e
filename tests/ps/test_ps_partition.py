"""Row partitioners of sparse tables: ownership, local <-> global, split, the dict form."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from towerflow.errors import InvalidArgumentError
from towerflow.ps.partition import (
    ModPartitioner,
    RangePartitioner,
    check_ids,
    coalesce,
    partitioner_from_dict,
)

INT64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def bounded_partitioners(draw):
    num_rows = draw(st.integers(0, 300))
    num_shards = draw(st.integers(1, 9))
    if draw(st.booleans()):
        return ModPartitioner(num_shards, num_rows=num_rows)
    return RangePartitioner(num_rows, num_shards)


@settings(max_examples=150, deadline=None)
@given(bounded_partitioners())
def test_every_row_is_in_exactly_one_shard_and_round_trips(part):
    seen = []
    for shard in range(part.num_shards):
        ids = part.global_ids(shard)
        assert ids.dtype == torch.int64
        assert ids.numel() == part.rows_in_shard(shard)
        if ids.numel():
            assert torch.equal(part.shard_of(ids), torch.full_like(ids, shard))
            local = part.local_index(ids, shard)
            # the shard's rows are numbered 0 .. rows_in_shard - 1 in global_ids' order
            assert torch.equal(local, torch.arange(ids.numel()))
        seen.append(ids)
    every = torch.cat(seen)
    assert torch.equal(torch.sort(every).values, torch.arange(part.num_rows))


@settings(max_examples=150, deadline=None)
@given(bounded_partitioners(), st.data())
def test_split_covers_the_batch_once_in_order(part, data):
    if part.num_rows == 0:
        return
    values = data.draw(st.lists(st.integers(0, part.num_rows - 1), max_size=60))
    ids = torch.tensor(values, dtype=torch.int64)
    pieces = part.split(ids)
    assert len(pieces) == part.num_shards
    out = torch.full_like(ids, -1)
    positions = []
    for shard, (pos, shard_ids) in enumerate(pieces):
        assert torch.equal(shard_ids, ids[pos])
        assert bool((part.shard_of(shard_ids) == shard).all())
        assert torch.equal(pos, torch.sort(pos).values)
        out.index_copy_(0, pos, shard_ids)
        positions.append(pos)
    assert torch.equal(out, ids)
    assert torch.equal(torch.sort(torch.cat(positions)).values, torch.arange(ids.numel()))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.lists(INT64, min_size=1, max_size=40))
def test_unbounded_mod_round_trips_any_int64_id(num_shards, values):
    part = ModPartitioner(num_shards)
    ids = torch.tensor(values, dtype=torch.int64)
    for shard, (pos, shard_ids) in enumerate(part.split(ids)):
        local = part.local_index(shard_ids, shard)
        assert torch.equal(local * num_shards + shard, shard_ids)
        assert torch.equal(ids[pos], shard_ids)


@settings(max_examples=100, deadline=None)
@given(bounded_partitioners())
def test_dict_form_round_trips_through_json(part):
    back = partitioner_from_dict(json.loads(json.dumps(part.to_dict())))
    assert back == part
    assert type(back) is type(part)


def test_range_partitioner_slices_like_fixed_size_partitioner():
    part = RangePartitioner(10, 3)
    assert [part.global_ids(s).tolist() for s in range(3)] == [
        [0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert part.local_index(torch.tensor([9, 7]), 2).tolist() == [2, 0]
    assert [RangePartitioner(2, 4).rows_in_shard(s) for s in range(4)] == [1, 1, 0, 0]


def test_mod_partitioner_spreads_zipf_batch_evenly_where_ranges_do_not():
    gen = torch.Generator().manual_seed(0)
    num_rows = 100_000
    ranks = torch.arange(1, num_rows + 1, dtype=torch.float64)
    ids = torch.multinomial(ranks.pow(-1.2), 8192, replacement=True, generator=gen)
    unique = torch.unique(ids)
    mod = [p.numel() for p, _ in ModPartitioner(2, num_rows=num_rows).split(unique)]
    rng = [p.numel() for p, _ in RangePartitioner(num_rows, 2).split(unique)]
    assert max(mod) / unique.numel() < 0.55
    assert max(rng) / unique.numel() > 0.75


def test_local_index_refuses_an_id_of_another_shard():
    part = ModPartitioner(2, num_rows=10)
    with pytest.raises(InvalidArgumentError, match=r"ids\[1\] = 3 belongs to shard 1, not shard 0"):
        part.local_index(torch.tensor([2, 3]), 0)
    with pytest.raises(InvalidArgumentError, match=r"Shard 2 does not exist; .*shards 0 \.\. 1"):
        part.global_ids(2)
    with pytest.raises(InvalidArgumentError, match=r"ids\[2\] = 7 belongs to shard 2, not shard 1"):
        RangePartitioner(10, 3).local_index(torch.tensor([4, 6, 7]), 1)


@pytest.mark.parametrize(
    ("ids", "pattern"),
    [
        (torch.tensor([1, -1]), r"ids\[1\] = -1 is not in \[0, 10\)"),
        (torch.tensor([10]), r"ids\[0\] = 10 is not in \[0, 10\).*hash modulo num_rows"),
        (torch.tensor([1, 2], dtype=torch.int32), r"dtype torch.int64, got torch.int32.*ids.long"),
        (torch.tensor([[1]]), r"must be 1-D, got shape \[1, 1\]"),
        ([1, 2], r"torch.Tensor of int64 ids, got list"),
    ],
)
def test_bad_ids_are_refused_with_the_value_named(ids, pattern):
    for part in (ModPartitioner(3, num_rows=10), RangePartitioner(10, 3)):
        with pytest.raises(InvalidArgumentError, match=pattern):
            part.split(ids)


def test_unbounded_mod_partitioner_has_no_fixed_rows():
    with pytest.raises(InvalidArgumentError, match=r"unbounded id space.*give num_rows"):
        ModPartitioner(2).rows_in_shard(0)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ([1], r"described by a dict, got list"),
        ({"kind": "hash", "num_shards": 2, "num_rows": 4},
         r"'hash' partitioner spans every int64 id; num_rows must be None"),
        ({"kind": "nope", "num_shards": 2, "num_rows": 4}, r"Unknown partitioner kind 'nope'"),
        ({"kind": "mod", "num_shards": 2}, r"exactly the keys"),
        ({"kind": "mod", "num_shards": 2, "num_rows": 4, "x": 1}, r"exactly the keys"),
        ({"kind": "mod", "num_shards": 0, "num_rows": 4}, r"num_shards must be an integer >= 1"),
        ({"kind": "mod", "num_shards": True, "num_rows": 4}, r"num_shards must be an integer"),
        ({"kind": "range", "num_shards": 2, "num_rows": -1}, r"num_rows must be an integer >= 0"),
        ({"kind": "range", "num_shards": 2, "num_rows": None}, r"needs num_rows"),
    ],
)
def test_partitioner_from_dict_refuses_bad_dicts(data, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        partitioner_from_dict(data)


def test_coalesce_sums_duplicates():
    ids = torch.tensor([7, 2, 7, 7, 0])
    grads = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    unique, summed = coalesce(ids, grads)
    assert unique.tolist() == [0, 2, 7]
    assert summed.tolist() == [[8.0, 9.0], [2.0, 3.0], [0 + 4 + 6, 1 + 5 + 7]]


def test_coalesce_sorts_and_sums_sorted_duplicates_and_passes_unique_sorted_ids_through():
    unique, summed = coalesce(torch.tensor([1, 1, 2]), torch.tensor([[1.0], [2.0], [4.0]]))
    assert unique.tolist() == [1, 2] and summed.tolist() == [[3.0], [4.0]]
    ids, grads = torch.tensor([1, 5, 9]), torch.ones(3, 2)
    out_ids, out_grads = coalesce(ids, grads)
    assert out_ids is ids and out_grads is grads


def test_check_ids_returns_the_tensor():
    ids = torch.tensor([1, 2])
    assert check_ids(ids) is ids
