"""The ps row store of a sparse table: lookup, apply, export / import, re-sharding, refusals."""

from __future__ import annotations

import json

import pytest
import torch

from towerflow.errors import InvalidArgumentError, ResourceExhaustedError
from towerflow.ps.partition import ModPartitioner, Partitioner, RangePartitioner
from towerflow.ps.server.tables.rows import DenseRowStore, RowExport, RowStore, split_export
from towerflow.ps.server.tables.stores import row_store_from_dict
from towerflow.ps.spec.initializers import ConstantRows, UniformRows, initializer_from_dict
from towerflow.ps.spec.row_optimizers import (
    SparseAdagrad,
    SparseFtrl,
    SparseLazyAdam,
    SparseOptimizer,
    SparseSGD,
)

NUM_ROWS, DIM = 40, 3
OPTIMIZERS = [SparseSGD(), SparseAdagrad(), SparseLazyAdam(),
              SparseFtrl(l1_regularization_strength=0.01, l2_regularization_strength=0.1)]


def stores(part: Partitioner, opt: SparseOptimizer, **kw) -> list[DenseRowStore]:
    kw.setdefault("initializer", UniformRows(seed=1))
    return [DenseRowStore(part, s, DIM, opt, **kw) for s in range(part.num_shards)]


def push(shards: list[DenseRowStore], ids: torch.Tensor, grads: torch.Tensor, step: int,
         lr: float = 0.1) -> None:
    """What a worker does: one request per shard."""
    for store, (pos, shard_ids) in zip(shards, shards[0].partitioner.split(ids), strict=True):
        store.apply(shard_ids, grads.index_select(0, pos), lr, step)


def gather(shards: list[DenseRowStore]) -> RowExport:
    """All shards' exports as one, sorted by id (for comparing tables)."""
    parts = [s.export() for s in shards]
    ids = torch.cat([p.ids for p in parts])
    order = torch.argsort(ids)
    rows = torch.cat([p.rows for p in parts])[order]
    slots = {k: torch.cat([p.slots[k] for p in parts])[order] for k in parts[0].slots}
    return RowExport(ids[order], rows, slots)


def assert_same(a: RowExport, b: RowExport) -> None:
    assert torch.equal(a.ids, b.ids)
    assert torch.equal(a.rows, b.rows)
    assert a.slots.keys() == b.slots.keys()
    for k in a.slots:
        assert torch.equal(a.slots[k], b.slots[k]), k


def train(shards: list[DenseRowStore], steps: range, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for step in steps:
        ids = torch.randint(0, NUM_ROWS, (25,), generator=gen)
        push(shards, ids, torch.randn(25, DIM, generator=gen), step)


def test_lookup_returns_exactly_the_requested_rows_as_a_copy():
    part = ModPartitioner(3, num_rows=NUM_ROWS)
    shards = stores(part, SparseAdagrad())
    table = gather(shards).rows
    ids = torch.tensor([37, 1, 37, 10, 4])
    out = torch.empty(ids.numel(), DIM)
    for store, (pos, shard_ids) in zip(shards, part.split(ids), strict=True):
        out.index_copy_(0, pos, store.lookup(shard_ids))
    assert torch.equal(out, table[ids])
    got = shards[1].lookup(torch.tensor([1]))
    got += 100.0
    assert torch.equal(shards[1].lookup(torch.tensor([1])), table[[1]])
    assert shards[0].lookup(torch.empty(0, dtype=torch.int64)).shape == (0, DIM)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_a_push_with_duplicate_ids_sums_them(opt):
    part = ModPartitioner(1, num_rows=NUM_ROWS)
    (dup,), (summed,) = stores(part, opt), stores(part, opt)
    g = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.25, -1.0], [4.0, 4.0, 4.0]])
    dup.apply(torch.tensor([7, 3, 7]), g, 0.1, 1)
    summed.apply(torch.tensor([3, 7]), torch.stack([g[1], g[0] + g[2]]), 0.1, 1)
    assert_same(dup.export(), summed.export())


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("part", [ModPartitioner(3, num_rows=NUM_ROWS),
                                  RangePartitioner(NUM_ROWS, 4)], ids=repr)
