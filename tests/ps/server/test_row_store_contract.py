"""One contract for every row store: a fixed table's ``DenseRowStore`` and a dynamic
table's ``DynamicRowStore`` alike.

Each test runs against both kinds, built the way a ps task builds them (from their
description, ``row_store_from_dict``; exactly-once through the ``TableShard`` that wraps
the store, which is where a push's retry is recognised):

- lookup: a row never pushed is the initializer's value of its id, the same id gives
  the same row (in any order, twice in one call), and a lookup is a copy;
- apply: a row-wise optimizer step moves exactly the rows pushed, by the optimizer's
  arithmetic (repeated ids summed), and no other row;
- export / import: a fresh store given another's export holds the same rows and slots,
  and the next push moves both alike;
- exactly once: a push sent twice (a retry with the same worker, incarnation and seq)
  is applied once and answered as a duplicate; the next seq is applied.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from towerflow.ps.partition import HashPartitioner, ModPartitioner
from towerflow.ps.server.tables.rows import RowStore
from towerflow.ps.server.tables.shard import TableShard
from towerflow.ps.server.tables.stores import row_store_from_dict
from towerflow.ps.spec.initializers import UniformRows
from towerflow.ps.spec.row_optimizers import SparseAdagrad, SparseOptimizer, SparseSGD
from towerflow.ps.wire import tables_pb2 as tpb

KINDS = ["dense", "dynamic"]
NUM_ROWS, SHARDS, SHARD, DIM = 64, 2, 1, 3
INIT = UniformRows(minval=-1.0, maxval=1.0, seed=11)
#: a dynamic table that admits a row at its first push and never evicts (the contract's
#: store: every pushed row is held)
DYNAMIC = {"admit_after": 1, "evict_after_steps": None, "capacity": None}


def description(kind: str, optimizer: SparseOptimizer) -> dict:
    """What a ps task builds shard ``SHARD`` of a ``kind`` table from."""
    partitioner = ModPartitioner(SHARDS, num_rows=NUM_ROWS) if kind == "dense" \
        else HashPartitioner(SHARDS)
    out = {"kind": kind, "partitioner": partitioner.to_dict(), "shard": SHARD, "dim": DIM,
           "dtype": "float32", "optimizer": optimizer.to_dict(), "initializer": INIT.to_dict()}
    return {**out, "options": dict(DYNAMIC)} if kind == "dynamic" else out


def make(kind: str, optimizer: SparseOptimizer | None = None) -> RowStore:
    store = row_store_from_dict(description(kind, optimizer or SparseSGD()))
    assert store.kind == kind
    return store


def owned(store: RowStore, count: int) -> torch.Tensor:
    """The first ``count`` ids of the table's range that this shard owns."""
    ids = torch.arange(NUM_ROWS, dtype=torch.int64)
    mine = ids[store.partitioner.shard_of(ids) == store.shard]
    assert mine.numel() >= count
    return mine[:count]


