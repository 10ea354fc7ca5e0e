"""Row-wise optimizers a ps shard applies to the rows a push touched, as TensorFlow's.

Each optimizer updates only the given rows of a table and of its slots (its
optimizer state, one row per table row), with the arithmetic of TensorFlow's
sparse kernels (``tensorflow/core/kernels/training_ops.cc``) and optimizers:

=============  ==========================================================
``sgd``        ``var -= lr * g`` (``ScatterSub``, what
               ``tf.train.GradientDescentOptimizer`` does to an
               ``IndexedSlices``).
``adagrad``    ``SparseApplyAdagrad``: ``accum += g * g; var -= lr * g /
               sqrt(accum)``; ``accum`` starts at ``initial_accumulator_value``
               (0.1, ``tf.train.AdagradOptimizer``'s default), no epsilon.
``lazy_adam``  ``tf.contrib.opt.LazyAdamOptimizer``: ``m``, ``v`` and the
               variable are updated for the touched rows only; ``m = beta1 *
               m + (1 - beta1) * g``, ``v = beta2 * v + (1 - beta2) * g * g``,
               ``var -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m /
               (sqrt(v) + epsilon)`` with ``t`` the update's global number (the
               optimizer's shared beta powers, as TensorFlow's).
``ftrl``       FTRL-Proximal, ``SparseApplyFtrl`` / ``SparseApplyFtrlV2`` as
               ``tf.train.FtrlOptimizer`` calls it: with ``p =
               learning_rate_power`` and ``g' = g + 2 * l2_shrinkage * var``,
               ``new_accum = accum + g * g; linear += g' - (new_accum^-p -
               accum^-p) / lr * var; var = (clip(linear, -l1, l1) - linear) /
               (new_accum^-p / lr + 2 * l2); accum = new_accum``.
=============  ==========================================================

The gradient must hold each row once (:func:`~towerflow.ps.partition.coalesce`
sums duplicates first, as TensorFlow does before a sparse apply). The rows are
gathered with ``index_select``, updated in place with fused ops
(``addcmul_``, ``addcdiv_``) and written back with ``index_copy_``: on CPU this
is several times faster than ``torch.optim`` on a sparse gradient.
:meth:`SparseOptimizer.apply` takes the rows and each slot as separate tensors;
:meth:`SparseOptimizer.apply_cells` (the dense row store's) takes them side by
side, each row followed by its slots in one tensor, and gathers and writes each
touched row once.

An optimizer is a small immutable description (name and hyper-parameters);
:meth:`SparseOptimizer.to_dict` / :func:`sparse_optimizer_from_dict` carry it
on the wire and in checkpoint manifests. The learning rate and the update's
number are given to each :meth:`SparseOptimizer.apply`, so a schedule on the
worker drives them.

Example:
    >>> import torch
    >>> opt = SparseAdagrad()
    >>> var = torch.ones(4, 2)
    >>> slots = opt.init_slots(4, 2)
    >>> opt.apply(var, slots, torch.tensor([1]), torch.tensor([[0.3, 0.0]]), lr=0.5, step=1)
    >>> [round(x, 4) for x in var[1].tolist()], [round(x, 4) for x in slots["accumulator"][1].tolist()]
    ([0.6559, 1.0], [0.19, 0.1])
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import torch

from towerflow.errors import InvalidArgumentError

__all__ = [
    "SparseOptimizer",
    "SparseSGD",
    "SparseAdagrad",
    "SparseLazyAdam",
    "SparseFtrl",
    "SPARSE_OPTIMIZERS",
    "make_sparse_optimizer",
    "sparse_optimizer_from_dict",
    "sparse_optimizer_for",
    "updates_untouched_rows_alike",
    "ROW_COUNTERPARTS",
]


def _number(cls_name: str, name: str, value: object, *, low: float | None = None,
            high: float | None = None, low_open: bool = False, high_open: bool = False) -> float:
    """Check one hyper-parameter: a finite real in the stated interval."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        span = f"{left}{'-inf' if low is None else low}, {'inf' if high is None else high}{right}"
        raise InvalidArgumentError(
            f"{cls_name}: {name} must be a finite number in {span}, got {value!r}."
        )
    return float(value)