def test_sharded_table_trains_exactly_as_one_shard(opt, part):
    one = stores(ModPartitioner(1, num_rows=NUM_ROWS), opt)
    many = stores(part, opt)
    train(one, range(1, 6))
    train(many, range(1, 6))
    assert_same(gather(one), gather(many))


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_apply_matches_the_optimizer_on_touched_rows_only(opt):
    (store,) = stores(ModPartitioner(1, num_rows=NUM_ROWS), opt)
    before = store.export()
    ids = torch.tensor([5, 9, 2])
    grads = torch.randn(3, DIM, generator=torch.Generator().manual_seed(4))
    store.apply(ids, grads, 0.2, 1)
    var, slots = before.rows.clone(), {k: v.clone() for k, v in before.slots.items()}
    opt.apply(var, slots, torch.tensor([2, 5, 9]), grads[[2, 0, 1]], lr=0.2, step=1)
    assert_same(store.export(), RowExport(before.ids, var, slots))
    untouched = torch.ones(NUM_ROWS, dtype=torch.bool)
    untouched[ids] = False
    after = store.export()
    assert torch.equal(after.rows[untouched], before.rows[untouched])
    assert all(torch.equal(after.slots[k][untouched], before.slots[k][untouched])
               for k in after.slots)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_export_import_round_trip(opt):
    part = ModPartitioner(2, num_rows=NUM_ROWS)
    shards = stores(part, opt)
    train(shards, range(1, 4))
    fresh = stores(part, opt, initializer=ConstantRows(7.0))
    for store, new in zip(shards, fresh, strict=True):
        export = store.export()
        new.import_(export.ids, export.rows, export.slots)
        assert_same(new.export(), export)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize(
    ("old", "new"),
    [
        (ModPartitioner(1, num_rows=NUM_ROWS), ModPartitioner(2, num_rows=NUM_ROWS)),
        (ModPartitioner(2, num_rows=NUM_ROWS), ModPartitioner(1, num_rows=NUM_ROWS)),
        (ModPartitioner(2, num_rows=NUM_ROWS), RangePartitioner(NUM_ROWS, 3)),
    ],
    ids=["1->2", "2->1", "mod2->range3"],
)
def test_resharding_by_export_and_import_keeps_rows_and_slots(opt, old, new):
    before = stores(old, opt)
    train(before, range(1, 4))
    after = stores(new, opt, initializer=ConstantRows(0.0))
    for store in before:  # one old shard at a time: never the whole table in one piece
        for target, piece in zip(after, split_export(store.export(), new), strict=True):
            target.import_(piece.ids, piece.rows, piece.slots)
    assert_same(gather(before), gather(after))
    train(before, range(4, 7), seed=1)
    train(after, range(4, 7), seed=1)
    assert_same(gather(before), gather(after))


def test_import_without_slots_starts_their_optimizer_state_afresh():
    (store,) = stores(ModPartitioner(1, num_rows=NUM_ROWS), SparseFtrl())
    train([store], range(1, 3))
    store.import_(torch.tensor([4, 6]), torch.ones(2, DIM))
    out = store.export()
    assert torch.equal(out.rows[[4, 6]], torch.ones(2, DIM))
    assert bool(out.slots["accumulator"][[4, 6]].eq(0.1).all())
    assert bool(out.slots["linear"][[4, 6]].eq(0.0).all())


def test_huge_finite_values_are_accepted():
    store = stores(ModPartitioner(1, num_rows=NUM_ROWS), SparseSGD())[0]
    rows = torch.full((2, DIM), 3e38)  # their float32 sum overflows; every value is finite
    store.import_(torch.tensor([1, 2]), rows)
    assert torch.equal(store.lookup(torch.tensor([2, 1])), rows)


def test_uniform_rows_do_not_depend_on_the_sharding():
    one = gather(stores(ModPartitioner(1, num_rows=NUM_ROWS), SparseSGD()))
    three = gather(stores(RangePartitioner(NUM_ROWS, 3), SparseSGD()))
    assert torch.equal(one.rows, three.rows)
    assert float(one.rows.min()) >= -0.05 and float(one.rows.max()) < 0.05
    assert torch.unique(one.rows).numel() == NUM_ROWS * DIM
    other = UniformRows(seed=2)(torch.arange(NUM_ROWS), DIM, torch.float32)
    assert not torch.equal(other, one.rows)


@pytest.mark.parametrize("init", [ConstantRows(), ConstantRows(0.5), UniformRows(-1.0, 1.0, 9)],
                         ids=repr)
def test_initializer_dict_round_trips(init):
    assert initializer_from_dict(json.loads(json.dumps(init.to_dict()))) == init


