"""The dynamic table's row store and key index, in one process (no server)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from towerflow.errors import InvalidArgumentError
from towerflow.ps.partition import HashPartitioner, ModPartitioner, partitioner_from_dict
from towerflow.ps.server.tables.dynamic import DynamicRowStore
from towerflow.ps.server.tables.keyindex import KeyIndex
from towerflow.ps.server.tables.rows import DenseRowStore
from towerflow.ps.server.tables.stores import row_store_from_dict
from towerflow.ps.spec.initializers import UniformRows
from towerflow.ps.spec.row_optimizers import (
    SparseAdagrad,
    SparseFtrl,
    SparseLazyAdam,
    SparseSGD,
)
from towerflow.ps.spec.tables import check_options

EXTREMES = torch.tensor([-2**63, -1, 0, 2**63 - 1])
INIT = UniformRows(seed=3)


def store(optimizer=None, shards: int = 1, shard: int = 0, **options) -> DynamicRowStore:
    opts = {"admit_after": 1, "evict_after_steps": None, "capacity": None, **options}
    return DynamicRowStore(HashPartitioner(shards), shard, 3, optimizer or SparseSGD(),
                           initializer=INIT, options=opts)


def test_hash_partitioner_spreads_strided_ids_that_mod_puts_on_one_shard():
    ids = torch.arange(0, 4000 * 1024, 1024)  # raw ids on a stride of the shard count
    assert torch.bincount(ModPartitioner(4).shard_of(ids), minlength=4).tolist() == [4000, 0, 0, 0]
    counts = torch.bincount(HashPartitioner(4).shard_of(ids), minlength=4)
    assert int(counts.min()) > 900
    assert partitioner_from_dict(HashPartitioner(3).to_dict()) == HashPartitioner(3)
    with pytest.raises(InvalidArgumentError, match="num_rows must be None"):
        HashPartitioner(2, num_rows=10)


def test_key_index_matches_a_dict_through_inserts_removals_and_rebuilds():
    index, ref = KeyIndex(capacity=16), {}
    gen = torch.Generator().manual_seed(1)
    for round_ in range(60):
        keys = torch.unique(torch.cat([
            torch.randint(-2**63, 2**63 - 1, (300,), generator=gen, dtype=torch.int64),
            torch.randint(-50, 50, (100,), generator=gen), EXTREMES]))
        new = keys[index.find(keys) < 0]
        for key, slot in zip(new.tolist(), index.insert(new).tolist(), strict=True):
            ref[key] = slot
        if round_ % 2:
            gone = list(ref)[::3]
            index.remove(torch.tensor([ref.pop(k) for k in gone], dtype=torch.int64))
    keys = torch.tensor(list(ref), dtype=torch.int64)
    assert index.live == len(ref)
    assert index.find(keys).tolist() == list(ref.values())
    assert len(set(ref.values())) == len(ref)  # one slot per key, freed slots reused
    assert index.used < 2 * len(ref) + 1000


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1), unique=True, max_size=300),
       st.lists(st.integers(-2**63, 2**63 - 1), max_size=50))
def test_key_index_finds_exactly_the_keys_inserted(inserted, probes):
    index = KeyIndex(capacity=16)
    slots = index.insert(torch.tensor(inserted, dtype=torch.int64))
    held = dict(zip(inserted, slots.tolist(), strict=True))
    asked = torch.tensor(inserted + probes, dtype=torch.int64)
    assert index.find(asked).tolist() == [held.get(k, -1) for k in inserted + probes]


def test_extreme_ids_round_trip_and_a_missing_id_reads_its_initializer_without_storing():
    s = store()
    before = s.lookup(EXTREMES)
    assert torch.equal(before, INIT(EXTREMES, 3, torch.float32))
    assert s.num_rows == 0  # a lookup stores nothing
    s.apply(EXTREMES, torch.ones(4, 3), 0.5, 1)
    assert s.num_rows == 4 and s.counters["admitted"] == 4
    assert torch.allclose(s.lookup(EXTREMES), before - 0.5)
    assert torch.equal(s.lookup(torch.tensor([5])), INIT(torch.tensor([5]), 3, torch.float32))


def test_admission_drops_gradients_until_the_nth_push_and_counts_them():
    s = store(admit_after=3)
    one = torch.tensor([77])
    for push in range(2):
        s.observe(one)
        s.apply(one, torch.ones(1, 3), 1.0, push + 1)
        assert s.num_rows == 0
        assert torch.equal(s.lookup(one), INIT(one, 3, torch.float32))
    assert s.counters["filtered"] == 2
    s.observe(one)
    s.apply(one, torch.ones(1, 3), 1.0, 3)  # the third push makes the row and applies
    assert s.num_rows == 1 and s.counters["admitted"] == 1
    assert torch.allclose(s.lookup(one), INIT(one, 3, torch.float32) - 1.0)
    assert s._counts.live == 0  # the counter record went when the row was made


def test_eviction_by_steps_removes_stale_rows_with_their_slots():
    s = store(SparseAdagrad(), evict_after_steps=3)
    old, fresh = torch.tensor([1, 2]), torch.tensor([3])
    s.apply(old, torch.ones(2, 3), 0.1, 1)
    for step in range(2, 7):
        s.apply(fresh, torch.ones(1, 3), 0.1, step)
    assert s.num_rows == 1 and s.counters["evicted"] == 2
    assert torch.equal(s.lookup(old), INIT(old, 3, torch.float32))  # back to the start
    s.apply(old, torch.ones(2, 3), 0.1, 7)  # made again: its accumulator starts afresh
    export = s.export()
    row = (export.ids == 1).nonzero()[0, 0]
    assert torch.allclose(export.slots["accumulator"][row], torch.full((3,), 1.1))


def test_capacity_keeps_at_most_the_shards_share_evicting_the_least_recently_updated():
    s = store(capacity=64)
    for step in range(1, 41):
        s.apply(torch.arange(step * 10, step * 10 + 10), torch.ones(10, 3), 0.1, step)
        assert s.num_rows <= 64
    held = s.export().ids
    assert int(held.min()) >= 400 - 64  # the newest ids stayed
    assert s.counters["evicted"] == 400 - s.num_rows
    # the share is per shard: capacity 64 over 2 shards keeps 32 rows here
    half = store(capacity=64, shards=2)
    ids = torch.arange(1000)
    mine = ids[HashPartitioner(2).shard_of(ids) == 0]
    half.apply(mine, torch.ones(mine.numel(), 3), 0.1, 1)
    assert half.num_rows <= 32


def test_memory_stays_flat_when_ten_times_capacity_distinct_ids_pass():
    s = store(capacity=2000)
    sizes = []
    for step in range(1, 201):  # 20,000 distinct ids, 10x the capacity
        s.apply(torch.arange(step * 100, step * 100 + 100) * 7919, torch.ones(100, 3), 0.1, step)
        if step >= 40:
            sizes.append(s.nbytes)
    assert max(sizes) <= 1.1 * min(sizes)


@pytest.mark.parametrize("optimizer", [SparseSGD(), SparseAdagrad(), SparseLazyAdam(),
                                       SparseFtrl()], ids=lambda o: o.name)
def test_each_optimizer_matches_the_fixed_table_on_the_same_ids(optimizer):
    dense = DenseRowStore(ModPartitioner(1, num_rows=50), 0, 3, optimizer, initializer=INIT)
    dyn = store(optimizer)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 6):
        ids = torch.randint(0, 50, (20,), generator=gen)
        grads = torch.randn(20, 3, generator=gen)
        dense.apply(ids, grads, 0.1, step)
        dyn.apply(ids, grads, 0.1, step)
    everything = torch.arange(50)
    assert torch.allclose(dyn.lookup(everything), dense.lookup(everything), atol=1e-6)
    got, want = dyn.export(), dense.export()
    for name in optimizer.slot_names:
        assert torch.allclose(got.slots[name], want.slots[name].index_select(0, got.ids))


def test_nan_gradients_are_refused_and_nothing_is_applied():
    s = store(admit_after=1)
    s.apply(torch.tensor([1]), torch.ones(1, 3), 0.1, 1)
    before = s.export()
    grads = torch.ones(2, 3)
    grads[1, 0] = float("nan")
    with pytest.raises(InvalidArgumentError, match="not finite; nothing was applied"):
        s.apply(torch.tensor([1, 2]), grads, 0.1, 2)
    after = s.export()
    assert torch.equal(after.ids, before.ids) and torch.equal(after.rows, before.rows)


@pytest.mark.parametrize("options, pattern", [
    ({"capacity": 0}, r"capacity=0: it must be an integer in \[1, 2\*\*31\)"),
    ({"admit_after": 0}, r"admit_after=0: it must be an integer .*1 makes a row"),
    ({"evict_after_steps": -1}, r"evict_after_steps=-1"),
    ({"admit_after": 1.5}, r"admit_after=1.5"),
])
def test_bad_options_are_refused_with_the_value_named(options, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        check_options({"admit_after": 1, "evict_after_steps": None, "capacity": None, **options})
    with pytest.raises(InvalidArgumentError, match=pattern):
        store(**options)


def test_ids_of_the_wrong_dtype_or_shard_are_refused():
    s = store(shards=2)
    with pytest.raises(InvalidArgumentError, match="dtype torch.int64, got torch.int32"):
        s.lookup(torch.tensor([1], dtype=torch.int32))
    other = next(i for i in range(100) if int(HashPartitioner(2).shard_of(torch.tensor([i]))[0]))
    with pytest.raises(InvalidArgumentError, match="belongs to shard 1"):
        s.apply(torch.tensor([other]), torch.ones(1, 3), 0.1, 1)


def test_export_and_import_carry_rows_slots_and_versions_and_rebuild_from_description():
    s = store(SparseLazyAdam(), evict_after_steps=100)
    ids = torch.tensor([-2**63, 5, 2**63 - 1])
    s.apply(ids, torch.ones(3, 3), 0.1, 4)
    s.apply(ids[:1], torch.ones(1, 3), 0.1, 9)
    export = s.export()
    assert export.ids.tolist() == sorted(ids.tolist())
    assert export.versions.tolist() == [9, 4, 4]
    fresh = row_store_from_dict(s.describe())
    assert isinstance(fresh, DynamicRowStore) and fresh.options == s.options
    fresh.import_(export.ids, export.rows, export.slots, export.versions)
    again = fresh.export()
    assert torch.equal(again.rows, export.rows) and torch.equal(again.versions, export.versions)
    assert torch.equal(again.slots["m"], export.slots["m"])
    assert torch.equal(fresh.lookup(ids), s.lookup(ids))


def test_an_export_in_progress_holds_eviction_back():
    s = store(capacity=8)
    s.apply(torch.arange(8), torch.ones(8, 3), 0.1, 1)
    plan = s.begin_export()
    s.apply(torch.arange(100, 110), torch.ones(10, 3), 0.1, 2)  # over capacity, no eviction
    piece = s.export_piece(plan, 0, 8)
    assert piece.ids.tolist() == list(range(8))
    assert torch.equal(piece.rows, s.lookup(torch.arange(8)))
    s.end_export()
    s.apply(torch.tensor([200]), torch.ones(1, 3), 0.1, 3)
    assert s.num_rows <= 8


def test_age_eviction_scans_a_bounded_window_per_update_and_sweeps_round():
    s = store(evict_after_steps=1)
    old = torch.arange(70_000)
    s.apply(old, torch.ones(70_000, 3), 0.1, 1)
    fresh = torch.tensor([-7])
    s.apply(fresh, torch.ones(1, 3), 0.1, 3)  # one window scanned: the 70,000 - 65,536 after
    assert s.counters["evicted"] == 70_000 - 65_536  # the first update's window
    s.apply(fresh, torch.ones(1, 3), 0.1, 4)  # the sweep goes round: the first 65,536
    assert s.counters["evicted"] == 70_000 and s.num_rows == 1
    assert s.export().ids.tolist() == [-7]


def test_a_push_after_its_lookup_updates_the_right_rows_when_rows_moved_in_between():
    s = store(capacity=4)
    ids = torch.tensor([1, 2, 3])
    s.apply(ids, torch.ones(3, 3), 0.1, 1)
    s.lookup(ids)  # the slots of this lookup are kept for the push that follows
    s.apply(torch.tensor([10, 11, 12]), torch.ones(3, 3), 0.1, 2)  # evicts 1, 2: slots reused
    s.apply(torch.tensor([5]), torch.ones(1, 3), 0.1, 3)  # evicts 3
    s.apply(ids, torch.ones(3, 3), 0.1, 4)  # made again; nobody else's row is touched
    held = s.export()
    assert held.ids.tolist() == sorted(held.ids.tolist()) and s.num_rows <= 4
    # every row held was made, then updated once: its initializer's value - 0.1
    assert torch.allclose(held.rows, INIT(held.ids, 3, torch.float32) - 0.1)
    assert set(held.ids.tolist()) >= {1, 2, 3}


def test_admission_counters_export_and_import_and_refuse_bad_counts():
    s = store(admit_after=3)
    ids = torch.tensor([4, -9, 2**62])
    s.observe(ids)
    s.observe(ids[:1])
    s.apply(ids, torch.ones(3, 3), 0.1, 1)  # all below 3: dropped
    counter_ids, counts = s.export_counters()
    assert counter_ids.tolist() == sorted(ids.tolist())
    assert dict(zip(counter_ids.tolist(), counts.tolist(), strict=True)) == \
        {4: 2, -9: 1, 2**62: 1}
    fresh = row_store_from_dict(s.describe())
    fresh.import_counters(counter_ids, counts)
    fresh.observe(torch.tensor([4]))  # its third push: admitted
    fresh.apply(torch.tensor([4]), torch.ones(1, 3), 0.1, 2)
    assert fresh.num_rows == 1 and fresh.counters["filtered"] == 0
    with pytest.raises(InvalidArgumentError, match="counts >= 0"):
        fresh.import_counters(torch.tensor([5]), torch.tensor([-1]))