def _copy_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(0, index, src)`` for rows of contiguous 2-D tensors, bit for bit.

    On CPU ``index_copy_`` copies value by value (a scalar loop over strides);
    numpy's assignment to rows chosen by an index array copies a row at a time,
    about half the time for a row and its slots (a ps shard's update writes
    ~1,000 such cells per request). ``index`` holds valid rows (checked).
    """
    if dst.is_contiguous() and src.is_contiguous() and dst.device.type == "cpu" \
            and index.device.type == "cpu" and not dst.requires_grad:
        dst.numpy()[index.numpy()] = src.numpy()
    else:
        dst.index_copy_(0, index, src)


class SparseOptimizer(abc.ABC):
    """A row-wise optimizer: state layout, the update, and its description.

    Subclasses are frozen dataclasses of their hyper-parameters.
    """

    __slots__ = ()

    #: the name on the wire
    name: ClassVar[str]
    #: the slots (per-row state tensors), in order
    slot_names: ClassVar[tuple[str, ...]] = ()
    #: whether the learning rate may be 0 (FTRL divides by it)
    _lr_may_be_zero: ClassVar[bool] = True

    def slot_initial_value(self, slot: str) -> float:
        """The value every element of ``slot`` holds before a row's first update."""
        if slot not in self.slot_names:
            raise InvalidArgumentError(
                f"{self.name} keeps {list(self.slot_names) or 'no slots'}, not {slot!r}."
            )
        return 0.0

    def init_slots(self, num_rows: int, dim: int,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Fresh slots for ``num_rows`` rows of ``dim`` values each."""
        out = {}
        for slot in self.slot_names:
            fill = self.slot_initial_value(slot)
            out[slot] = (torch.full((num_rows, dim), fill, dtype=dtype) if fill
                         else torch.zeros((num_rows, dim), dtype=dtype))
        return out

    def check_step(self, lr: object, step: object) -> tuple[float, int]:
        """Return ``(lr, step)`` if valid for this optimizer, else raise.

        Raises:
            InvalidArgumentError: ``lr`` not a finite number >= 0 (> 0 for FTRL),
                or ``step`` not an integer >= 1.
        """
        lr = _number(type(self).__name__, "the learning rate", lr, low=0.0,
                     low_open=not self._lr_may_be_zero)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise InvalidArgumentError(
                f"{type(self).__name__}: step must be the update's number, an integer >= 1, "
                f"got {step!r}."
            )
        return lr, step

    def apply(self, var: torch.Tensor, slots: Mapping[str, torch.Tensor], index: torch.Tensor,
              grads: torch.Tensor, lr: float, step: int) -> None:
        """Update rows ``index`` of ``var`` and of ``slots`` in place from ``grads``.

        Args:
            var: the table's storage, ``(rows, dim)``.
            slots: this optimizer's slots, each ``(rows, dim)`` like ``var``.
            index: int64 storage rows to update, each once (coalesced).
            grads: ``(len(index), dim)`` gradients of those rows, same dtype as ``var``.
            lr: the learning rate.
            step: the update's number, from 1 (Adam's bias correction uses it).

        Rows not in ``index`` and their slots are left untouched, bit for bit.
        The caller has validated ``index`` and ``grads``; ``lr`` and ``step`` are
        checked here, before anything changes. The new rows and slots are
        computed apart and written only when every value is finite.

        Raises:
            InvalidArgumentError: the update would make a row or slot value
                non-finite (finite inputs can overflow); nothing was changed.
        """
        lr, step = self.check_step(lr, step)
        if not index.numel():
            return
        new = self._updated(var.index_select(0, index),
                            {k: slots[k].index_select(0, index) for k in self.slot_names},
                            grads, lr, step)
        self._check_finite(new, index, grads, lr)
        for name, values in new.items():
            (var if name == "var" else slots[name]).index_copy_(0, index, values)

    def cell_views(self, cells: torch.Tensor, dim: int
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rows and the slots of ``cells``, as column views of it.

        ``cells`` is ``(n, dim * (1 + len(slot_names)))``: each row's ``dim``
        values, then its values of each slot in :attr:`slot_names`' order (the
        layout :meth:`apply_cells` updates).
        """
        return cells[:, :dim], {name: cells[:, dim * (i + 1):dim * (i + 2)]
                                for i, name in enumerate(self.slot_names)}

    def apply_cells(self, cells: torch.Tensor, index: torch.Tensor, grads: torch.Tensor,
                    lr: float, step: int) -> None:
        """:meth:`apply` on storage whose rows and slots lie side by side (its "cells").

        ``cells`` is ``(rows, dim * (1 + len(slot_names)))``, laid out as
        :meth:`cell_views` says: one row's values and its optimizer state are
        contiguous, so the update gathers each touched cell once
        (``index_select``), computes the new row and slots in views of that
        gathered block, and writes the cells back with one row scatter: one
        random access per touched row each way, where separate tensors cost one
        per tensor (the update is memory-bound on a large table). The
        arithmetic is :meth:`apply`'s, bit for bit; as there, nothing is written
        when a new value would be non-finite (the same error; one reduction
        over the block finds that every value is finite).
        """
        lr, step = self.check_step(lr, step)
        if not index.numel():
            return
        block = cells.index_select(0, index)
        rows, slot_rows = self.cell_views(block, grads.shape[1])
        new = self._updated(rows, slot_rows, grads, lr, step)
        for name, values in new.items():  # the block is a copy: it may take them unchecked
            view = rows if name == "var" else slot_rows[name]
            if values is not view:
                view.copy_(values)
        if not bool(torch.isfinite(block.sum())):  # a NaN or inf spoils the sum
            self._check_finite({name: rows if name == "var" else slot_rows[name]
                                for name in new}, index, grads, lr)
        _copy_rows(cells, index, block)

    def _check_finite(self, new: Mapping[str, torch.Tensor], index: torch.Tensor,
                      grads: torch.Tensor, lr: float) -> None:
        """Raise if a value of ``new`` (:meth:`_updated`'s) is not finite."""
        for name, values in new.items():
            if not bool(torch.isfinite(values.sum())) and not bool(torch.isfinite(values).all()):
                bad = int((~torch.isfinite(values)).any(dim=1).nonzero()[0, 0])
                where = "rows" if name == "var" else f"slot {name!r}"
                raise InvalidArgumentError(
                    f"{type(self).__name__}: the update with learning rate {lr:g} would make the "
                    f"{where} of storage row {int(index[bad])} non-finite (largest gradient "
                    f"{float(grads.abs().max()):.3g}); it was refused and nothing was applied. "
                    "Lower the learning rate or clip the gradients."
                )

    @abc.abstractmethod
    def _updated(self, rows: torch.Tensor, slot_rows: Mapping[str, torch.Tensor],
                 grads: torch.Tensor, lr: float, step: int) -> dict[str, torch.Tensor]:
        """The new values of the touched rows: ``{"var": rows, slot: values, ...}``.

        ``rows`` and ``slot_rows`` are the touched rows and their slots, gathered
        (copies, possibly views of one gathered block of cells); the update may
        change them in place and return them. ``lr`` and ``step`` are checked.
        """

    def hyper(self) -> dict[str, float]:
        """The hyper-parameters by name."""
        return asdict(self)  # type: ignore[call-overload]

    def to_dict(self) -> dict[str, Any]:
        """``{"name": ..., "hyper": {...}}``; :func:`sparse_optimizer_from_dict` reads it."""
        return {"name": self.name, "hyper": self.hyper()}