def test_sizes_and_description():
    store = stores(RangePartitioner(10, 3), SparseFtrl())[0]
    assert store.num_rows == 4
    assert store.nbytes == 3 * 4 * DIM * 4  # rows + accumulator + linear, float32
    desc = json.loads(json.dumps(store.describe()))
    assert desc["kind"] == "dense" and desc["dtype"] == "float32"
    assert desc["partitioner"] == {"kind": "range", "num_shards": 3, "num_rows": 10}
    assert desc["optimizer"]["name"] == "ftrl"
    assert isinstance(store, RowStore)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_a_store_rebuilt_from_its_description_starts_the_same(opt):
    store = DenseRowStore(RangePartitioner(NUM_ROWS, 3), 2, DIM, opt, dtype=torch.float64,
                          initializer=UniformRows(-0.5, 0.5, seed=4))
    again = row_store_from_dict(json.loads(json.dumps(store.describe())))
    assert again.describe() == store.describe()
    assert_same(again.export(), store.export())


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [({"dtype": "float16"}, r"Unknown row store kind 'dense' or dtype 'float16'"),
     ({"kind": "hash"}, r"Unknown row store kind 'hash'"),
     ({"extra": 1}, r"exactly the keys"),
     ({"shard": 5}, r"Shard 5 does not exist"),
     ({"optimizer": {"name": "adam", "hyper": {}}}, r"Unknown sparse optimizer 'adam'")],
)
def test_bad_store_descriptions_are_refused(edit, pattern):
    desc = {**stores(ModPartitioner(2, num_rows=NUM_ROWS), SparseSGD())[0].describe(), **edit}
    with pytest.raises(InvalidArgumentError, match=pattern):
        row_store_from_dict(desc)


def snapshot(store: DenseRowStore) -> RowExport:
    return store.export()


BAD_APPLY = [
    (torch.tensor([2, -2]), torch.ones(2, DIM), r"ids\[1\] = -2 is not in \[0, 40\)"),
    (torch.tensor([2, 40]), torch.ones(2, DIM), r"ids\[1\] = 40 is not in \[0, 40\)"),
    (torch.tensor([2, 3]), torch.ones(2, DIM), r"ids\[1\] = 3 belongs to shard 1, not shard 0"),
    (torch.tensor([2, 4], dtype=torch.int32), torch.ones(2, DIM), r"dtype torch.int64"),
    (torch.tensor([2.0]), torch.ones(1, DIM), r"dtype torch.int64, got torch.float32"),
    (torch.tensor([2, 4]), torch.ones(2, DIM + 1),
     r"row_grads has shape \[2, 4\] but 2 ids of a table with 3 values per row need \[2, 3\]"),
    (torch.tensor([2, 4]), torch.ones(3, DIM), r"row_grads has shape \[3, 3\]"),
    (torch.tensor([2, 4]), torch.ones(2, DIM, dtype=torch.float64),
     r"row_grads has dtype torch.float64 but the table holds torch.float32"),
    (torch.tensor([2, 4]), torch.tensor([[1.0, 1, 1], [1, float("nan"), 1]]),
     r"row_grads\[1\] \(id 4\) holds \[1.0, nan, 1.0\], not finite; nothing was applied"),
    (torch.tensor([2, 4]), torch.tensor([[float("inf"), 1, 1], [1.0, 1, 1]]),
     r"row_grads\[0\] \(id 2\) holds \[inf"),
    (torch.tensor([2, 4]), [[1.0] * DIM] * 2, r"row_grads must be a torch.Tensor, got list"),
]


@pytest.mark.parametrize(("ids", "grads", "pattern"), BAD_APPLY)
@pytest.mark.parametrize("opt", [SparseAdagrad(), SparseLazyAdam()], ids=repr)
def test_bad_push_is_refused_with_nothing_applied(opt, ids, grads, pattern):
    shards = stores(ModPartitioner(2, num_rows=NUM_ROWS), opt)
    train(shards, range(1, 2))  # slots away from their start
    shard0 = shards[0]
    before = snapshot(shard0)
    with pytest.raises(InvalidArgumentError, match=pattern):
        shard0.apply(ids, grads, 0.1, 2)
    assert_same(snapshot(shard0), before)


@pytest.mark.parametrize(
    ("lr", "step", "pattern"),
    [(float("inf"), 1, r"learning rate must be a finite number"),
     (0.1, 0, r"step must be the update's number")],
)
def test_bad_learning_rate_or_step_is_refused_with_nothing_applied(lr, step, pattern):
    (store,) = stores(ModPartitioner(1, num_rows=NUM_ROWS), SparseLazyAdam())
    before = snapshot(store)
    with pytest.raises(InvalidArgumentError, match=pattern):
        store.apply(torch.tensor([1, 1]), torch.ones(2, DIM), lr, step)
    assert_same(snapshot(store), before)


@pytest.mark.parametrize(
    ("ids", "pattern"),
    [(torch.tensor([-1]), r"ids\[0\] = -1 is not in \[0, 40\)"),
     (torch.tensor([41]), r"ids\[0\] = 41 is not in"),
     (torch.tensor([1]), r"ids\[0\] = 1 belongs to shard 1, not shard 0"),
     (torch.tensor([[0]]), r"must be 1-D"),
     (torch.tensor([0], dtype=torch.uint8), r"dtype torch.int64, got torch.uint8")],
)
def test_bad_lookup_is_refused(ids, pattern):
    store = stores(ModPartitioner(2, num_rows=NUM_ROWS), SparseSGD())[0]
    with pytest.raises(InvalidArgumentError, match=pattern):
        store.lookup(ids)


