"""Row-wise sparse optimizers: TensorFlow's arithmetic on the touched rows, nothing else moved."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from towerflow.errors import InvalidArgumentError
from towerflow.ps.spec.row_optimizers import (
    SPARSE_OPTIMIZERS,
    SparseAdagrad,
    SparseFtrl,
    SparseLazyAdam,
    SparseOptimizer,
    SparseSGD,
    make_sparse_optimizer,
    sparse_optimizer_from_dict,
)

OPTIMIZERS = [
    SparseSGD(),
    SparseAdagrad(),
    SparseAdagrad(initial_accumulator_value=0.5),
    SparseLazyAdam(),
    SparseLazyAdam(beta1=0.8, beta2=0.99, epsilon=1e-3),
    SparseFtrl(),
    SparseFtrl(l1_regularization_strength=0.05, l2_regularization_strength=0.3),
    SparseFtrl(learning_rate_power=-0.7, initial_accumulator_value=0.2,
               l1_regularization_strength=0.01, l2_regularization_strength=0.1,
               l2_shrinkage_regularization_strength=0.2),
]


def dense_reference(opt: SparseOptimizer, var: torch.Tensor, slots: dict[str, torch.Tensor],
                    grad: torch.Tensor, touched: torch.Tensor, lr: float, step: int):
    """The plain dense formula over the whole table, kept on the touched rows only.

    ``grad`` is zero outside the touched rows; ``touched`` is a (rows, 1) mask.
    Returns the new table and slots (new tensors).
    """
    new_slots = dict(slots)
    if isinstance(opt, SparseSGD):
        new = var - lr * grad
    elif isinstance(opt, SparseAdagrad):
        accum = slots["accumulator"] + grad * grad
        new = var - lr * grad / torch.sqrt(accum)
        new_slots["accumulator"] = accum
    elif isinstance(opt, SparseLazyAdam):
        b1, b2 = opt.beta1, opt.beta2
        m = b1 * slots["m"] + (1 - b1) * grad
        v = b2 * slots["v"] + (1 - b2) * grad * grad
        alpha = lr * math.sqrt(1 - b2**step) / (1 - b1**step)
        new = var - alpha * m / (torch.sqrt(v) + opt.epsilon)
        new_slots.update(m=m, v=v)
    else:
        p, l1, l2 = (opt.learning_rate_power, opt.l1_regularization_strength,
                     opt.l2_regularization_strength)
        accum, linear = slots["accumulator"], slots["linear"]
        shrunk = grad + 2 * opt.l2_shrinkage_regularization_strength * var
        new_accum = accum + grad * grad
        linear = linear + shrunk - (new_accum ** (-p) - accum ** (-p)) / lr * var
        quadratic = new_accum ** (-p) / lr + 2 * l2
        new = torch.where(linear.abs() > l1, (torch.sign(linear) * l1 - linear) / quadratic,
                          torch.zeros_like(var))
        new_slots.update(accumulator=new_accum, linear=linear)
    keep = {name: torch.where(touched, new_slots[name], slots[name]) for name in slots}
    return torch.where(touched, new, var), keep


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_matches_dense_reference_on_touched_rows_and_leaves_the_rest_bit_identical(opt):
    # float64, so that the comparison checks the formula, not float32 cancellation in
    # FTRL's accum**-p differences divided by a small learning rate
    gen = torch.Generator().manual_seed(7)
    rows, dim, f64 = 60, 5, torch.float64
    var = torch.randn(rows, dim, generator=gen, dtype=f64)
    slots = opt.init_slots(rows, dim, f64)
    for name in slots:  # state from earlier updates, so untouched slots are not trivial
        slots[name] += torch.rand(rows, dim, generator=gen, dtype=f64)
    ref_var, ref_slots = var.clone(), {k: v.clone() for k, v in slots.items()}
    for step, lr in enumerate((0.1, 0.05, 0.2, 0.01), start=1):
        index = torch.randperm(rows, generator=gen)[: 1 + step * 7]
        grads = torch.randn(index.numel(), dim, generator=gen, dtype=f64)
        before_var, before_slots = var.clone(), {k: v.clone() for k, v in slots.items()}

        opt.apply(var, slots, index, grads, lr=lr, step=step)

        dense = torch.zeros(rows, dim, dtype=f64).index_copy_(0, index, grads)
        touched = torch.zeros(rows, 1, dtype=torch.bool)
        touched[index] = True
        ref_var, ref_slots = dense_reference(opt, ref_var, ref_slots, dense, touched, lr, step)
        torch.testing.assert_close(var, ref_var, rtol=1e-6, atol=1e-6)
        for name in slots:
            torch.testing.assert_close(slots[name], ref_slots[name], rtol=1e-6, atol=1e-6)
        untouched = ~touched[:, 0]
        assert torch.equal(var[untouched], before_var[untouched])
        for name in slots:
            assert torch.equal(slots[name][untouched], before_slots[name][untouched])
        ref_var = var.clone()  # keep the two paths from drifting apart by rounding
        ref_slots = {k: v.clone() for k, v in slots.items()}


def run_tf_test(opt, var_rows, grad_rows, steps, lr=3.0):
    """Apply ``steps`` updates to a table whose rows are TensorFlow test variables."""
    var = torch.tensor(var_rows, dtype=torch.float32)
    slots = opt.init_slots(*var.shape)
    grads = torch.tensor(grad_rows, dtype=torch.float32)
    index = torch.arange(var.shape[0])
    for step in range(1, steps + 1):
        opt.apply(var, slots, index, grads, lr=lr, step=step)
    return var


def test_adagrad_reproduces_tensorflow_adagrad_test():
    # tensorflow/python/training/adagrad_test.py, doTestBasic
    var = run_tf_test(SparseAdagrad(), [[1.0, 2.0], [3.0, 4.0]], [[0.1, 0.1], [0.01, 0.01]], 3)
    torch.testing.assert_close(var, torch.tensor(
        [[-1.6026098728179932, -0.6026098728179932], [2.715679168701172, 3.715679168701172]]))


@pytest.mark.parametrize(
    ("opt", "init", "steps", "expected"),
    [
        (SparseFtrl(), [[0.0, 0.0], [0.0, 0.0]], 3,
         [[-2.60260963, -4.29698515], [-0.28432083, -0.56694895]]),
        (SparseFtrl(l1_regularization_strength=0.001, l2_regularization_strength=2.0),
         [[1.0, 2.0], [4.0, 3.0]], 10,
         [[-0.24059935, -0.46829352], [-0.02406147, -0.04830509]]),
        (SparseFtrl(l1_regularization_strength=0.001, l2_regularization_strength=2.0,
                    l2_shrinkage_regularization_strength=0.1),
         [[1.0, 2.0], [4.0, 3.0]], 10,
         [[-0.22578996, -0.44345799], [-0.14378493, -0.13229476]]),
    ],
    ids=["plain", "l1_l2", "l1_l2_shrinkage"],
)
def test_ftrl_reproduces_tensorflow_ftrl_tests(opt, init, steps, expected):
    # tensorflow/python/training/ftrl_test.py (FtrlOptimizer(3.0, initial_accumulator_value=0.1))
    var = run_tf_test(opt, init, [[0.1, 0.2], [0.01, 0.02]], steps)
    torch.testing.assert_close(var, torch.tensor(expected), rtol=1e-4, atol=1e-6)


def ftrl_kernel_scalar(opt, v, a, lin, g, lr):
    """TensorFlow's SparseApplyFtrl CPU kernel for one element (inner_dim == 1), in float64."""
    p = opt.learning_rate_power
    l1, l2 = opt.l1_regularization_strength, opt.l2_regularization_strength
    g_shrunk = g + 2 * opt.l2_shrinkage_regularization_strength * v
    updated_a = a + g * g
    sigma = (updated_a ** (-p) - a ** (-p)) / lr
    updated_l = lin + g_shrunk - sigma * v
    quadratic = (math.sqrt(updated_a) if p == -0.5 else updated_a ** (-p)) / lr + 2 * l2
    l1_adjust = max(min(updated_l, l1), -l1)
    return (l1_adjust - updated_l) / quadratic, updated_a, updated_l