@dataclass(frozen=True, slots=True)
class SparseSGD(SparseOptimizer):
    """Plain gradient descent on the touched rows: ``var -= lr * g``."""

    name: ClassVar[str] = "sgd"

    def _updated(self, rows: torch.Tensor, slot_rows: Mapping[str, torch.Tensor],
                 grads: torch.Tensor, lr: float, step: int) -> dict[str, torch.Tensor]:
        return {"var": rows.add_(grads, alpha=-lr)}


@dataclass(frozen=True, slots=True)
class SparseAdagrad(SparseOptimizer):
    """``SparseApplyAdagrad``: ``accum += g * g; var -= lr * g / sqrt(accum)``.

    Args:
        initial_accumulator_value: the accumulator's start, > 0 (TensorFlow's 0.1).
        epsilon: added to ``sqrt(accum)`` (``torch.optim.Adagrad``'s ``eps``);
            0 (default): TensorFlow's update.
    """

    name: ClassVar[str] = "adagrad"
    slot_names: ClassVar[tuple[str, ...]] = ("accumulator",)
    initial_accumulator_value: float = 0.1
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        _number("SparseAdagrad", "initial_accumulator_value", self.initial_accumulator_value,
                low=0.0, low_open=True)
        _number("SparseAdagrad", "epsilon", self.epsilon, low=0.0)

    def slot_initial_value(self, slot: str) -> float:
        SparseOptimizer.slot_initial_value(self, slot)
        return float(self.initial_accumulator_value)

    def _updated(self, rows: torch.Tensor, slot_rows: Mapping[str, torch.Tensor],
                 grads: torch.Tensor, lr: float, step: int) -> dict[str, torch.Tensor]:
        acc = slot_rows["accumulator"].addcmul_(grads, grads)
        scale = acc.rsqrt() if not self.epsilon else acc.sqrt().add_(self.epsilon).reciprocal_()
        return {"accumulator": acc, "var": rows.addcmul_(grads, scale, value=-lr)}