def grads_for(count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_fresh_rows_are_the_initializers_and_the_same_id_gives_the_same_row(kind) -> None:
    store = make(kind)
    ids = owned(store, 8)
    start = INIT(ids, DIM, torch.float32)
    rows = store.lookup(ids)
    assert rows.shape == (8, DIM) and rows.dtype == torch.float32
    torch.testing.assert_close(rows, start, rtol=0, atol=0)
    assert not torch.equal(rows[0], rows[1])  # a row is its id's, not one value for all
    torch.testing.assert_close(store.lookup(ids.flip(0)), start.flip(0), rtol=0, atol=0)
    twice = store.lookup(torch.stack([ids[3], ids[5], ids[3]]))
    torch.testing.assert_close(twice, start[[3, 5, 3]], rtol=0, atol=0)
    rows.add_(100.0)  # the caller's copy
    torch.testing.assert_close(store.lookup(ids), start, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_apply_moves_exactly_the_pushed_rows_by_the_optimizer(kind) -> None:
    store = make(kind)  # SGD: row -= lr * (sum of the row's gradients)
    ids = owned(store, 8)
    start = store.lookup(ids)
    held = store.num_rows
    pushed = torch.stack([ids[1], ids[4], ids[1]])  # id 1 twice: its gradients summed
    grads = grads_for(3, seed=1)
    store.apply(pushed, grads, lr=0.5, step=1)
    expected = start.clone()
    expected[1] -= 0.5 * (grads[0] + grads[2])
    expected[4] -= 0.5 * grads[1]
    torch.testing.assert_close(store.lookup(ids), expected)
    untouched = [i for i in range(8) if i not in (1, 4)]
    torch.testing.assert_close(store.lookup(ids[untouched]), start[untouched], rtol=0, atol=0)
    # a fixed table holds every row from the start; a dynamic one the two rows pushed
    assert store.num_rows == (held if kind == "dense" else 2)


@pytest.mark.parametrize("kind", KINDS)
def test_an_export_imported_into_a_fresh_store_gives_the_same_state(kind) -> None:
    optimizer = SparseAdagrad(initial_accumulator_value=0.1)  # a slot to carry
    store = make(kind, optimizer)
    ids = owned(store, 8)
    for step, pushed in enumerate((ids[[0, 2, 5]], ids[[2, 7]], ids[[5]]), start=1):
        store.apply(pushed, grads_for(pushed.numel(), seed=step), lr=0.3, step=step)
    exported = store.export()
    assert set(exported.slots) == {"accumulator"}
    fresh = make(kind, optimizer)
    fresh.import_(exported.ids, exported.rows, exported.slots)

    again = fresh.export()
    torch.testing.assert_close(again.ids, exported.ids, rtol=0, atol=0)
    torch.testing.assert_close(again.rows, exported.rows, rtol=0, atol=0)
    torch.testing.assert_close(again.slots["accumulator"], exported.slots["accumulator"],
                               rtol=0, atol=0)
    torch.testing.assert_close(fresh.lookup(ids), store.lookup(ids), rtol=0, atol=0)
    assert fresh.num_rows == store.num_rows
    # the accumulators came along: the next push moves both stores alike
    grads = grads_for(2, seed=9)
    for s in (store, fresh):
        s.apply(ids[[0, 5]], grads, lr=0.3, step=4)
    torch.testing.assert_close(fresh.lookup(ids), store.lookup(ids), rtol=0, atol=0)
    moved = store.lookup(ids[[0, 5]])
    accumulator = exported.slots["accumulator"][torch.isin(exported.ids, ids[[0, 5]])]
    torch.testing.assert_close(
        moved, exported.rows[torch.isin(exported.ids, ids[[0, 5]])]
        - 0.3 * grads / torch.sqrt(accumulator + grads * grads))


def table_spec(kind: str) -> tpb.TableSpec:
    """The ``TableSpec`` a worker sends for shard ``SHARD`` of a ``kind`` table (SGD)."""
    data = description(kind, SparseSGD())
    store = "" if kind == "dense" else json.dumps({"kind": "dynamic", **data["options"]})
    return tpb.TableSpec(name="t", num_rows=NUM_ROWS if kind == "dense" else 0, dim=DIM,
                         dtype="float32", partitioner=json.dumps(data["partitioner"]),
                         optimizer=json.dumps(data["optimizer"]),
                         initializer=json.dumps(data["initializer"]), shard=SHARD, store=store)


def push_request(ids: torch.Tensor, grads: torch.Tensor, seq: int) -> tpb.PushRowsRequest:
    return tpb.PushRowsRequest(table="t", shard=SHARD, worker_id=0, incarnation=7, seq=seq,
                               lr=0.5, step=seq, num_ids=ids.numel(), dtype="float32",
                               ids=ids.numpy().tobytes(), grads=grads.numpy().tobytes())


def pulled(shard: TableShard, ids: torch.Tensor) -> torch.Tensor:
    data = shard.pull(ids.numpy().tobytes(), ids.numel())
    return torch.from_numpy(np.frombuffer(data, np.float32).copy()).view(ids.numel(), DIM)


@pytest.mark.parametrize("kind", KINDS)
def test_a_push_sent_twice_is_applied_once(kind) -> None:
    shard = TableShard(table_spec(kind))
    assert shard.store.kind == kind
    ids = owned(shard.store, 4)
    start = INIT(ids, DIM, torch.float32)
    pushed, grads = ids[[0, 2]], grads_for(2, seed=3)
    first, applied = shard.push(push_request(pushed, grads, seq=1))
    assert (first.status, first.duplicate, applied) == ("applied", False, 1)
    retry, applied = shard.push(push_request(pushed, grads, seq=1))  # the same push again
    assert (retry.status, retry.duplicate, applied) == ("applied", True, 1)
    once = start.clone()
    once[[0, 2]] -= 0.5 * grads
    torch.testing.assert_close(pulled(shard, ids), once)
    assert shard.status()["applied"] == 1

    following, applied = shard.push(push_request(pushed, grads, seq=2))  # a new push
    assert (following.status, following.duplicate, applied) == ("applied", False, 2)
    twice = start.clone()
    twice[[0, 2]] -= 2 * 0.5 * grads
    torch.testing.assert_close(pulled(shard, ids), twice)
