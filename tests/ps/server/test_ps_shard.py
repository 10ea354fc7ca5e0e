"""The ps shard state: server-side optimizers, validation of pushes, de-duplication."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from towerflow.errors import InvalidArgumentError
from towerflow.ps.memory import tune_malloc
from towerflow.ps.placement import plan_placement
from towerflow.ps.server.dense import admission as admission_module
from towerflow.ps.server.dense.aggregation import AggregationConfig
from towerflow.ps.server.dense.optimizers import make_optimizer
from towerflow.ps.server.dense.records import LedgerRecord
from towerflow.ps.server.dense.shard import DenseShard, ShardState
from towerflow.ps.wire.calls import APPLIED, REFUSED, STALE
from towerflow.ps.wire.finite import all_finite
from towerflow.ps.wire.messages import PushHeader

SHAPES = {"weight": (2, 3), "bias": (3,)}


def make_shard(opt: str = "sgd", **opt_kw):
    layout = plan_placement(SHAPES, 1).shards[0]
    init = np.arange(layout.numel, dtype=np.float32)
    state = ShardState(layout, init.copy(), make_optimizer(opt, layout.numel, **opt_kw))
    return state, DenseShard(state, AggregationConfig("async", total_num_replicas=2)).aggregator


def header(state, worker=0, seq=1, **kw) -> PushHeader:
    fields = dict(worker_id=worker, seq=seq, token=state.step, lr=0.5,
                  numel=state.layout.numel, segments=state.layout.signature)
    fields.update(kw)
    return PushHeader(**fields)


def chunks(values: np.ndarray, pieces: int = 2) -> list[bytes]:
    return [part.tobytes() for part in np.array_split(values.astype(np.float32), pieces)]


@pytest.mark.parametrize(
    ("name", "kw", "torch_opt"),
    [
        ("sgd", {"weight_decay": 0.01},
         lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01)),
        ("momentum", {"momentum": 0.9, "weight_decay": 0.01},
         lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
        ("adam", {"betas": (0.8, 0.99), "weight_decay": 0.01},
         lambda p: torch.optim.Adam(p, lr=0.1, betas=(0.8, 0.99), weight_decay=0.01)),
        ("adagrad", {"initial_accumulator_value": 0.1},
         lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1)),
    ],
)
def test_server_optimizer_matches_torch_optim(name, kw, torch_opt) -> None:
    gen = torch.Generator().manual_seed(0)
    n = 70_000  # more than one block of the blockwise update
    start = torch.randn(n, generator=gen)
    param = torch.nn.Parameter(start.clone())
    reference = torch_opt([param])
    flat = start.numpy().copy()
    opt = make_optimizer(name, n, **kw)
    for _ in range(4):
        grad = torch.randn(n, generator=gen)
        param.grad = grad.clone()
        reference.step()
        opt.apply(flat, grad.numpy().copy(), 0.1)
    np.testing.assert_allclose(flat, param.detach().numpy(), atol=1e-5)
    assert opt.step == 4


def test_unknown_optimizer_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"Unknown optimizer 'rmsprop'"):
        make_optimizer("rmsprop", 4)


def test_push_applies_gradient_and_advances_step() -> None:
    state, agg = make_shard()
    before = state.params.copy()
    outcome = agg.push(header(state), chunks(np.ones(9)))
    assert outcome.status == APPLIED and outcome.step == 1
    np.testing.assert_allclose(state.params, before - 0.5)
    assert state.stats.applied == 1 and state.stats.updates == 1


def test_wrong_shape_is_refused_naming_variable_and_shapes() -> None:
    state, agg = make_shard()
    before = state.params.copy()
    bad = header(state, segments=(("weight", (3, 2)), ("bias", (3,))))
    outcome = agg.push(bad, chunks(np.ones(9)))
    assert outcome.status == REFUSED
    assert "variable 'weight' has shape [3, 2] but the parameter has shape [2, 3]" in outcome.message
    np.testing.assert_array_equal(state.params, before)
    assert state.stats.refused == 1 and state.step == 0


def test_wrong_dtype_and_size_are_refused() -> None:
    state, agg = make_shard()
    outcome = agg.push(header(state, dtype="float16"), chunks(np.ones(9)))
    assert outcome.status == REFUSED and "dtype float16" in outcome.message
    outcome = agg.push(header(state, seq=2, numel=8, segments=()), chunks(np.ones(8)))
    assert outcome.status == REFUSED and "has 8 elements but the shard holds 9" in outcome.message
    assert state.stats.refused == 2


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_nonfinite_gradient_ends_the_push_at_its_chunk_and_is_refused(bad_value) -> None:
    """Chunks before the bad one stay applied; that chunk and the rest are not (no NaN in
    the parameters); the refusal says so, and its retry gets the refusal, not a second update."""
    state, agg = make_shard()
    before = state.params.copy()
    grad = np.ones(9, np.float32)
    grad[7] = bad_value  # an element of 'bias', in the second chunk (elements 5..8)
    outcome = agg.push(header(state), chunks(grad))
    assert outcome.status == REFUSED
    assert "contains NaN or inf in variable 'bias' (shape [3]), at element 7" in outcome.message
    assert "first 5 of 9 values were applied" in outcome.message
    np.testing.assert_array_equal(state.params[:5], before[:5] - 0.5)
    np.testing.assert_array_equal(state.params[5:], before[5:])
    assert state.stats.refused == 1 and state.step == 0
    again = agg.push(header(state), chunks(grad))
    assert again.status == REFUSED and again.duplicate
    np.testing.assert_array_equal(state.params[:5], before[:5] - 0.5)
    assert state.admission.ledger_since(0)[1] == [LedgerRecord(0, 0, 1, 0, True, 0, 5)]


def test_nonfinite_gradient_in_the_first_chunk_changes_nothing() -> None:
    state, agg = make_shard()
    before = state.params.copy()
    grad = np.ones(9, np.float32)
    grad[1] = np.nan
    outcome = agg.push(header(state), chunks(grad))
    assert outcome.status == REFUSED and "the parameters are unchanged" in outcome.message
    np.testing.assert_array_equal(state.params, before)
    assert agg.push(header(state), chunks(np.ones(9))).status == APPLIED  # checked afresh


def test_truncated_payload_is_refused() -> None:
    state, agg = make_shard()
    outcome = agg.push(header(state), chunks(np.ones(5)))
    assert outcome.status == REFUSED and "ended after 20 of 36 bytes" in outcome.message
    outcome = agg.push(header(state, seq=2), [b"\x00" * 6])
    assert outcome.status == REFUSED and "6-byte chunk" in outcome.message


def test_duplicate_push_is_applied_once() -> None:
    state, agg = make_shard()
    before = state.params.copy()
    first = agg.push(header(state, worker=1, seq=7), chunks(np.ones(9)))
    again = agg.push(header(state, worker=1, seq=7, token=0), chunks(np.ones(9)))
    assert first.status == again.status == APPLIED
    assert again.duplicate and not first.duplicate
    assert state.step == 1 and state.stats.duplicates == 1
    np.testing.assert_allclose(state.params, before - 0.5)
    older = agg.push(header(state, worker=1, seq=6), chunks(np.ones(9)))
    assert older.status == STALE and older.duplicate and state.step == 1


def test_restarted_worker_with_new_incarnation_is_not_a_duplicate() -> None:
    state, agg = make_shard()
    agg.push(header(state, worker=1, seq=1, incarnation=100), chunks(np.ones(9)))
    outcome = agg.push(header(state, worker=1, seq=1, incarnation=200), chunks(np.ones(9)))
    assert outcome.status == APPLIED and not outcome.duplicate and state.step == 2


def test_ledger_records_each_applied_push_once_and_nothing_else() -> None:
    state, agg = make_shard()
    agg.push(header(state, worker=1, seq=1, incarnation=9), chunks(np.ones(9)))
    agg.push(header(state, worker=1, seq=1, incarnation=9), chunks(np.ones(9)))  # a retry
    agg.push(header(state, worker=0, seq=1), chunks(np.full(9, np.nan)))  # refused
    agg.push(header(state, worker=0, seq=2), chunks(np.ones(9)))
    assert list(state.ledger) == [(1, 9, 1, 1), (0, 0, 2, 2)]
    assert state.admission.ledger_since(1) == (1, [LedgerRecord(0, 0, 2, 2, False, 0, 9)])


def test_ledger_forgets_the_oldest_entries_beyond_its_capacity(monkeypatch) -> None:
    monkeypatch.setattr(admission_module, "LEDGER_CAPACITY", 2)
    state, agg = make_shard()
    for seq in (1, 2, 3):
        agg.push(header(state, worker=0, seq=seq), chunks(np.ones(9)))
    assert state.admission.ledger_total == 3
    assert [r[:4] for r in state.admission.ledger_since(0)[1]] == [(0, 0, 2, 2), (0, 0, 3, 3)]
    assert state.admission.ledger_since(0)[0] == 1


def cut(values: np.ndarray, chunk: int, after: int | None = None):
    """Stream ``values`` in chunks of ``chunk`` elements; the stream breaks after ``after``."""
    for index, start in enumerate(range(0, values.size, chunk)):
        if index == after:
            raise ConnectionResetError("the worker went away")
        yield values[start:start + chunk].tobytes()


def test_a_push_cut_off_keeps_its_prefix_and_its_retry_applies_the_rest_once() -> None:
    state, agg = make_shard()  # 9 elements, streamed in 2-element chunks: 5 chunks
    initial = state.params.copy()
    grad = np.arange(1, 10, dtype=np.float32)
    mine = header(state, worker=0, seq=1, finite=True)
    with pytest.raises(ConnectionResetError):
        agg.push(mine, cut(grad, 2, after=3))
    np.testing.assert_array_equal(state.params[:6], initial[:6] - 0.5 * grad[:6])
    np.testing.assert_array_equal(state.params[6:], initial[6:])
    assert state.step == 0 and state.ledger == [] and state.staged == 0
    assert agg.push(header(state, worker=1, seq=1), cut(np.ones(9, np.float32), 2)).applied
    outcome = agg.push(mine, cut(grad, 2))
    assert outcome.status == APPLIED and not outcome.duplicate and outcome.step == 2
    assert agg.push(mine, cut(grad, 2)).duplicate
    assert state.admission.ledger_since(0)[1] == [LedgerRecord(1, 0, 1, 1, False, 0, 9),
                                        LedgerRecord(0, 0, 1, 2, False, 0, 9)]
    np.testing.assert_array_equal(state.params, initial - 0.5 * (grad + 1))


def test_read_chunks_returns_a_copy_of_the_buffer() -> None:
    state, _ = make_shard(opt="momentum", momentum=0.9)
    data = b"".join(state.read_chunks("params", chunk_bytes=8))
    np.testing.assert_array_equal(np.frombuffer(data, np.float32), state.params)
    slot = b"".join(state.read_chunks("momentum_buffer"))
    assert len(slot) == 36
    with pytest.raises(InvalidArgumentError, match=r"no buffer 'exp_avg'.*params, momentum_buffer"):
        state.store.buffer("exp_avg")


def test_initial_values_of_wrong_size_are_refused() -> None:
    layout = plan_placement(SHAPES, 1).shards[0]
    with pytest.raises(InvalidArgumentError, match=r"needs 9 float32 initial values.*got 4"):
        ShardState(layout, np.zeros(4, np.float32), make_optimizer("sgd", 9))


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad"])
def test_update_applied_range_by_range_equals_the_whole_update(name) -> None:
    rng = np.random.default_rng(0)
    n = 150_000  # ranges that cut blocks of the blockwise update
    start = rng.standard_normal(n).astype(np.float32)
    whole, ranged = start.copy(), start.copy()
    opts = [make_optimizer(name, n, momentum=0.9, weight_decay=0.01) for _ in range(2)]
    for _ in range(3):
        grad = rng.standard_normal(n).astype(np.float32)
        grad.flags.writeable = False  # a view of received bytes is read-only
        opts[0].apply(whole, grad, 0.1)
        update = opts[1].begin()
        for lo, hi in ((100_000, n), (0, 70_001), (70_001, 100_000)):
            opts[1].apply_range(ranged, lo, grad[lo:hi], 0.1, update)
    np.testing.assert_array_equal(ranged, whole)
    for key, slot in opts[0].slots.items():
        np.testing.assert_array_equal(opts[1].slots[key], slot)


def test_finiteness_checks_find_nan_and_inf_and_accept_huge_finite_values() -> None:
    state, _ = make_shard()
    values = np.full(200_000, 3e38, np.float32)  # huge but finite: no false alarm
    assert all_finite(values) and state.store.find_nonfinite(values) is None
    values[150_001] = -np.inf
    assert not all_finite(values)
    assert state.store.find_nonfinite(values, base=5) == 150_006
    values[150_001], values[7] = 0.0, np.nan
    assert not all_finite(values) and state.store.find_nonfinite(values) == 7


def test_malloc_tuning_is_applied_once_per_process() -> None:
    first = tune_malloc()
    assert tune_malloc(one_arena=True) is first
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert first


def test_a_push_whose_payload_just_ends_early_is_refused_and_its_retry_continues() -> None:
    """A cancelled stream may end quietly instead of raising: what arrived is applied, and
    the retry applies the rest, each element once."""
    state, agg = make_shard()
    initial = state.params.copy()
    grad = np.arange(1, 10, dtype=np.float32)
    mine = header(state, worker=0, seq=1, finite=True)
    first_three = [grad[i:i + 2].tobytes() for i in (0, 2, 4)]  # 6 of 9 elements, then nothing
    short = agg.push(mine, first_three)
    assert short.status == REFUSED and "ended after 24 of 36 bytes" in short.message
    assert "first 6 of 9 values were applied; a retry of push 1 continues" in short.message
    np.testing.assert_array_equal(state.params[:6], initial[:6] - 0.5 * grad[:6])
    np.testing.assert_array_equal(state.params[6:], initial[6:])
    outcome = agg.push(mine, cut(grad, 2))
    assert outcome.status == APPLIED and not outcome.duplicate and outcome.step == 1
    np.testing.assert_array_equal(state.params, initial - 0.5 * grad)  # each element once