@dataclass(frozen=True, slots=True)
class SparseLazyAdam(SparseOptimizer):
    """``tf.contrib.opt.LazyAdamOptimizer``: Adam whose state moves only on touched rows.

    Args:
        beta1: decay of the first moment, in [0, 1).
        beta2: decay of the second moment, in [0, 1).
        epsilon: added to ``sqrt(v)`` (not bias corrected, as TensorFlow's), >= 0.
    """

    name: ClassVar[str] = "lazy_adam"
    slot_names: ClassVar[tuple[str, ...]] = ("m", "v")
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8

    def __post_init__(self) -> None:
        for key in ("beta1", "beta2"):
            _number("SparseLazyAdam", key, getattr(self, key), low=0.0, high=1.0,
                    high_open=True)
        _number("SparseLazyAdam", "epsilon", self.epsilon, low=0.0)

    def _updated(self, rows: torch.Tensor, slot_rows: Mapping[str, torch.Tensor],
                 grads: torch.Tensor, lr: float, step: int) -> dict[str, torch.Tensor]:
        b1, b2 = float(self.beta1), float(self.beta2)
        # beta1_power / beta2_power as TensorFlow's accumulators hold them on update `step`
        alpha = lr * math.sqrt(1.0 - b2 ** step) / (1.0 - b1 ** step)
        m = slot_rows["m"].mul_(b1).add_(grads, alpha=1.0 - b1)
        v = slot_rows["v"].mul_(b2).addcmul_(grads, grads, value=1.0 - b2)
        rows = rows.addcdiv_(m, v.sqrt().add_(self.epsilon), value=-alpha)
        return {"m": m, "v": v, "var": rows}


