"""Server-side optimizers: updates applied by a ps shard to its flat buffer.

Each optimizer updates a float32 parameter buffer in place from a gradient
buffer with exactly the arithmetic of the matching ``torch.optim`` class
(``SGD`` with or without momentum, ``Adam``, ``Adagrad``; L2 weight decay added
to the gradient). The work is done block by block with small scratch buffers
(in-place ufuncs with ``out=``), so an update allocates nothing; the gradient
is only read, so it may be a read-only view of received bytes, and a gradient
may be applied range by range as it arrives (:meth:`ServerOptimizer.apply_range`).

numpy only: a ps task needs neither torch nor a GPU.

Example:
    >>> import numpy as np
    >>> opt = make_optimizer("momentum", 3, momentum=0.9)
    >>> p = np.ones(3, np.float32)
    >>> opt.apply(p, np.full(3, 2.0, np.float32), lr=0.1)
    >>> p.tolist(), opt.slots["momentum_buffer"].tolist()
    ([0.800000011920929, 0.800000011920929, 0.800000011920929], [2.0, 2.0, 2.0])
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from towerflow.errors import InvalidArgumentError
from towerflow.ps.spec.dense import SLOT_NAMES, canonical_name, check_optimizer_name

__all__ = ["ServerOptimizer", "make_optimizer"]
_BLOCK = 1 << 16  # elements per block: 256 KiB of float32, cache friendly
#: the largest magnitude an update may bring a parameter or slot to: a quarter of float32's
#: range, so that updates applied side by side (streamed pushes) cannot overflow either
RESULT_LIMIT = float(np.finfo(np.float32).max) / 4


def absmax(values: np.ndarray) -> float:
    """The largest magnitude in ``values`` (NaN when it holds one; two reductions, no copy)."""
    if not values.size:
        return 0.0
    return max(float(values.max()), -float(values.min()))


def _blocks(n: int) -> Iterator[slice]:
    for start in range(0, n, _BLOCK):
        yield slice(start, min(start + _BLOCK, n))


class ServerOptimizer:
    """An optimizer over one flat float32 buffer.

    Attributes:
        name: ``sgd``, ``momentum``, ``adam`` or ``adagrad``.
        slots: the state buffers by name (same length as the parameters).
        step: number of updates applied (Adam's bias correction uses it).
    """

    __slots__ = ("name", "numel", "momentum", "weight_decay", "beta1", "beta2", "eps",
                 "initial_accumulator_value", "slots", "step", "lr_ranges", "_max_factor",
                 "_range_starts",
                 "_scratch", "_maxima")

    def __init__(self, name: str, numel: int, *, momentum: float = 0.0,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, initial_accumulator_value: float = 0.0,
                 slots: Mapping[str, np.ndarray] | None = None,
                 lr_ranges: Sequence[tuple[int, int, float]] = ()) -> None:
        name = canonical_name(check_optimizer_name(name), momentum)
        self.name = name
        self.numel = numel
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps = float(eps)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.step = 0
        #: ``(first, count, factor)``: elements whose rate is ``factor`` times the one applied
        self.lr_ranges = tuple(sorted((int(a), int(n), float(f)) for a, n, f in lr_ranges))
        ends = [a + n for a, n, _ in self.lr_ranges]
        if any(a < 0 or n < 0 or e > numel for (a, n, _), e in zip(self.lr_ranges, ends,
                                                                      strict=True)) \
                or any(e > b for e, (b, _, _) in zip(ends, self.lr_ranges[1:], strict=False)):
            raise InvalidArgumentError(
                f"Learning-rate ranges {list(self.lr_ranges)[:4]} overlap or leave the "
                f"{numel} elements; give each variable's range once.")
        self._max_factor = max([1.0, *(f for _, _, f in self.lr_ranges)])
        self._range_starts = [a for a, _, _ in self.lr_ranges]
        #: upper bounds of the buffers' magnitudes after the updates checked so far
        self._maxima: dict[str, float] | None = None
        #: each thread's scratch blocks (ranges are applied side by side, see apply_range)
        self._scratch = threading.local()
        given = dict(slots or {})
        self.slots: dict[str, np.ndarray] = {}
        for key in SLOT_NAMES[name]:
            buf = given.pop(key, None)
            fill = self.initial_accumulator_value if key == "sum" else 0.0
            if buf is None:  # zeros are mapped lazily: pages are touched when first written
                buf = np.full(numel, fill, np.float32) if fill else np.zeros(numel, np.float32)
            elif buf.dtype != np.float32 or buf.shape != (numel,):
                raise InvalidArgumentError(
                    f"Optimizer state {key!r} must be {numel} float32 values, got "
                    f"{buf.dtype} of shape {list(buf.shape)}."
                )
            self.slots[key] = buf
        if given:
            raise InvalidArgumentError(
                f"{name} keeps {list(SLOT_NAMES[name]) or 'no state'}, not {sorted(given)}."
            )

    def load_slots(self, slots: Mapping[str, np.ndarray], step: int) -> None:
        """Replace the state with ``slots`` (from a checkpoint) and the step count."""
        for key, buf in self.slots.items():
            value = slots.get(key)
            if value is None:
                continue
            if value.size != buf.size:
                raise InvalidArgumentError(
                    f"Optimizer state {key!r} has {value.size} elements but the shard holds "
                    f"{buf.size}; restore a checkpoint written for this model."
                )
            buf[...] = value.reshape(-1)
        self.step = int(step)
        self._maxima = None

    def check_result(self, params: np.ndarray, grad_max: float, lr: float) -> float | None:
        """Whether one more update can be applied without a non-finite parameter or slot.

        Bounds the magnitude every parameter, slot and intermediate can reach
        after an update with rate ``lr`` from gradients of magnitude at most
        ``grad_max``, in float64, from upper bounds of the buffers' magnitudes
        (kept from the previous checks, measured when none are kept or when the
        kept ones are too loose). Under :data:`RESULT_LIMIT` the update is
        accepted and its bounds kept (so updates checked one after the other and
        applied side by side stay finite); else the bound is returned and
        nothing is kept. Callers check one update at a time.
        """
        kept = self._maxima
        for maxima in (kept, None) if kept is not None else (None,):
            if maxima is None:
                maxima = {"params": absmax(params),
                          **{key: absmax(buf) for key, buf in self.slots.items()}}
            after = self._bounds(maxima, grad_max, lr * self._max_factor, self.step + 1)
            worst = max(after.values())
            if worst <= RESULT_LIMIT:  # False for NaN
                after.pop("intermediate", None)
                self._maxima = {**maxima, **after}
                return None
        return worst

    def _bounds(self, cur: Mapping[str, float], grad_max: float, lr: float,
                step: int) -> dict[str, float]:
        p = cur["params"]
        g = grad_max + self.weight_decay * p
        if self.name == "sgd":
            return {"params": p + lr * g}
        if self.name == "momentum":
            b = g if step == 1 else self.momentum * cur["momentum_buffer"] + g
            return {"momentum_buffer": b, "params": p + lr * b}
        if self.name == "adam":
            m0 = cur["exp_avg"]
            m = self.beta1 * m0 + (1.0 - self.beta1) * g
            v = self.beta2 * cur["exp_avg_sq"] + (1.0 - self.beta2) * g * g
            rate = lr / (1.0 - self.beta1 ** step)  # a float32 factor of the update itself
            step_size = rate * m / self.eps
            return {"exp_avg": m, "exp_avg_sq": v, "params": p + step_size,
                    "intermediate": max(g + m0, g * g, rate)}
        acc = cur["sum"] + g * g  # adagrad
        return {"sum": acc, "params": p + lr * g / self.eps, "intermediate": g * g}

    def begin(self) -> int:
        """Count one more update and return its number (Adam's bias correction uses it).

        A gradient applied in pieces (:meth:`apply_range`) takes its number once.
        """
        self.step += 1
        return self.step

    def apply(self, params: np.ndarray, grad: np.ndarray, lr: float) -> None:
        """Update ``params`` in place from ``grad`` (left unchanged) with rate ``lr``."""
        self.apply_range(params, 0, grad, lr, self.begin())

    def apply_range(self, params: np.ndarray, first: int, grad: np.ndarray, lr: float,
                    step: int) -> None:
        """Update ``params[first:first + grad.size]`` (and the state) from ``grad``.

        ``grad`` may be read-only (a view of received bytes); ``step`` is the
        update's number from :meth:`begin`; the elements of :attr:`lr_ranges`
        take ``lr`` times their factor. Not thread-safe: one caller at a time
        on one range (the shard holds that range's lock); callers on disjoint
        ranges may run side by side (each thread has its own scratch blocks).
        """
        end, at = first + grad.size, first
        index = max(0, bisect.bisect_right(self._range_starts, first) - 1)
        for start, count, factor in self.lr_ranges[index:]:
            if start >= end:
                break
            lo, hi = max(start, at), min(start + count, end)
            if lo >= hi:
                continue
            if lo > at:
                self._apply_run(params, at, grad[at - first:lo - first], lr, step)
            self._apply_run(params, lo, grad[lo - first:hi - first], lr * factor, step)
            at = hi
        if at < end:
            self._apply_run(params, at, grad[at - first:], lr, step)

    def _apply_run(self, params: np.ndarray, first: int, grad: np.ndarray, lr: float,
                   step: int) -> None:
        """:meth:`apply_range` at one rate."""
        method = getattr(self, f"_apply_{self.name}")
        decay = self.weight_decay
        scratch, decayed = self._blocks_of_thread()
        for start in range(0, grad.size, _BLOCK):
            g = grad[start:start + _BLOCK]
            block = slice(first + start, first + start + g.size)
            p = params[block]
            tmp = scratch[: g.size]
            if decay:
                np.multiply(p, decay, out=tmp)
                tmp += g
                g, tmp = tmp, decayed[: g.size]
            method(block, p, g, tmp, lr, step)

    def _blocks_of_thread(self) -> tuple[np.ndarray, np.ndarray]:
        """This thread's scratch block and weight-decay block (made on first use)."""
        local = self._scratch
        blocks = getattr(local, "blocks", None)
        if blocks is None:
            size = min(self.numel, _BLOCK)
            blocks = local.blocks = (np.empty(size, np.float32),
                                     np.empty(size if self.weight_decay else 0, np.float32))
        return blocks

    def _apply_sgd(self, block: slice, p: np.ndarray, g: np.ndarray, tmp: np.ndarray,
                   lr: float, step: int) -> None:
        np.multiply(g, lr, out=tmp)
        p -= tmp

    def _apply_momentum(self, block: slice, p: np.ndarray, g: np.ndarray, tmp: np.ndarray,
                        lr: float, step: int) -> None:
        buf = self.slots["momentum_buffer"][block]
        if step == 1:
            buf[...] = g
        else:
            buf *= self.momentum
            buf += g
        np.multiply(buf, lr, out=tmp)
        p -= tmp

    def _apply_adam(self, block: slice, p: np.ndarray, g: np.ndarray, tmp: np.ndarray,
                    lr: float, step: int) -> None:
        m, v = self.slots["exp_avg"][block], self.slots["exp_avg_sq"][block]
        b1, b2 = self.beta1, self.beta2
        # exp_avg.lerp_(grad, 1 - beta1)
        np.subtract(g, m, out=tmp)
        tmp *= 1.0 - b1
        m += tmp
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        v *= b2
        np.multiply(g, g, out=tmp)
        tmp *= 1.0 - b2
        v += tmp
        bias1 = 1.0 - b1 ** step
        bias2_sqrt = math.sqrt(1.0 - b2 ** step)
        # denom = sqrt(v) / sqrt(bias2) + eps ; p -= lr / bias1 * m / denom
        np.sqrt(v, out=tmp)
        tmp /= bias2_sqrt
        tmp += self.eps
        np.divide(m, tmp, out=tmp)
        tmp *= lr / bias1
        p -= tmp

    def _apply_adagrad(self, block: slice, p: np.ndarray, g: np.ndarray, tmp: np.ndarray,
                       lr: float, step: int) -> None:
        acc = self.slots["sum"][block]
        np.multiply(g, g, out=tmp)
        acc += tmp
        np.sqrt(acc, out=tmp)
        tmp += self.eps
        np.divide(g, tmp, out=tmp)
        tmp *= lr
        p -= tmp


def make_optimizer(name: str, numel: int, **options: Any) -> ServerOptimizer:
    """Return a :class:`ServerOptimizer` ``name`` over ``numel`` elements.

    ``options`` are ``momentum``, ``weight_decay``, ``betas``, ``eps``,
    ``initial_accumulator_value``, ``slots`` (state buffers to adopt, e.g.
    received from the chief) and ``lr_ranges`` (``(first, count, factor)``: the
    rate of those elements is ``factor`` times the one applied); unknown keys are
    an error.
    """
    allowed = {"momentum", "weight_decay", "betas", "eps", "initial_accumulator_value", "slots",
               "lr_ranges"}
    unknown = set(options) - allowed
    if unknown:
        raise InvalidArgumentError(
            f"Unknown optimizer options {sorted(unknown)}; use {sorted(allowed)}."
        )
    return ServerOptimizer(name, numel, **options)  # type: ignore[arg-type]
