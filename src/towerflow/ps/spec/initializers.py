"""Row initializers: the value of a table's row before its first update.

A row's start is a function of its id only (a hash of ``(seed, id, column)``),
so a table's start does not depend on how it is sharded and a dynamic table
can make a row on first touch. An initializer travels as its description
(:meth:`RowInitializer.to_dict`: ``{"kind", ...}``) and is rebuilt by
:func:`initializer_from_dict`.

Example:
    >>> import torch
    >>> UniformRows(-1.0, 1.0, seed=3)(torch.tensor([7]), 2, torch.float32).shape
    torch.Size([1, 2])
    >>> initializer_from_dict({"kind": "constant", "value": 0.5})
    ConstantRows(value=0.5)
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from towerflow.errors import InvalidArgumentError
from towerflow.ps.partition import _GOLDEN
from towerflow.ps.partition import shift_right as _shift
from towerflow.ps.partition import splitmix64 as _splitmix64

__all__ = ["RowInitializer", "ConstantRows", "UniformRows", "NormalRows",
           "initializer_from_dict", "DEFAULT_INITIALIZER"]

#: the default row initializer's description: uniform in [-0.05, 0.05), a function of the id
DEFAULT_INITIALIZER: dict[str, Any] = {"kind": "uniform", "minval": -0.05, "maxval": 0.05,
                                       "seed": 0}


class RowInitializer(abc.ABC):
    """The value of a row before its first update: a function of the id only.

    Being a function of the id, a table's start does not depend on how it is
    sharded, and a dynamic table can create a row on first touch.
    """

    __slots__ = ()

    kind: ClassVar[str]

    @abc.abstractmethod
    def __call__(self, ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """``(len(ids), dim)`` rows for ``ids``."""

    def to_dict(self) -> dict[str, Any]:
        """``{"kind": ..., **fields}``; :func:`initializer_from_dict` reads it."""
        return {"kind": self.kind, **asdict(self)}  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class ConstantRows(RowInitializer):
    """Every element ``value`` (zeros by default)."""

    kind: ClassVar[str] = "constant"
    value: float = 0.0

    def __post_init__(self) -> None:
        if not _is_finite_number(self.value):
            raise InvalidArgumentError(f"ConstantRows: value must be finite, got {self.value!r}.")

    def __call__(self, ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((ids.numel(), dim), float(self.value), dtype=dtype)


@dataclass(frozen=True, slots=True)
class UniformRows(RowInitializer):
    """Uniform in ``[minval, maxval)``, drawn from a hash of ``(seed, id, column)``."""

    kind: ClassVar[str] = "uniform"
    minval: float = -0.05
    maxval: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if not (_is_finite_number(self.minval) and _is_finite_number(self.maxval)
                and self.minval <= self.maxval):
            raise InvalidArgumentError(
                f"UniformRows: need finite minval <= maxval, got {self.minval!r}, "
                f"{self.maxval!r}."
            )
        _check_seed("UniformRows", self.seed)

    def __call__(self, ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        key = _splitmix64(_splitmix64(ids ^ self.seed))
        cols = torch.arange(dim, dtype=torch.int64) * _GOLDEN
        bits = _shift(_splitmix64(key[:, None] + cols), 40)  # 24 random bits
        unit = bits.to(torch.float64) * (1.0 / (1 << 24))
        return (self.minval + (self.maxval - self.minval) * unit).to(dtype)


@dataclass(frozen=True, slots=True)
class NormalRows(RowInitializer):
    """Normal with ``mean`` and ``std``, drawn from a hash of ``(seed, id, column)``.

    Box-Muller over two 26-bit uniforms per value: ``nn.Embedding``'s own
    start (N(0, 1)) as a function of the id, so any shard gives the same row.

    Example:
        >>> rows = NormalRows(seed=1)(torch.arange(2000), 50, torch.float64)
        >>> abs(float(rows.mean())) < 0.01, abs(float(rows.std()) - 1.0) < 0.01
        (True, True)
    """

    kind: ClassVar[str] = "normal"
    mean: float = 0.0
    std: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (_is_finite_number(self.mean) and _is_finite_number(self.std) and self.std >= 0):
            raise InvalidArgumentError(
                f"NormalRows: need a finite mean and std >= 0, got {self.mean!r}, {self.std!r}."
            )
        _check_seed("NormalRows", self.seed)

    def __call__(self, ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        key = _splitmix64(_splitmix64(ids ^ self.seed) + 1)
        cols = torch.arange(dim, dtype=torch.int64) * _GOLDEN
        bits = _splitmix64(key[:, None] + cols)
        scale = 1.0 / (1 << 26)
        u1 = (_shift(bits, 38).to(torch.float64) + 1.0) * scale  # (0, 1]
        u2 = (bits & ((1 << 26) - 1)).to(torch.float64) * scale  # [0, 1)
        normal = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        return (self.mean + self.std * normal).to(dtype)


def _check_seed(cls_name: str, seed: object) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise InvalidArgumentError(
            f"{cls_name}: seed must be an integer in [0, 2**63), got {seed!r}."
        )


_INITIALIZERS: dict[str, type[RowInitializer]] = {"constant": ConstantRows,
                                                  "uniform": UniformRows,
                                                  "normal": NormalRows}


def initializer_from_dict(data: Mapping[str, Any]) -> RowInitializer:
    """Rebuild an initializer from :meth:`RowInitializer.to_dict`'s dict."""
    kind = data.get("kind") if isinstance(data, Mapping) else None
    if kind not in _INITIALIZERS:
        raise InvalidArgumentError(
            f"A row initializer is a dict with 'kind' one of {sorted(_INITIALIZERS)}, got "
            f"{data!r:.200}."
        )
    fields = {k: v for k, v in data.items() if k != "kind"}
    try:
        return _INITIALIZERS[kind](**fields)
    except TypeError as err:
        raise InvalidArgumentError(f"Bad {kind!r} initializer fields {sorted(fields)}: {err}.") \
            from None


def _is_finite_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))