@dataclass(frozen=True, slots=True)
class SparseFtrl(SparseOptimizer):
    """FTRL-Proximal as ``tf.train.FtrlOptimizer`` (``SparseApplyFtrl``, ``...V2``).

    Args:
        learning_rate_power: ``p`` in ``accum^-p``, <= 0 (-0.5: square root).
        initial_accumulator_value: the accumulator's start, >= 0.
        l1_regularization_strength: ``l1`` >= 0.
        l2_regularization_strength: ``l2`` >= 0.
        l2_shrinkage_regularization_strength: >= 0; added to the gradient of the
            linear term only (``SparseApplyFtrlV2``).
    """

    name: ClassVar[str] = "ftrl"
    slot_names: ClassVar[tuple[str, ...]] = ("accumulator", "linear")
    _lr_may_be_zero: ClassVar[bool] = False
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0

    def __post_init__(self) -> None:
        _number("SparseFtrl", "learning_rate_power", self.learning_rate_power, high=0.0)
        for key in ("initial_accumulator_value", "l1_regularization_strength",
                    "l2_regularization_strength", "l2_shrinkage_regularization_strength"):
            _number("SparseFtrl", key, getattr(self, key), low=0.0)

    def slot_initial_value(self, slot: str) -> float:
        SparseOptimizer.slot_initial_value(self, slot)
        return float(self.initial_accumulator_value) if slot == "accumulator" else 0.0

    def _scaled(self, accum: torch.Tensor) -> torch.Tensor:
        """``accum ** -learning_rate_power`` (a square root for -0.5, as the kernel).

        ``pow``'s vectorised and scalar loops differ in the last bit, so it runs on
        a contiguous tensor (a copy of a view of gathered cells): the same
        elements take the same loop as on separately gathered rows.
        """
        if self.learning_rate_power == -0.5:
            return accum.sqrt()
        return accum.contiguous().pow(-self.learning_rate_power)

    def _updated(self, rows: torch.Tensor, slot_rows: Mapping[str, torch.Tensor],
                 grads: torch.Tensor, lr: float, step: int) -> dict[str, torch.Tensor]:
        l1, l2 = self.l1_regularization_strength, self.l2_regularization_strength
        shrinkage = self.l2_shrinkage_regularization_strength
        w, accum = rows, slot_rows["accumulator"]
        new_accum = torch.addcmul(accum, grads, grads)
        scaled_new = self._scaled(new_accum)
        sigma = scaled_new.sub(self._scaled(accum)).div_(lr)
        linear = slot_rows["linear"].add_(grads)
        if shrinkage:
            linear.add_(w, alpha=2.0 * shrinkage)
        linear.sub_(sigma.mul_(w))
        quadratic = scaled_new.div_(lr).add_(2.0 * l2)
        w = linear.clamp(-l1, l1).sub_(linear).div_(quadratic)
        return {"accumulator": new_accum, "linear": linear, "var": w}


SPARSE_OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    cls.name: cls for cls in (SparseSGD, SparseAdagrad, SparseLazyAdam, SparseFtrl)
}


def make_sparse_optimizer(name: str, **hyper: Any) -> SparseOptimizer:
    """The sparse optimizer ``name`` (``sgd``, ``adagrad``, ``lazy_adam``, ``ftrl``).

    Raises:
        InvalidArgumentError: unknown name or hyper-parameter, or a value out of range.

    Example:
        >>> make_sparse_optimizer("ftrl", l1_regularization_strength=0.01).to_dict()["hyper"]["l1_regularization_strength"]
        0.01
    """
    cls = SPARSE_OPTIMIZERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidArgumentError(
            f"Unknown sparse optimizer {name!r}; use one of {', '.join(SPARSE_OPTIMIZERS)}."
        )
    allowed = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = set(hyper) - allowed
    if unknown:
        raise InvalidArgumentError(
            f"Sparse optimizer {name!r} has no hyper-parameter {sorted(unknown)}; it takes "
            f"{sorted(allowed) or 'none'}."
        )
    return cls(**hyper)


