"""A dense row store keeps each row beside its slots ("cells"): it trains exactly as the
optimizers do on separate tensors, refuses non-finite updates alike, and exports alike."""

from __future__ import annotations

import pytest
import torch

from towerflow.errors import InvalidArgumentError
from towerflow.ps.partition import ModPartitioner
from towerflow.ps.server.tables.rows import DenseRowStore
from towerflow.ps.spec.initializers import UniformRows
from towerflow.ps.spec.row_optimizers import (
    SparseAdagrad,
    SparseFtrl,
    SparseLazyAdam,
    SparseOptimizer,
    SparseSGD,
)

NUM_ROWS = 300
OPTIMIZERS = [
    SparseSGD(), SparseAdagrad(), SparseAdagrad(initial_accumulator_value=0.5, epsilon=1e-7),
    SparseLazyAdam(), SparseLazyAdam(beta1=0.5, beta2=0.9, epsilon=0.0),
    SparseFtrl(l1_regularization_strength=0.01, l2_regularization_strength=0.1),
    SparseFtrl(learning_rate_power=-0.3, l1_regularization_strength=0.01,
               l2_shrinkage_regularization_strength=0.05),  # pow, not a square root
]


def store_and_copy(opt: SparseOptimizer, dim: int, dtype: torch.dtype
                   ) -> tuple[DenseRowStore, torch.Tensor, dict[str, torch.Tensor]]:
    """A store and separate tensors holding the same rows and slots."""
    store = DenseRowStore(ModPartitioner(1, num_rows=NUM_ROWS), 0, dim, opt, dtype=dtype,
                          initializer=UniformRows(seed=3))
    export = store.export()
    return store, export.rows.clone(), {k: v.clone() for k, v in export.slots.items()}


def assert_holds(store: DenseRowStore, var: torch.Tensor, slots: dict[str, torch.Tensor]) -> None:
    export = store.export()
    assert torch.equal(export.rows, var)
    assert export.slots.keys() == slots.keys()
    for name, values in slots.items():
        assert torch.equal(export.slots[name], values), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("dim", [1, 3, 17, 32])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_cells_train_bit_for_bit_as_separate_tensors(opt, dim, dtype):
    store, var, slots = store_and_copy(opt, dim, dtype)
    gen = torch.Generator().manual_seed(dim)
    for step in range(1, 6):
        ids = torch.unique(torch.randint(0, NUM_ROWS, (200,), generator=gen))
        grads = torch.randn(ids.numel(), dim, generator=gen, dtype=dtype)
        store.apply(ids, grads, 0.1, step)
        opt.apply(var, slots, ids, grads, lr=0.1, step=step)
    assert_holds(store, var, slots)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_the_cells_hold_each_row_then_its_slots(opt):
    dim = 3
    store, var, slots = store_and_copy(opt, dim, torch.float32)
    store.apply(torch.tensor([4, 7]), torch.ones(2, dim), 0.1, 1)
    opt.apply(var, slots, torch.tensor([4, 7]), torch.ones(2, dim), lr=0.1, step=1)
    assert store._cells.shape == (NUM_ROWS, dim * (1 + len(opt.slot_names)))
    assert torch.equal(store._cells, torch.cat([var, *(slots[k] for k in opt.slot_names)], 1))
    assert store.nbytes == store._cells.numel() * 4
    export = store.export(10, 20)
    assert export.rows.is_contiguous() and all(v.is_contiguous() for v in export.slots.values())
    export.rows.add_(1.0)  # a copy: the store does not change
    assert torch.equal(store.export(10, 20).rows, var[10:20])


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_cells_refuse_a_non_finite_update_as_separate_tensors_and_keep_every_bit(opt):
    store, var, slots = store_and_copy(opt, 3, torch.float32)
    ids, huge = torch.tensor([2, 9]), torch.full((2, 3), 3e38)
    errors = []
    for update in (lambda: store.apply(ids, huge, 1e38, 1),
                   lambda: opt.apply(var.clone(), {k: v.clone() for k, v in slots.items()}, ids,
                                     huge, lr=1e38, step=1)):
        try:
            update()
        except InvalidArgumentError as exc:
            errors.append(str(exc))
    assert len(errors) == 2 and errors[0] == errors[1]
    assert "nothing was applied" in errors[0]
    assert_holds(store, var, slots)