def test_bad_import_is_refused_with_nothing_changed():
    store = stores(ModPartitioner(2, num_rows=NUM_ROWS), SparseAdagrad())[0]
    ids = torch.tensor([0, 2])
    rows, acc = torch.ones(2, DIM), torch.full((2, DIM), 0.5)
    cases = [
        (torch.tensor([0, 0]), rows, {"accumulator": acc}, r"got id 0 more than once"),
        (torch.tensor([0, 1]), rows, {"accumulator": acc}, r"belongs to shard 1"),
        (ids, rows, {"m": acc}, r"adagrad optimizer keeps slots \['accumulator'\], got \['m'\]"),
        (ids, rows, {"accumulator": acc, "linear": acc}, r"keeps slots"),
        (ids, rows, [acc], r"got list.*slots=None"),
        (ids, rows, {"accumulator": torch.ones(2, DIM + 1)}, r"slots\['accumulator'\] has shape"),
        (ids, rows, {"accumulator": acc.clone().fill_(float("nan"))},
         r"slots\['accumulator'\]\[0\] \(id 0\) holds \[nan"),
        (ids, torch.tensor([[1.0, 1, 1], [float("-inf"), 1, 1]]), None,
         r"rows\[1\] \(id 2\) holds \[-inf"),
        (ids, rows.double(), None, r"rows has dtype torch.float64.*\.to\(torch.float32\)"),
    ]
    before = snapshot(store)
    for bad_ids, bad_rows, bad_slots, pattern in cases:
        with pytest.raises(InvalidArgumentError, match=pattern):
            store.import_(bad_ids, bad_rows, bad_slots)
        assert_same(snapshot(store), before)


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: DenseRowStore(ModPartitioner(2), 0, DIM, SparseSGD()),
         r"needs a table of fixed size.*give the partitioner num_rows"),
        (lambda: DenseRowStore(ModPartitioner(2, num_rows=4), 2, DIM, SparseSGD()),
         r"Shard 2 does not exist"),
        (lambda: DenseRowStore(ModPartitioner(2, num_rows=4), 0, 0, SparseSGD()),
         r"dim must be an integer >= 1, got 0"),
        (lambda: DenseRowStore(ModPartitioner(2, num_rows=4), 0, DIM, "adagrad"),
         r"optimizer must be a SparseOptimizer"),
        (lambda: DenseRowStore({"kind": "mod"}, 0, DIM, SparseSGD()),
         r"partitioner must be a Partitioner, got dict"),
        (lambda: DenseRowStore(ModPartitioner(1, num_rows=4), 0, DIM, SparseSGD(),
                               dtype=torch.float16), r"dtype must be one of"),
        (lambda: DenseRowStore(ModPartitioner(1, num_rows=4), 0, DIM, SparseSGD(),
                               initializer=lambda ids, dim, dtype: None),
         r"initializer must be a RowInitializer"),
        (lambda: UniformRows(1.0, -1.0), r"need finite minval <= maxval"),
        (lambda: initializer_from_dict({"kind": "gaussian"}), r"'kind' one of"),
        (lambda: initializer_from_dict({"kind": "uniform", "mean": 0.0}),
         r"Bad 'uniform' initializer fields \['mean'\]"),
    ],
)
def test_bad_store_arguments_are_refused(make, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        make()


def test_checked_lookups_and_updates_match_the_checking_ones():
    from towerflow.ps.spec.row_optimizers import SparseAdagrad

    part = ModPartitioner(2, num_rows=40)
    stores = [DenseRowStore(part, 1, 3, SparseAdagrad(), initializer=UniformRows(seed=5))
              for _ in range(2)]
    ids = torch.tensor([7, 3, 39, 7])
    grads = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    stores[0].apply(ids, grads, 0.1, 1)
    stores[1].apply(ids, grads, 0.1, 1, checked=True)
    assert torch.equal(stores[0].lookup(ids), stores[1].lookup(ids, checked=True))
    assert torch.equal(part.local_index(ids, 1), part.local_index(ids, 1, checked=True))
    assert torch.equal(stores[0].export().rows, stores[1].export().rows)


@pytest.mark.parametrize("num_rows", [1 << 31, 1 << 40])
def test_a_table_larger_than_the_free_memory_is_refused_before_anything_is_allocated(num_rows):
    import psutil

    rss = psutil.Process().memory_info().rss
    with pytest.raises(ResourceExhaustedError,
                       match=rf"Table shard 0 of {num_rows // 2:,} rows x 64 \(with 2 optimizer "
                             r"slot\(s\)\) needs [\d,]+ MiB but only [\d,]+ MiB are available; add "
                             r"ps tasks"):
        DenseRowStore(ModPartitioner(2, num_rows=num_rows), 0, 64, SparseLazyAdam())
    assert psutil.Process().memory_info().rss - rss < 64 << 20