def sparse_optimizer_from_dict(data: Mapping[str, Any]) -> SparseOptimizer:
    """Rebuild an optimizer from :meth:`SparseOptimizer.to_dict`'s dict.

    Raises:
        InvalidArgumentError: not ``{"name": str, "hyper": dict}``, or what
            :func:`make_sparse_optimizer` refuses.
    """
    if not isinstance(data, Mapping) or set(data) != {"name", "hyper"} or not isinstance(
        data["hyper"], Mapping
    ):
        raise InvalidArgumentError(
            f"A sparse optimizer is described by {{'name': ..., 'hyper': {{...}}}}, got "
            f"{data!r:.200}."
        )
    return make_sparse_optimizer(data["name"], **dict(data["hyper"]))


#: each dense optimizer's row-wise counterpart (a table that names no optimizer of its own)
ROW_COUNTERPARTS = {"sgd": "sgd", "momentum": "sgd", "adagrad": "adagrad", "adam": "lazy_adam"}


#: the dense optimizers whose update leaves a row with a zero gradient as the row-wise one does
_UNTOUCHED_ALIKE = ("sgd", "adagrad")


def _group_of(config: Any, param: str | None) -> tuple[Any, dict[str, Any], Any, Any]:
    """``config``'s name, ``param``'s group settings, its momentum and its weight decay."""
    name = getattr(config, "name", None)
    settings_of = getattr(config, "settings_of", None)
    own = settings_of(param) if param is not None and settings_of is not None else {}
    return (name, own, own.get("momentum", getattr(config, "momentum", 0.0)),
            own.get("weight_decay", getattr(config, "weight_decay", 0.0)))


def updates_untouched_rows_alike(config: Any, param: str | None = None) -> bool:
    """Whether the dense ``config`` leaves the rows a batch did not touch as its row-wise
    counterpart does (unchanged): sgd without momentum, adagrad; no weight decay."""
    name, _, momentum, weight_decay = _group_of(config, param)
    return name in _UNTOUCHED_ALIKE and not momentum and not weight_decay


def sparse_optimizer_for(config: Any, param: str | None = None) -> dict[str, Any]:
    """The row-wise optimizer's description for a dense ``OptimizerConfig``.

    ``sgd`` -> ``sgd``, ``adagrad`` -> ``adagrad`` (same initial accumulator),
    (and eps), ``adam`` -> ``lazy_adam`` (same betas and eps); with ``param`` (the
    table's weight's name), the settings of its parameter group
    (``config.settings_of(param)``).

    Raises:
        InvalidArgumentError: momentum or weight decay, which TensorFlow's sparse
            updates do not have; give the table an optimizer of its own.
    """
    name, own, momentum, weight_decay = _group_of(config, param)
    if weight_decay or momentum or name not in ROW_COUNTERPARTS:
        groups = getattr(config, "param_settings", {})
        which = f" (the parameter group of {param!r})" if param in groups else ""
        raise InvalidArgumentError(
            f"A sparse table has no row-wise counterpart of optimizer {name!r} with momentum="
            f"{momentum} weight_decay={weight_decay}{which}; give the table its own, e.g. "
            "ShardedEmbedding(..., optimizer=SparseAdagrad()), or put its weight in a "
            "parameter group without them."
        )
    eps = float(own.get("eps", config.eps))
    counterpart = ROW_COUNTERPARTS[name]
    if counterpart == "sgd":
        return {"name": "sgd", "hyper": {}}
    if counterpart == "adagrad":
        return {"name": "adagrad",
                "hyper": {"initial_accumulator_value": float(own.get(
                    "initial_accumulator_value", config.initial_accumulator_value)),
                    "epsilon": eps}}
    beta1, beta2 = own.get("betas", config.betas)
    return {"name": "lazy_adam", "hyper": {"beta1": float(beta1), "beta2": float(beta2),
                                           "epsilon": eps}}
