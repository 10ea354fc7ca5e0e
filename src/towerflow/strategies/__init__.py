"""Strategies: how a training step runs (single device, mirrored, parameter server)."""

from __future__ import annotations

from typing import Any

from towerflow.strategies.base import (
    STRATEGIES,
    OptimizerConfig,
    StepResult,
    Strategy,
    get_strategy_class,
)

__all__ = [
    "Strategy",
    "StepResult",
    "OptimizerConfig",
    "get_strategy_class",
    "STRATEGIES",
    "SingleDevice",
    "Mirrored",
    "ParameterServer",
]

_CLASSES = {"SingleDevice": "single", "Mirrored": "mirrored", "ParameterServer": "ps"}


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        return get_strategy_class(_CLASSES[name])
    raise AttributeError(f"module 'towerflow.strategies' has no attribute {name!r}")