@pytest.mark.parametrize("opt", [o for o in OPTIMIZERS if isinstance(o, SparseFtrl)], ids=repr)
def test_ftrl_matches_tensorflow_scalar_kernel(opt):
    gen = torch.Generator().manual_seed(3)
    var = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    slots = {k: v.double() + 0.3 for k, v in opt.init_slots(8, 3).items()}
    index = torch.tensor([6, 1, 3])
    grads = torch.randn(3, 3, generator=gen, dtype=torch.float64)
    expected = var.clone()
    exp_a, exp_l = slots["accumulator"].clone(), slots["linear"].clone()
    for i, row in enumerate(index.tolist()):
        for j in range(3):
            expected[row, j], exp_a[row, j], exp_l[row, j] = ftrl_kernel_scalar(
                opt, float(var[row, j]), float(exp_a[row, j]), float(exp_l[row, j]),
                float(grads[i, j]), 0.07)
    opt.apply(var, slots, index, grads, lr=0.07, step=1)
    torch.testing.assert_close(var, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(slots["accumulator"], exp_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(slots["linear"], exp_l, rtol=1e-12, atol=1e-12)


def test_lazy_adam_bias_correction_uses_the_update_number():
    opt = SparseLazyAdam()
    var = torch.zeros(3, 1)
    slots = opt.init_slots(3, 1)
    opt.apply(var, slots, torch.tensor([0]), torch.tensor([[1.0]]), lr=0.1, step=1)
    # first update: m = 0.1, v = 0.001, alpha = 0.1 * sqrt(0.001) / 0.1 -> step of ~lr
    assert var[0, 0].item() == pytest.approx(-0.1, rel=1e-5)
    opt.apply(var, slots, torch.tensor([1]), torch.tensor([[1.0]]), lr=0.1, step=100)
    alpha = 0.1 * math.sqrt(1 - 0.999**100) / (1 - 0.9**100)
    assert var[1, 0].item() == pytest.approx(-alpha * 0.1 / (math.sqrt(0.001) + 1e-8), rel=1e-5)


def test_initial_slot_values_follow_tensorflow_defaults():
    assert SparseAdagrad().init_slots(2, 3)["accumulator"].eq(0.1).all()
    ftrl = SparseFtrl().init_slots(2, 3)
    assert ftrl["accumulator"].eq(0.1).all() and ftrl["linear"].eq(0).all()
    adam = SparseLazyAdam().init_slots(2, 3, torch.float64)
    assert set(adam) == {"m", "v"} and adam["m"].dtype == torch.float64
    assert SparseSGD().init_slots(2, 3) == {}


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_dict_form_round_trips_through_json(opt):
    back = sparse_optimizer_from_dict(json.loads(json.dumps(opt.to_dict())))
    assert back == opt and type(back) is type(opt)


def test_registry_names():
    assert list(SPARSE_OPTIMIZERS) == ["sgd", "adagrad", "lazy_adam", "ftrl"]
    assert make_sparse_optimizer("lazy_adam", beta1=0.5) == SparseLazyAdam(beta1=0.5)


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: make_sparse_optimizer("adam"), r"Unknown sparse optimizer 'adam'; use one of sgd"),
        (lambda: make_sparse_optimizer("sgd", momentum=0.9), r"no hyper-parameter \['momentum'\]"),
        (lambda: SparseAdagrad(initial_accumulator_value=0.0),
         r"initial_accumulator_value must be a finite number in \(0.0, inf\], got 0.0"),
        (lambda: SparseLazyAdam(beta1=1.0), r"beta1 must be a finite number in \[0.0, 1.0\)"),
        (lambda: SparseLazyAdam(epsilon=float("nan")), r"epsilon must be a finite number"),
        (lambda: SparseFtrl(learning_rate_power=0.5), r"learning_rate_power .* got 0.5"),
        (lambda: SparseFtrl(l1_regularization_strength=-1.0), r"l1_regularization_strength"),
        (lambda: SparseFtrl(l2_regularization_strength=True), r"got True"),
        (lambda: sparse_optimizer_from_dict({"name": "sgd"}), r"described by \{'name'"),
        (lambda: sparse_optimizer_from_dict({"name": "sgd", "hyper": [], }),
         r"described by \{'name'"),
    ],
)
def test_bad_descriptions_are_refused(make, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        make()


@pytest.mark.parametrize(
    ("opt", "lr", "step", "pattern"),
    [
        (SparseSGD(), float("nan"), 1, r"learning rate must be a finite number in \[0.0, inf\]"),
        (SparseAdagrad(), -0.1, 1, r"learning rate .* got -0.1"),
        (SparseFtrl(), 0.0, 1, r"SparseFtrl: the learning rate must be a finite number in \(0.0"),
        (SparseLazyAdam(), 0.1, 0, r"step must be the update's number, an integer >= 1, got 0"),
        (SparseLazyAdam(), 0.1, 1.0, r"got 1.0"),
    ],
)
def test_bad_learning_rate_or_step_changes_nothing(opt, lr, step, pattern):
    var = torch.ones(4, 2)
    slots = opt.init_slots(4, 2)
    before = var.clone(), {k: v.clone() for k, v in slots.items()}
    with pytest.raises(InvalidArgumentError, match=pattern):
        opt.apply(var, slots, torch.tensor([1, 2]), torch.ones(2, 2), lr=lr, step=step)
    assert torch.equal(var, before[0])
    assert all(torch.equal(slots[k], before[1][k]) for k in slots)


def test_sgd_allows_a_zero_learning_rate():
    var = torch.ones(3, 2)
    SparseSGD().apply(var, {}, torch.tensor([0]), torch.ones(1, 2), lr=0.0, step=1)
    assert torch.equal(var, torch.ones(3, 2))


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_an_update_whose_result_would_not_be_finite_changes_nothing(opt):
    var = torch.ones(4, 3)
    slots = opt.init_slots(4, 3)
    before = var.clone(), {k: v.clone() for k, v in slots.items()}
    grads = torch.full((2, 3), 10.0)
    if isinstance(opt, SparseSGD):  # the others' steps are bounded by their accumulators
        with pytest.raises(InvalidArgumentError,
                           match=r"SparseSGD: the update with learning rate 1e\+38 would make the "
                                 r"rows of storage row \d non-finite .*nothing was applied"):
            opt.apply(var, slots, torch.tensor([0, 2]), grads, lr=1e38, step=1)
    huge = torch.full((2, 3), 3e38)  # g * g overflows every accumulator
    try:
        opt.apply(var, slots, torch.tensor([0, 2]), huge, lr=1e38, step=1)
    except InvalidArgumentError as exc:
        assert "nothing was applied" in str(exc)
        torch.testing.assert_close(var, before[0])
        for key, value in slots.items():
            torch.testing.assert_close(value, before[1][key])
    assert torch.isfinite(var).all() and all(torch.isfinite(v).all() for v in slots.values())


@settings(max_examples=80, deadline=None)
@given(opt=st.sampled_from(OPTIMIZERS), lr=st.floats(1e-6, 3e38),
       grad=st.floats(-3e38, 3e38).map(lambda g: float(torch.tensor(g))), steps=st.integers(1, 3))
def test_no_finite_update_leaves_a_non_finite_row_or_slot(opt, lr, grad, steps):
    var = torch.ones(3, 2)
    slots = opt.init_slots(3, 2)
    for step in range(1, steps + 1):
        try:
            opt.apply(var, slots, torch.tensor([1]), torch.full((1, 2), grad), lr=lr, step=step)
        except InvalidArgumentError as exc:
            assert "non-finite" in str(exc)
        assert torch.isfinite(var).all() and all(torch.isfinite(v).all() for v in slots.values())
